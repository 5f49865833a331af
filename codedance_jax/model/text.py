"""The Qwen2 decoder of Qwen2.5-VL: GQA attention with q/k/v biases, RMSNorm, SwiGLU, M-RoPE.

One attention code path serves the full forward and every cache step. With a cache, a chunk of
C tokens (a prompt, one decoded token, or an observation appended mid-trajectory) is written at
slots [index, index + C) of a static [B, S] cache; a query at slot s sees the valid slots <= s.
Validity is per slot, so left padding, sequences that sit out a step, and ragged chunks all
leave holes that nobody attends to. Positions are explicit M-RoPE ids, not slot numbers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from codedance_jax import sharding as shd
from codedance_jax.model import flash, rope
from codedance_jax.model.config import TextConfig
from codedance_jax.model.layers import RMSNorm, SwiGLU, masked_softmax, matmul, param

# Query rows per causal block of the cache-free forward (see `Attention._attend_heads_major`).
CAUSAL_BLOCK = 64
# Query tokens per step of a chunk's attention over a cache (an observation appended mid-trajectory),
# one step after another (`Attention._attend_cache_blocks`).
EXTEND_BLOCK = 64


class Attention(nnx.Module):
    def __init__(self, cfg: TextConfig, *, dtype, rngs: nnx.Rngs, grouped_decode: bool = False):
        d, n, k, h = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_kernel = param(rngs, (d, n, h), ("embed", "q_heads", "head_dim"), dtype)
        self.q_bias = param(rngs, (n, h), ("q_heads", "head_dim"), dtype, init="zeros")
        self.k_kernel = param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), dtype)
        self.k_bias = param(rngs, (k, h), ("kv_heads", "head_dim"), dtype, init="zeros")
        self.v_kernel = param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), dtype)
        self.v_bias = param(rngs, (k, h), ("kv_heads", "head_dim"), dtype, init="zeros")
        self.o_kernel = param(rngs, (n, h, d), ("q_heads", "head_dim", "embed"), dtype)
        self.groups = n // k
        self.scale = h**-0.5
        # A decode step's G query heads of a KV head: one M = G product (TPU), or G products of M = 1
        # (XLA CPU; see `_attend_heads_major`). The TPU compiler rewrites an M = 1 product into a
        # multiply and a reduction over an f32 copy of the cache: f32[256, 1, 9216, 128], 1.12 GiB
        # per layer and chip in the 7B rollout's decode (issue 37's preflight).
        self.grouped_decode = grouped_decode

    def __call__(self, x_btd, cos_bth, sin_bth, mask_bts, kv_cache=None, index=None, fresh=False):
        """Returns (out [B, T, D], (k, v) heads-major [B, K, T or S, H]); with kv_cache=(k [B, K, S, H], v)
        the chunk is written at slots [index, index + T). fresh: the cache holds nothing before the
        chunk (a prompt prefill), so the chunk attends to its own keys only, with the cache-free
        forward's blocked causal attention (mask_bts is then the chunk's [B, T, T] causal mask)."""
        dt = x_btd.dtype
        q = matmul(x_btd, shd.gather_param(self.q_kernel, dt)) + shd.gather_param(self.q_bias, dt)  # [B, T, N, H]
        k = matmul(x_btd, shd.gather_param(self.k_kernel, dt)) + shd.gather_param(self.k_bias, dt)
        v = matmul(x_btd, shd.gather_param(self.v_kernel, dt)) + shd.gather_param(self.v_bias, dt)
        cos, sin = cos_bth[:, :, None], sin_bth[:, :, None]
        q, k = rope.apply_rope(q, cos, sin), rope.apply_rope(k, cos, sin)
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, T, H]: only the new chunk moves
        kc, vc = k, v
        if kv_cache is not None:
            ck, cv = kv_cache
            k = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (0, 0, index, 0))
            v = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), (0, 0, index, 0))
        if isinstance(mask_bts, flash.Segments):  # the cache-free forward with the TPU kernel
            o = flash.attend(q.transpose(0, 2, 1, 3), k, v, mask_bts, self.scale).transpose(0, 2, 1, 3)
        elif kv_cache is None or fresh:  # the chunk's own keys, as stored (a bf16 cache rounds them)
            ka, va = (kc, vc) if kv_cache is None else (kc.astype(k.dtype), vc.astype(v.dtype))
            o = self._attend_heads_major(q, ka.astype(dt), va.astype(dt), mask_bts, causal=True)
        else:
            o = self._attend_heads_major(q, k.astype(dt), v.astype(dt), mask_bts, causal=False)
        return matmul(o, shd.gather_param(self.o_kernel, dt), n_in=2), (k, v)

    def _attend_heads_major(self, q, k, v, mask_bts, *, causal: bool):
        """q [B, T, N, H] against heads-major keys and values [B, K, S, H]: two plain batched matmuls
        over [B, K, G*T, H] x [B, K, S, H]. Written with (b, k) batch dims in the middle
        (`btkgh,bskh->bkgts`), XLA CPU materializes transposed copies of the [B, K, G, T, S] logits
        and probabilities in both directions: at 8 x 256 a training forward+backward was 2-2.5x
        slower (issue 14). The cache is stored heads-major for the same reason: stored [B, S, K, H],
        every decoded token transposed the whole cache of every layer (at 64 rows x 640 slots on the
        toy model, 9.7 of a step's 25 ms), where now only the new chunk is transposed.

        causal (the cache-free forward or a fresh cache's prefill, S = T, every mask built for them is
        lower-triangular: causal or causal within segments): queries go in blocks of CAUSAL_BLOCK rows and block i only meets
        keys [0, end of block i), skipping the upper triangle. The [.., T, S] softmax elementwise
        work dominated attention in a training step; blocks do ~(n+1)/2n of it on tiles that stay
        in cache: 16 x 256 forward+backward 2.1x faster, 16 x 448 2.0x (issue 14). Rows are
        independent in a softmax and the skipped keys are masked anyway, so the values are the
        same up to float summation order."""
        b, t, n, h = q.shape
        kh, g, s = n // self.groups, self.groups, k.shape[2]
        q5 = q.reshape(b, t, kh, g, h).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, H]
        if t == 1 and g > 1 and not self.grouped_decode:
            # A one-token decode step: each of a KV head's G query heads alone (M = 1 products).
            # XLA CPU runs a [B, K] batch of M = 1 products as fused multiply-reduces, but a batch
            # of M = G = 2 or 4 ones through its generic batched matmul, which was slower although
            # it reads the cache once instead of G times (issue 14: one layer's decode attention
            # 1.2-1.45x faster at the demo's 64 rows x 256-512 slots, 2-3x at model_forward's
            # 8 rows x 1024; in a 16-step loop, min of 8).
            o = jnp.concatenate([self._attend_rows(q5[:, :, i], k, v, mask_bts[:, None], s) for i in range(g)], axis=2)
            return o.reshape(b, t, n, h)  # [B, K, G, H]: heads (k, g) in the order of q's N
        if not causal and t > EXTEND_BLOCK and t % EXTEND_BLOCK == 0:
            return self._attend_cache_blocks(q5, k, v, mask_bts)
        step = CAUSAL_BLOCK if causal and t == s else t
        outs = []
        for lo in range(0, t, step):
            hi = min(lo + step, t)
            end = hi if step < t else s  # keys a block can see
            qb = q5[:, :, :, lo:hi].reshape(b, kh, g * (hi - lo), h)  # rows (g, t)
            mask = jnp.broadcast_to(mask_bts[:, None, lo:hi, :end], (b, g, hi - lo, end)).reshape(b, 1, g * (hi - lo), end)
            o = self._attend_rows(qb, k, v, mask, end)  # [B, K, G*Tb, H]
            outs.append(o.reshape(b, kh, g, hi - lo, h))
        o = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=3)
        return o.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)

    def _attend_cache_blocks(self, q5, k, v, mask_bts):
        """A chunk of T queries [B, K, G, T, H] against the whole cache [B, K, S, H], EXTEND_BLOCK
        queries at a time in a loop (`lax.map`), so one block's f32 scores [B, K, G*EXTEND_BLOCK, S]
        are the working set, not the chunk's. In the 7B rollout's append of a 1024-token observation
        over 256 rows and 9,216 slots, the whole chunk's scores were 63 GiB per chip (issue 37's
        preflight); each query row's softmax is over the same keys either way."""
        b, kh, g, t, h = q5.shape
        s, blk = k.shape[2], EXTEND_BLOCK
        q6 = q5.reshape(b, kh, g, t // blk, blk, h)

        def block(i):
            qb = jax.lax.dynamic_index_in_dim(q6, i, axis=3, keepdims=False).reshape(b, kh, g * blk, h)
            m = jax.lax.dynamic_slice_in_dim(mask_bts, i * blk, blk, axis=1)  # [B, blk, S]
            m = jnp.broadcast_to(m[:, None], (b, g, blk, s)).reshape(b, 1, g * blk, s)
            return self._attend_rows(qb, k, v, m, s).reshape(b, kh, g, blk, h)

        o = jax.lax.map(block, jnp.arange(t // blk))  # [T/blk, B, K, G, blk, H]
        return o.transpose(1, 0, 4, 2, 3, 5).reshape(b, t, kh * g, h)

    def _attend_rows(self, q_brh, k, v, mask_b1rs, end: int):
        """Query rows [B, K, R, H] against the first `end` slots of keys and values [B, K, S, H]."""
        logits = jnp.einsum("bkth,bksh->bkts", q_brh, k[:, :, :end]).astype(jnp.float32) * self.scale
        probs = masked_softmax(logits, mask_b1rs).astype(q_brh.dtype)
        return jnp.einsum("bkts,bksh->bkth", probs, v[:, :, :end])


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: TextConfig, *, dtype, rngs: nnx.Rngs, grouped_decode: bool = False):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "embed", dtype=dtype)
        self.attn = Attention(cfg, dtype=dtype, rngs=rngs, grouped_decode=grouped_decode)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "embed", dtype=dtype)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, ("embed", "mlp"), bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x, cos, sin, mask, kv_cache=None, index=None, fresh=False):
        a, kv = self.attn(self.input_norm(x), cos, sin, mask, kv_cache, index, fresh)
        x = x + a
        return x + self.mlp(self.post_attn_norm(x)), kv


def causal_mask(attention_mask_bt):
    """bool[B, T, T]: causal and key-valid (left or right padding)."""
    t = attention_mask_bt.shape[1]
    causal = jnp.tril(jnp.ones((t, t), bool))
    return causal[None] & attention_mask_bt.astype(bool)[:, None, :]


def cache_mask(valid_bs, index, chunk_len):
    """bool[B, C, S]: chunk token c (at slot index + c) sees valid slots <= index + c."""
    s = valid_bs.shape[1]
    slot = jnp.arange(s)[None, :]
    qslot = index + jnp.arange(chunk_len)[:, None]
    return valid_bs[:, None, :] & (slot <= qslot)[None]


def _segments_or_dense(ids_bt, dense, flash_attention: bool):
    """Segment ids for the TPU kernel (causal within equal ids) where it serves, else `dense(ids_bt)`."""
    if flash_attention and flash.usable(ids_bt.shape[1]):
        ids = ids_bt.astype(jnp.int32)
        return flash.Segments(ids, ids, causal=True)
    return dense(ids_bt)


def causal_segments(attention_mask_bt, flash_attention: bool):
    """The cache-free forward's mask: dense `causal_mask`, or its segment ids (padding keys 0, real 1)."""
    return _segments_or_dense(attention_mask_bt, causal_mask, flash_attention)


def packed_segments(segment_bt, flash_attention: bool):
    """`segment_mask`, or its segment ids for the TPU kernel (-1 on padding)."""
    return _segments_or_dense(segment_bt, segment_mask, flash_attention)


def segment_mask(segment_bt):
    """bool[B, T, T] for packed rows: causal within a segment; segment_bt int[B, T], -1 on padding.
    A segment's tokens sit in consecutive slots in order, so slot order is time order."""
    t = segment_bt.shape[1]
    causal = jnp.tril(jnp.ones((t, t), bool))
    same = segment_bt[:, :, None] == segment_bt[:, None, :]
    return causal[None] & same & (segment_bt >= 0)[:, None, :]
