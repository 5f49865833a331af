"""Per-token log-probabilities of targets from hidden states, without a [B, T, V] tensor.

The output layer is applied chunk by chunk along T inside a rematerialized scan: each chunk
builds float32 logits [B, C, V], takes log-softmax at the targets and the entropy, and is
recomputed in the backward pass instead of stored. For a 7B model at T = 4096 the full logits
would be 2.5 GB per sequence in float32; here only one chunk is live. Small logits (at most
`SMALL_LOGITS_BYTES` for the whole batch: toy and test models) are computed in one piece, without
the remat, which on XLA CPU costs more than it saves.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from codedance_jax import sharding as shd
from codedance_jax.model.layers import matmul

# Logits up to this size (float32, the whole batch) are computed in one piece without the remat:
# on XLA CPU the rematerialized map cost a small model's SFT step 35% (Tunix's sizes, 8 x 256 x 1024:
# 0.99 s vs 0.73 s, one process; issue 14), and 256 MiB of logits is small next to any accelerator.
SMALL_LOGITS_BYTES = 1 << 28


def token_logprobs(h_btd, w_dv, targets_bt, *, temperature: float = 1.0, chunk: int = 512, with_entropy: bool = False):
    """log softmax(h @ w / temperature)[targets] -> float32[B, T] (and entropy [B, T])."""
    b, t, d = h_btd.shape

    def one(h, tg):
        logits = matmul(h, w_dv.astype(h.dtype)).astype(jnp.float32) / temperature  # 2-D: see layers.matmul
        lse = jax.nn.logsumexp(logits, axis=-1)
        lp = jnp.take_along_axis(logits, tg[..., None], axis=-1)[..., 0] - lse
        if not with_entropy:
            return lp, jnp.zeros_like(lp)
        p = jnp.exp(logits - lse[..., None])
        ent = lse - jnp.sum(p * logits, axis=-1)
        return lp, ent

    if b * t * w_dv.shape[1] * 4 <= SMALL_LOGITS_BYTES:
        lp, ent = one(h_btd, targets_bt)
        return (lp, ent) if with_entropy else lp
    c = min(chunk, t)
    pad = (-t) % c
    if pad:
        h_btd = jnp.pad(h_btd, ((0, 0), (0, pad), (0, 0)))
        targets_bt = jnp.pad(targets_bt, ((0, 0), (0, pad)))
    n = (t + pad) // c
    hs = h_btd.reshape(b, n, c, d).swapaxes(0, 1)  # [n, B, C, D]
    ts = targets_bt.reshape(b, n, c).swapaxes(0, 1)
    lp, ent = jax.lax.map(lambda a: jax.checkpoint(one)(*a), (hs, ts))
    lp = lp.swapaxes(0, 1).reshape(b, -1)[:, :t]
    ent = ent.swapaxes(0, 1).reshape(b, -1)[:, :t]
    return (lp, ent) if with_entropy else lp


def output_weight(model):
    """[D, V] in the compute dtype: the lm_head, or the transposed embedding for tied models.

    Gathered once per call under `sharding.compute_sharding` (FSDP), outside the chunk loop: left
    sharded on D, XLA computed every chunk's logits for the global batch (issue 19).
    """
    dt = model.cfg.compute_dtype
    return shd.gather_param(model.embed, dt).T if model.lm_head is None else shd.gather_param(model.lm_head, dt)
