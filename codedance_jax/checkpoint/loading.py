"""`from_pretrained`: a Hugging Face directory or a converted orbax checkpoint -> (model, processor)."""

from __future__ import annotations

import os

import jax

from codedance_jax import sharding as shd
from codedance_jax.checkpoint import hf, orbax_io
from codedance_jax.errors import MissingPathError
from codedance_jax.model.config import ModelConfig


def from_pretrained(path, dtype: str = "float32", mesh: jax.sharding.Mesh | None = None, *,
                    compute_dtype: str | None = None, rules=None, processor: bool = True, padding_side: str = "left",
                    sharding_tolerance: float = shd.DEFAULT_SHARDING_TOLERANCE):
    """Loads model and processor.

    dtype: parameter dtype (the checkpoint is cast on load); compute dtype follows it unless
      `compute_dtype` is given. RMSNorm, softmax and rope stay float32 either way.
    mesh: place each parameter's shards on this mesh as it is read (logical rules from
      `codedance_jax.sharding`, or `rules`).
    sharding_tolerance: the largest fraction of parameter elements that may keep a dimension
      unsharded because the mesh does not divide it; past it `ShardingError` names them.
    padding_side: the processor pads on this side ("left" for generation, the default here).
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise MissingPathError(f"{path}: not a directory; expected a Hugging Face Qwen2.5-VL checkpoint or a converted one.")
    cfg = ModelConfig.from_hf_config(path).replace(param_dtype=str(dtype), dtype=str(compute_dtype or dtype))
    if orbax_io.is_orbax_dir(path):
        model = orbax_io.load(path, cfg, mesh=mesh, rules_table=rules, sharding_tolerance=sharding_tolerance)
    elif hf.is_hf_dir(path):
        model = hf.load_hf_model(path, cfg, mesh=mesh, rules_table=rules,
                                  sharding_tolerance=sharding_tolerance)
    else:
        raise MissingPathError(
            f"{path}: neither *.safetensors (Hugging Face) nor {orbax_io.MARKER} (converted by launch.convert) found."
        )
    proc = None
    if processor:
        from codedance_jax.processing import Processor

        proc = Processor.from_pretrained(path, padding_side=padding_side)
    return model, proc
