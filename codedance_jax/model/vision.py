"""The Qwen2.5-VL vision tower: patch embedding, window/full attention blocks, patch merger.

Layout. The reference reorders merged 2x2 units window by window and attends inside variable
length windows through `cu_seqlens`. Here the host turns `image_grid_thw` into a `VisionPlan`
(numpy) once, and the device sees static shapes: every window is padded to the full window size
(`cfg.window_patches` patches), so window layers are one batched attention over
[windows, window_patches] and full-attention layers (`fullatt_block_indexes`) attend over all
patches with a per-image segment mask (images never attend to each other). After the merger, a
gather undoes the window reordering and drops the padding, giving features in the order of the
image placeholders. A plan can be padded to a bucket (`num_windows`, `num_units`) so that a
rollout compiles once per bucket.

Deviation: full-attention layers are dense over all patches of the call, O(P^2) memory. For
many high-resolution images encode them in several calls.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from codedance_jax import sharding as shd
from codedance_jax.model import flash, rope
from codedance_jax.model.config import VisionConfig
from codedance_jax.model.layers import Dense, RMSNorm, SwiGLU, masked_softmax, matmul, param, remat_policy


@dataclasses.dataclass(frozen=True)
class VisionPlan:
    """Host-computed index arrays that place patches into padded windows (all numpy int32).

    U = window_merged**2 merged units per window, Q = merge_unit patches per unit.
      unit_src[W*U]: source merged-unit index of each padded slot, -1 for padding.
      pos_hw[W*U*Q, 2]: (h, w) patch coordinates for the 2D rope (0 on padding).
      image_id[W*U]: image of each slot, -1 for padding (segments of the full-attention layers).
      out_index[N]: padded slot of each merged unit in placeholder order (N = total units).
    """

    unit_src: np.ndarray
    pos_hw: np.ndarray
    image_id: np.ndarray
    out_index: np.ndarray
    num_units: int  # real merged units (= image tokens); out_index may be padded beyond it


def make_plan(grid_thw, cfg: VisionConfig, *, num_windows: int | None = None, num_units: int | None = None) -> VisionPlan:
    """Builds the window layout for `grid_thw` int[I, 3]; optional bucket sizes pad it."""
    grids = [tuple(int(x) for x in g) for g in np.asarray(grid_thw).reshape(-1, 3)]
    m, wm, q = cfg.spatial_merge_size, cfg.window_merged, cfg.merge_unit
    slots, pos, img = [], [], []
    base = 0
    for i, (gt, gh, gw) in enumerate(grids):
        if gh % m or gw % m:
            raise ValueError(f"image {i}: grid {(gt, gh, gw)} is not divisible by spatial_merge_size {m}")
        lh, lw = gh // m, gw // m
        # Patch coordinates of each unit, in the processor's unit-major order.
        hh, ww = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
        blk = (lh, m, lw, m)
        unit_h = hh.reshape(blk).transpose(0, 2, 1, 3).reshape(lh * lw, q)
        unit_w = ww.reshape(blk).transpose(0, 2, 1, 3).reshape(lh * lw, q)
        nwh, nww = -(-lh // wm), -(-lw // wm)
        for t in range(gt):
            for a in range(nwh):
                for b in range(nww):
                    rows = np.arange(a * wm, min((a + 1) * wm, lh))
                    cols = np.arange(b * wm, min((b + 1) * wm, lw))
                    units = (rows[:, None] * lw + cols[None, :]).reshape(-1)
                    win = np.full(wm * wm, -1, np.int64)
                    win[: len(units)] = base + t * lh * lw + units
                    slots.append(win)
                    p = np.zeros((wm * wm, q, 2), np.int64)
                    p[: len(units), :, 0] = unit_h[units]
                    p[: len(units), :, 1] = unit_w[units]
                    pos.append(p)
                    img.append(np.where(win >= 0, i, -1))
        base += gt * lh * lw
    w = len(slots)
    if num_windows is not None:
        if num_windows < w:
            raise ValueError(f"vision bucket of {num_windows} windows is smaller than the {w} windows needed")
        for _ in range(num_windows - w):
            slots.append(np.full(wm * wm, -1, np.int64))
            pos.append(np.zeros((wm * wm, q, 2), np.int64))
            img.append(np.full(wm * wm, -1, np.int64))
    unit_src = np.concatenate(slots) if slots else np.zeros((0,), np.int64)
    out_index = np.zeros((base,), np.int64)
    valid = np.nonzero(unit_src >= 0)[0]
    out_index[unit_src[valid]] = valid
    if num_units is not None:
        if num_units < base:
            raise ValueError(f"vision bucket of {num_units} image tokens is smaller than the {base} needed")
        out_index = np.concatenate([out_index, np.zeros(num_units - base, np.int64)])
    return VisionPlan(
        unit_src=unit_src.astype(np.int32),
        pos_hw=(np.concatenate(pos).reshape(-1, 2) if pos else np.zeros((0, 2))).astype(np.int32),
        image_id=(np.concatenate(img) if img else np.zeros((0,))).astype(np.int32),
        out_index=out_index.astype(np.int32),
        num_units=base,
    )


def attention(q, k, v, mask, scale):
    """q, k, v: [G, S, N, H]; mask bool[G, S, S] (or `flash.Segments`: the TPU kernel). Softmax in float32.

    Heads are made a leading dim first ([G, N, S, H]): with (g, n) batch dims around s, XLA CPU
    copied the [G, N, S, S] logits and probabilities into transposed layouts (16 windows x 256 x 4
    heads: forward 1.9x, forward+backward 1.3x slower; issue 14, as `text.Attention`)."""
    qh, kh, vh = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    if isinstance(mask, flash.Segments):
        return flash.attend(qh, kh, vh, mask, scale).transpose(0, 2, 1, 3)
    logits = jnp.einsum("gnsh,gnth->gnst", qh, kh).astype(jnp.float32) * scale
    probs = masked_softmax(logits, mask[:, None]).astype(v.dtype)  # a padding row stays finite
    return jnp.einsum("gnst,gnth->gnsh", probs, vh).transpose(0, 2, 1, 3)


class VisionAttention(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, dtype, rngs: nnx.Rngs):
        d, n, h = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        self.qkv_kernel = param(rngs, (d, 3, n, h), ("vision_embed", None, "vision_heads", "head_dim"), dtype)
        self.qkv_bias = param(rngs, (3, n, h), (None, "vision_heads", "head_dim"), dtype, init="zeros")
        self.out_kernel = param(rngs, (n, h, d), ("vision_heads", "head_dim", "vision_embed"), dtype)
        self.out_bias = param(rngs, (d,), ("vision_embed",), dtype, init="zeros")
        self.scale = h**-0.5

    def __call__(self, x_gsd, cos_gsh, sin_gsh, mask_gss):
        qkv = matmul(x_gsd, shd.gather_param(self.qkv_kernel, x_gsd.dtype))  # [G, S, 3, N, H]
        qkv = qkv + shd.gather_param(self.qkv_bias, x_gsd.dtype)
        cos, sin = cos_gsh[:, :, None], sin_gsh[:, :, None]
        q = rope.apply_rope(qkv[:, :, 0], cos, sin)
        k = rope.apply_rope(qkv[:, :, 1], cos, sin)
        o = attention(q, k, qkv[:, :, 2], mask_gss, self.scale)
        return matmul(o, shd.gather_param(self.out_kernel, o.dtype), n_in=2) + shd.gather_param(self.out_bias, o.dtype)


class VisionBlock(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, dtype, rngs: nnx.Rngs):
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "vision_embed", dtype=dtype)
        self.attn = VisionAttention(cfg, dtype=dtype, rngs=rngs)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "vision_embed", dtype=dtype)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, ("vision_embed", "vision_mlp"), bias=True, dtype=dtype, rngs=rngs)

    def __call__(self, x, cos, sin, mask):
        x = x + self.attn(self.norm1(x), cos, sin, mask)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, dtype, rngs: nnx.Rngs):
        d4 = cfg.hidden_size * cfg.merge_unit
        self.norm = RMSNorm(cfg.hidden_size, 1e-6, "vision_embed", dtype=dtype)
        self.fc1 = Dense(d4, d4, ("vision_merged", "vision_merged_out"), bias=True, dtype=dtype, rngs=rngs)
        self.fc2 = Dense(d4, cfg.out_hidden_size, ("vision_merged_out", "embed"), bias=True, dtype=dtype, rngs=rngs)
        self.q = cfg.merge_unit

    def __call__(self, x_pd):
        x = self.norm(x_pd).reshape(-1, self.q * x_pd.shape[-1])  # [units, Q*Dv]
        # The reference uses exact (erf) GELU here.
        return self.fc2(jax.nn.gelu(self.fc1(x), approximate=False))


class VisionTower(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, dtype, remat: str = "none", flash_attention: bool = False, rngs: nnx.Rngs):
        self.cfg = cfg
        self.flash_attention = flash_attention  # full-attention blocks through the TPU kernel (model.flash)
        self.patch_embed = param(rngs, (cfg.patch_dim, cfg.hidden_size), ("patch", "vision_embed"), dtype)
        self.blocks = nnx.List([VisionBlock(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg, dtype=dtype, rngs=rngs)
        self.remat = remat

    def __call__(self, pixel_values, unit_src, pos_hw, image_id, out_index, *, dtype=jnp.float32):
        """Encodes G independent groups of images (a group: one call's images, or one example's).

        pixel_values [G, P, patch_dim] in placeholder order; plan arrays from `make_plan` with a
        leading G axis: unit_src [G, W*U], pos_hw [G, W*U*Q, 2], image_id [G, W*U], out_index [G, N].
        Full-attention layers never mix groups, so groups shard along G like a batch.
        Returns float[G, N, D]: one feature per image placeholder token of each group.
        """
        cfg = self.cfg
        q, u = cfg.merge_unit, cfg.window_merged**2
        g = unit_src.shape[0]
        # Embed, then reorder into windows: the patch embedding is per patch, so gathering and
        # zeroing the [.., Dv] embeddings equals doing it to the [.., patch_dim] pixels, 18x less
        # data moved (the pixel select and gather were ~2% of the demo's SFT step; issue 14).
        emb = matmul(pixel_values.astype(dtype), shd.gather_param(self.patch_embed, dtype))  # [G, P, Dv]
        units = emb.reshape(g, -1, q, emb.shape[-1])  # [G, units, Q, Dv]
        valid_u = unit_src >= 0  # [G, W*U]
        x = jnp.take_along_axis(units, jnp.maximum(unit_src, 0)[:, :, None, None], axis=1)
        x = jnp.where(valid_u[:, :, None, None], x, 0).reshape(g, -1, emb.shape[-1])  # [G, S, Dv]
        cos, sin = rope.vision_cos_sin(pos_hw.reshape(-1, 2), cfg.head_dim, cfg.rope_theta)
        s = x.shape[1]
        w = s // (u * q)
        cos, sin = cos.reshape(g, s, -1), sin.reshape(g, s, -1)
        valid_p = jnp.repeat(valid_u, q, axis=1)  # [G, S]
        img_p = jnp.repeat(image_id, q, axis=1)
        # Window layers: [G*W, U*Q] blocks with a validity mask.
        win_valid = valid_p.reshape(g * w, u * q)
        win_mask = win_valid[:, None, :] & win_valid[:, :, None]
        # Full layers: one segment per image over the group's patches.
        if self.flash_attention and flash.usable(s):  # the kernel's segment ids, no [G, S, S] mask
            ids = jnp.where(valid_p, img_p, -1).astype(jnp.int32)
            full_mask = flash.Segments(ids, ids)
        else:
            full_mask = (img_p[:, :, None] == img_p[:, None, :]) & valid_p[:, None, :]

        def block_fn(blk, x, full):
            if full:
                return blk(x, cos, sin, full_mask)
            xw = blk(x.reshape(g * w, u * q, -1), cos.reshape(g * w, u * q, -1), sin.reshape(g * w, u * q, -1), win_mask)
            return xw.reshape(g, s, -1)

        if self.remat != "none":
            block_fn = nnx.remat(block_fn, policy=remat_policy(self.remat), static_argnums=(2,))
        for i, blk in enumerate(self.blocks):
            x = block_fn(blk, x, i in cfg.fullatt_block_indexes)
        merged = self.merger(x.reshape(g * s, -1)).reshape(g, w * u, -1)  # [G, W*U, D]
        return jnp.take_along_axis(merged, out_index[:, :, None], axis=1)
