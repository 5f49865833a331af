"""Fused (flash) attention on TPU for the cache-free forward: the Pallas TPU kernel, segment masks.

Why: the default XLA attention writes float32 [.., T, S] scores and probabilities to HBM. For the
7B presets at 8k text tokens (28 heads) and the vision tower's full-attention blocks over 16k
patches, that working set was 7.5 + 16 GiB per row and most of the non-matmul time of a step
(issue 19, `launch.preflight`). The kernel (`jax.experimental.pallas.ops.tpu.flash_attention`)
keeps score tiles in VMEM and saves only the per-row softmax statistics for the backward.

A kernel takes masks as *segment ids* instead of dense [B, T, S] booleans: query t may see key s
iff their ids are equal (and s <= t when causal). Every mask of the cache-free forward is of that
form: `text.causal_mask` (ids = attention_mask: padding keys get id 0, valid ones 1),
`text.segment_mask` (ids = packed segment, -1 on padding) and the vision tower's per-image full
attention (ids = image id, -1 on padding). Padding *queries* then attend to padding keys where the
dense mask gives them nothing: their outputs differ, but no valid position reads them and the
losses mask them.

`ModelConfig.attention`: "xla" (default: CPU, GPU, tests), "flash" (TPU), or "auto" (flash when the
target platform is TPU; `resolve`). Cache steps (prefill into a cache, decode, appends) and the
vision tower's small window blocks keep the XLA path.

A Pallas call cannot be partitioned by XLA (jit refuses: "Mosaic kernels cannot be automatically
partitioned"). So the kernel is used only under `sharding.compute_sharding` (the training and
log-prob steps enter it, on any mesh, one device included), where it runs under `shard_map`: batch
over the batch mesh axes and heads over `tensor` where they divide, each chip on its own rows and
heads.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from codedance_jax import sharding as shd

IMPLS = ("xla", "flash", "auto")
# Sequence lengths the kernel is used at: tiles of up to 512 rows must divide them (MIN_BLOCK 128).
MIN_LEN = 128
BLOCKS = (512, 256, 128)


def check(name: str) -> str:
    if name not in IMPLS:
        raise ValueError(f"model attention={name!r}: choose one of {', '.join(IMPLS)} "
                         "(--config.attention=flash runs the Pallas TPU kernel; xla runs anywhere)")
    return name


def resolve(name: str, platform: str | None = None) -> str:
    """'auto' -> 'flash' when the target platform (default: jax's default backend) is TPU, else 'xla'."""
    check(name)
    if name != "auto":
        return name
    return "flash" if (platform or jax.default_backend()) == "tpu" else "xla"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Segments:
    """A mask as segment ids: q int32[B, T], kv int32[B, S]; causal adds s <= t (S = T)."""

    q: jax.Array
    kv: jax.Array
    causal: bool = dataclasses.field(metadata=dict(static=True), default=False)


def tiles_fit(length: int) -> bool:
    """The kernel's tiles (128 to 512 rows) divide a sequence of this length."""
    return length >= MIN_LEN and length % MIN_LEN == 0


def usable(length: int) -> bool:
    """The kernel serves this call: tiles divide the length, and the call is traced under
    `sharding.compute_sharding` (the training and log-prob steps), which names the mesh its
    `shard_map` needs. Elsewhere (the rollout engine's vision calls on a row-split mesh, eval,
    serving) a Mosaic call cannot be partitioned by XLA, so those keep the XLA path."""
    return tiles_fit(length) and shd.compute_sharding_active()


def _block(n: int) -> int:
    return next(b for b in BLOCKS if n % b == 0)


def _kernel_call(q, k, v, seg_q, seg_kv, *, causal: bool, scale: float):
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    bq, bk = _block(q.shape[2]), _block(k.shape[2])
    sizes = fa.BlockSizes(block_q=bq, block_k_major=bk, block_k=bk, block_b=1,
                          block_q_major_dkv=bq, block_k_major_dkv=bk, block_k_dkv=bk, block_q_dkv=bq,
                          block_k_major_dq=bk, block_k_dq=bk, block_q_dq=bq)
    return fa.flash_attention(q, k, v, segment_ids=fa.SegmentIds(seg_q, seg_kv), causal=causal,
                              sm_scale=scale, block_sizes=sizes)


def attend(q_bnth, k_bksh, v_bksh, seg: Segments, scale: float):
    """Attention of q [B, N, T, H] over keys and values [B, K, S, H] (K divides N: grouped-query
    heads (k, g) in q's order) under `seg`; returns [B, N, T, H] in q's dtype."""
    b, n, t, _ = q_bnth.shape
    groups = n // k_bksh.shape[1]
    if groups > 1:  # the kernel takes one key head per query head: repeat each KV head for its group
        k_bksh, v_bksh = (jnp.repeat(x, groups, axis=1) for x in (k_bksh, v_bksh))
    k_bksh, v_bksh = k_bksh.astype(q_bnth.dtype), v_bksh.astype(q_bnth.dtype)
    sq, skv = seg.q.astype(jnp.int32), seg.kv.astype(jnp.int32)
    call = lambda q, k, v, a, c: _kernel_call(q, k, v, a, c, causal=seg.causal, scale=scale)  # noqa: E731
    mesh, batch_axes, head_axis = shd.kernel_specs(b, n)  # `usable` checked that there is a context
    x = P(batch_axes, head_axis, None, None)
    s = P(batch_axes, None)
    return jax.shard_map(call, mesh=mesh, in_specs=(x, x, x, s, s), out_specs=x, check_vma=False)(
        q_bnth, k_bksh, v_bksh, sq, skv)
