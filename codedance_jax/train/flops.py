"""Model FLOPs for the MFU estimate (the formula is stated so numbers can be compared).

Per trained token (forward + backward = 3x forward):
    6 * (decoder params without the embedding table + output layer params)
  + 12 * L * D * T_ctx        (attention scores and weighted values, no causal discount)
Per image patch: 6 * vision params (window attention cost ignored, it is < 3% at 64-patch windows).
MFU = achieved model FLOP/s / (devices * peak FLOP/s per device from the config).
"""

from __future__ import annotations

from codedance_jax.model.config import ModelConfig


def text_params(cfg: ModelConfig) -> int:
    t = cfg.text
    d, f, n, k, h = t.hidden_size, t.intermediate_size, t.num_attention_heads, t.num_key_value_heads, t.head_dim
    per_layer = d * n * h + n * h + 2 * (d * k * h + k * h) + n * h * d + 3 * d * f + 2 * d
    return t.num_hidden_layers * per_layer + d + d * t.vocab_size  # + final norm + output layer


def vision_params(cfg: ModelConfig) -> int:
    v = cfg.vision
    dv, fv, d4 = v.hidden_size, v.intermediate_size, v.hidden_size * v.merge_unit
    blk = 2 * dv + 3 * dv * dv + 3 * dv + dv * dv + dv + 3 * dv * fv + 2 * fv + dv
    return v.patch_dim * dv + v.depth * blk + dv + d4 * d4 + d4 + d4 * v.out_hidden_size + v.out_hidden_size


def train_flops(cfg: ModelConfig, tokens: float, seq_len: int, patches: float = 0.0) -> float:
    t = cfg.text
    per_token = 6 * text_params(cfg) + 12 * t.num_hidden_layers * t.hidden_size * seq_len
    return per_token * tokens + 6 * vision_params(cfg) * patches
