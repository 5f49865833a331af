"""The declarative table between Hugging Face tensor names and NNX parameter paths.

One `Rule` per tensor: its name in the released checkpoints, its path in `Qwen25VL`, its torch
shape and its kind. `linear` tensors are torch `[out, in...]` (Linear, Conv3d) and are stored here
as `[in..., out...]` (einsum-ready, heads split out); `copy` tensors only change shape.
Both directions use the same table, so HF -> ours -> HF is the identity bit for bit.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from codedance_jax.model.config import ModelConfig

# `transformers` v5 keeps these prefixes in memory; checkpoints on disk (and what v5 writes) use
# the released layout on the right. Both are accepted when loading.
HF_ALIASES = (("model.language_model.", "model."), ("model.visual.", "visual."))


@dataclasses.dataclass(frozen=True)
class Rule:
    hf_name: str
    path: tuple  # NNX state path
    hf_shape: tuple[int, ...]
    shape: tuple[int, ...]
    kind: str  # "linear" | "copy"

    def to_ours(self, x: np.ndarray) -> np.ndarray:
        if self.kind == "linear":
            x = x.reshape(self.hf_shape[0], -1).T
        return np.ascontiguousarray(x.reshape(self.shape))

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        if self.kind == "linear":
            x = x.reshape(-1, self.hf_shape[0]).T
        return np.ascontiguousarray(x.reshape(self.hf_shape))


def rules(cfg: ModelConfig) -> list[Rule]:
    v, t = cfg.vision, cfg.text
    dv, nv, hv, fv = v.hidden_size, v.num_heads, v.head_dim, v.intermediate_size
    d, n, k, h, f = t.hidden_size, t.num_attention_heads, t.num_key_value_heads, t.head_dim, t.intermediate_size
    out: list[Rule] = []

    def add(hf, path, hf_shape, shape, kind):
        out.append(Rule(hf, tuple(path), tuple(hf_shape), tuple(shape), kind))

    def dense(hf, path, d_in, d_out, bias):
        add(f"{hf}.weight", (*path, "kernel"), (d_out, d_in), (d_in, d_out), "linear")
        if bias:
            add(f"{hf}.bias", (*path, "bias"), (d_out,), (d_out,), "copy")

    add("visual.patch_embed.proj.weight", ("visual", "patch_embed"),
        (dv, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size), (v.patch_dim, dv), "linear")
    for i in range(v.depth):
        hfb, b = f"visual.blocks.{i}", ("visual", "blocks", i)
        add(f"{hfb}.norm1.weight", (*b, "norm1", "scale"), (dv,), (dv,), "copy")
        add(f"{hfb}.norm2.weight", (*b, "norm2", "scale"), (dv,), (dv,), "copy")
        add(f"{hfb}.attn.qkv.weight", (*b, "attn", "qkv_kernel"), (3 * dv, dv), (dv, 3, nv, hv), "linear")
        add(f"{hfb}.attn.qkv.bias", (*b, "attn", "qkv_bias"), (3 * dv,), (3, nv, hv), "copy")
        add(f"{hfb}.attn.proj.weight", (*b, "attn", "out_kernel"), (dv, dv), (nv, hv, dv), "linear")
        add(f"{hfb}.attn.proj.bias", (*b, "attn", "out_bias"), (dv,), (dv,), "copy")
        dense(f"{hfb}.mlp.gate_proj", (*b, "mlp", "gate"), dv, fv, True)
        dense(f"{hfb}.mlp.up_proj", (*b, "mlp", "up"), dv, fv, True)
        dense(f"{hfb}.mlp.down_proj", (*b, "mlp", "down"), fv, dv, True)
    d4 = dv * v.merge_unit
    add("visual.merger.ln_q.weight", ("visual", "merger", "norm", "scale"), (dv,), (dv,), "copy")
    dense("visual.merger.mlp.0", ("visual", "merger", "fc1"), d4, d4, True)
    dense("visual.merger.mlp.2", ("visual", "merger", "fc2"), d4, v.out_hidden_size, True)

    add("model.embed_tokens.weight", ("embed",), (t.vocab_size, d), (t.vocab_size, d), "copy")
    for i in range(t.num_hidden_layers):
        hfl, l_ = f"model.layers.{i}", ("layers", i)
        add(f"{hfl}.input_layernorm.weight", (*l_, "input_norm", "scale"), (d,), (d,), "copy")
        add(f"{hfl}.post_attention_layernorm.weight", (*l_, "post_attn_norm", "scale"), (d,), (d,), "copy")
        for name, heads in (("q", n), ("k", k), ("v", k)):
            add(f"{hfl}.self_attn.{name}_proj.weight", (*l_, "attn", f"{name}_kernel"), (heads * h, d), (d, heads, h), "linear")
            add(f"{hfl}.self_attn.{name}_proj.bias", (*l_, "attn", f"{name}_bias"), (heads * h,), (heads, h), "copy")
        add(f"{hfl}.self_attn.o_proj.weight", (*l_, "attn", "o_kernel"), (d, n * h), (n, h, d), "linear")
        dense(f"{hfl}.mlp.gate_proj", (*l_, "mlp", "gate"), d, f, False)
        dense(f"{hfl}.mlp.up_proj", (*l_, "mlp", "up"), d, f, False)
        dense(f"{hfl}.mlp.down_proj", (*l_, "mlp", "down"), f, d, False)
    add("model.norm.weight", ("norm", "scale"), (d,), (d,), "copy")
    if not t.tie_word_embeddings:
        add("lm_head.weight", ("lm_head",), (t.vocab_size, d), (d, t.vocab_size), "linear")
    assert all(math.prod(r.hf_shape) == math.prod(r.shape) for r in out)
    return out


def canonical_hf_name(name: str) -> str:
    for alias, canon in HF_ALIASES:
        if name.startswith(alias):
            return canon + name[len(alias):]
    return name
