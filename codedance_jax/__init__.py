"""codedance-jax: CodeDance (executable visual reasoning) on JAX/Flax NNX.

`from_pretrained(path, dtype=..., mesh=None) -> (model, processor)` loads a Hugging Face
Qwen2.5-VL directory or a checkpoint converted by `python -m launch.convert`.
"""

from __future__ import annotations


def from_pretrained(path, dtype="float32", mesh=None, **kwargs):
    from codedance_jax.checkpoint.loading import from_pretrained as _load

    return _load(path, dtype=dtype, mesh=mesh, **kwargs)


__all__ = ["from_pretrained"]
