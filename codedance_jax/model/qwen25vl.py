"""Qwen2.5-VL for conditional generation, in Flax NNX.

Two levels of API:

* `model(input_ids, attention_mask=, pixel_values=, image_grid_thw=)`: the `transformers`-shaped
  call with host arrays; it builds the vision plan and M-RoPE positions on the host (numpy),
  checks that placeholders and images agree, and runs `forward`.
* `forward(...)`, `encode_images(...)`, `extend(cache, ...)`: array-in, array-out methods for
  jitted code (train steps, the sampler). `extend` writes a chunk into the static KV cache and
  covers prefill, one-token decode and append-prefill of observations with new images.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from codedance_jax import sharding as shd
from codedance_jax.model import rope, text, vision
from codedance_jax.model.config import ModelConfig
from codedance_jax.model.layers import RMSNorm, matmul, param, remat_policy


@struct.dataclass
class VisionInputs:
    """Device arrays for one vision-tower call (see `vision.make_plan`)."""

    """Arrays carry a leading group axis G: 1 for a call's images, B for per-example training."""

    pixel_values: jax.Array  # [G, P, patch_dim]
    unit_src: jax.Array  # int32[G, W*U]
    pos_hw: jax.Array  # int32[G, W*U*Q, 2]
    image_id: jax.Array  # int32[G, W*U]
    out_index: jax.Array  # int32[G, N]
    # int32[B, N'] (optional): placeholder j of row b takes feature feat_src[b, j] of the flattened
    # [G * N, D] output (images encoded once and shared by several rows: `packing.share_images`).
    feat_src: jax.Array | None = None

    @classmethod
    def build(cls, pixel_values, image_grid_thw, cfg: ModelConfig, **bucket) -> VisionInputs:
        """The plan of `image_grid_thw` with its pixel rows; a bucket (`num_units`, `num_windows`) pads
        the plan and the pixel rows (zeros past the real patches), so that calls with different
        images but one bucket share one compiled vision tower."""
        plan = vision.make_plan(image_grid_thw, cfg.vision, **bucket)
        pv = np.asarray(pixel_values, np.float32).reshape(-1, cfg.vision.patch_dim)
        need = plan.num_units * cfg.vision.merge_unit
        if pv.shape[0] != need:
            raise ValueError(
                f"pixel_values has {pv.shape[0]} patch rows but image_grid_thw describes {need} "
                "(sum of t*h*w); pass the pixel_values and image_grid_thw produced together by the processor."
            )
        if bucket.get("num_units"):
            pv = np.concatenate([pv, np.zeros((bucket["num_units"] * cfg.vision.merge_unit - need, pv.shape[1]),
                                              np.float32)])
        arrays = (pv, plan.unit_src, plan.pos_hw, plan.image_id, plan.out_index)
        return cls(*(jnp.asarray(a)[None] for a in arrays))


@struct.dataclass
class KVCache:
    """Static-shape cache: L layers of heads-major [B, K, S, H] keys/values (keys stored rotated),
    per-slot validity, write index. Heads-major because attention runs heads-major (`text.Attention`)."""

    k: tuple  # L x [B, K, S, H]
    v: tuple
    valid: jax.Array  # bool[B, S]
    index: jax.Array  # int32[]: next slot to write (shared by the batch)
    next_pos: jax.Array  # int32[B]: M-RoPE position of each row's next token

    @property
    def max_len(self) -> int:
        return self.valid.shape[1]


def check_placeholders(input_ids, image_grid_thw, cfg: ModelConfig):
    """Raises a clear error when image placeholders and image features disagree."""
    n_tok = int((np.asarray(input_ids) == cfg.image_token_id).sum())
    n_feat = 0
    if image_grid_thw is not None:
        n_feat = int(np.prod(np.asarray(image_grid_thw).reshape(-1, 3), axis=-1).sum()) // cfg.vision.merge_unit
    if n_tok != n_feat:
        raise ValueError(
            f"Image features and image tokens do not match: input_ids hold {n_tok} image placeholder "
            f"tokens (id {cfg.image_token_id}) but image_grid_thw gives {n_feat} image features "
            "(sum of t*h*w / merge_size^2). Build the text with the processor so each <|image_pad|> is "
            "expanded for its image, and pass one image per placeholder."
        )


class Qwen25VL(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        wd, t = cfg.weight_dtype, cfg.text
        self.visual = vision.VisionTower(cfg.vision, dtype=wd, remat=cfg.remat, flash_attention=cfg.attention == "flash",
                                          rngs=rngs)
        self.embed = param(rngs, (t.vocab_size, t.hidden_size), ("vocab", "embed"), wd)
        # attention="flash" is the TPU's choice ("auto" there): its decode also takes the TPU's product.
        self.layers = nnx.List([text.DecoderLayer(t, dtype=wd, rngs=rngs, grouped_decode=cfg.attention == "flash")
                                for _ in range(t.num_hidden_layers)])
        self.norm = RMSNorm(t.hidden_size, t.rms_norm_eps, "embed", dtype=wd)
        self.lm_head = None if t.tie_word_embeddings else param(rngs, (t.hidden_size, t.vocab_size), ("embed", "vocab"), wd)

    # ------------------------------------------------------------ pieces
    def encode_images(self, vis: VisionInputs) -> jax.Array:
        """float[G, N, D]: one embedding per image placeholder token of each group, in order (with
        `feat_src`: [B, N', D], row b's placeholders' features gathered from every group's)."""
        f = self.visual(vis.pixel_values, vis.unit_src, vis.pos_hw, vis.image_id, vis.out_index, dtype=self.cfg.compute_dtype)
        if vis.feat_src is None:
            return f
        return f.reshape(-1, f.shape[-1])[vis.feat_src]

    def embed_tokens(self, ids_bt, image_feats_gnd=None):
        """Token embeddings with image features scattered into the placeholder slots.

        image_feats_gnd [G, N, D]: with G == 1 the features fill the placeholders of the whole
        batch in row-major order (the `transformers` convention); with G == B row b takes its own
        group's features (per-example images, as training batches carry them).
        """
        dt = self.cfg.compute_dtype
        if shd.compute_sharding_active():  # FSDP: gather the (cast) table, keep the batch sharding
            x = shd.constrain_batch(shd.gather_param(self.embed, dt)[ids_bt])
        else:  # index first: casting the whole table per call would cost a full pass over it
            x = self.embed[...][ids_bt].astype(dt)
        if image_feats_gnd is None:
            return x
        is_img = ids_bt == self.cfg.image_token_id
        g, n, d = image_feats_gnd.shape
        if g == 1:
            idx = jnp.cumsum(is_img.reshape(-1)).reshape(is_img.shape) - 1
            feats = image_feats_gnd[0][jnp.clip(idx, 0, n - 1)]
        else:
            idx = jnp.clip(jnp.cumsum(is_img, axis=1) - 1, 0, n - 1)  # [B, T]
            feats = jnp.take_along_axis(image_feats_gnd, idx[..., None], axis=1)
        return jnp.where(is_img[..., None], feats.astype(x.dtype), x)

    def logits(self, h_btd):
        w = shd.gather_param(self.embed, h_btd.dtype).T if self.lm_head is None else shd.gather_param(self.lm_head, h_btd.dtype)
        return matmul(h_btd, w)

    def _decoder(self, x, positions_3bt, mask, caches=None, index=None, fresh=False):
        t = self.cfg.text
        cos, sin = rope.mrope_cos_sin(positions_3bt, t.head_dim, t.rope_theta, t.mrope_section)
        layer_fn = lambda layer, x, kv: layer(x, cos, sin, mask, kv, index, fresh)  # noqa: E731
        # Remat only where a backward pass follows (the cache-free training forward). A cache step is
        # inference: remat buys nothing there, and nnx.remat inside the sampler's while loop fails
        # (TraceContextError: the Params belong to the jit's trace), so a remat'ed policy could not decode.
        if self.cfg.remat != "none" and caches is None:
            layer_fn = nnx.remat(layer_fn, policy=remat_policy(self.cfg.remat))
        new = []
        for i, layer in enumerate(self.layers):
            x, kv = layer_fn(layer, x, None if caches is None else caches[i])
            x = shd.constrain_batch(x)  # batch-sharded between layers (see sharding.compute_sharding)
            new.append(kv)
        return self.norm(x), new

    # ------------------------------------------------------- jit-level API
    def forward(self, input_ids, positions, attention_mask, vis: VisionInputs | None = None, *, return_hidden=False,
                segment_ids=None):
        """Full causal forward. input_ids int[B, T], positions int[3, B, T], attention_mask [B, T].

        segment_ids int[B, T] (optional; 1-based, 0 on padding): rows holding several sequences
        (`batching.collate_packed`); a token attends to the earlier tokens of its own segment only."""
        feats = None if vis is None else self.encode_images(vis)
        x = self.embed_tokens(input_ids, feats)
        fa = self.cfg.attention == "flash"
        mask = (text.causal_segments(attention_mask, fa) if segment_ids is None
                else text.packed_segments(segment_ids - 1, fa))
        h, _ = self._decoder(x, positions, mask)
        return h if return_hidden else self.logits(h)

    def forward_packed(self, input_ids, positions, pack_src, vis: VisionInputs | None = None):
        """Hidden states of a batch packed into fewer rows: returns (h [R, T, D], src int[R, T]).

        input_ids int[B, T], positions int[3, B, T] and the per-row images are the unpacked batch;
        pack_src int[B, K] lists, slot by slot, the flat index b * T + t of the token each packed
        slot holds (-1: empty), read as a stream cut into R = ceil(B K / T) rows of T. A token attends
        to the earlier tokens of its own row b only (segment mask), with the positions it has in
        its own row, so every valid token's hidden state equals the unpacked forward's while
        attention and MLP run over R rows instead of B.
        """
        b, t = input_ids.shape
        feats = None if vis is None else self.encode_images(vis)
        x = self.embed_tokens(input_ids, feats)  # images scattered per unpacked row, as `forward`
        src = pack_src.reshape(-1)
        r = -(-src.shape[0] // t)
        src = jnp.pad(src, (0, r * t - src.shape[0]), constant_values=-1).reshape(r, t)
        take = jnp.maximum(src, 0)
        xp = x.reshape(b * t, -1)[take]
        pos = positions.reshape(3, b * t)[:, take]
        seg = jnp.where(src >= 0, take // t, -1)
        h, _ = self._decoder(xp, pos, text.packed_segments(seg, self.cfg.attention == "flash"))
        return h, src

    def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        t = self.cfg.text
        dt = dtype or self.cfg.compute_dtype
        shape = (batch, t.num_key_value_heads, max_len, t.head_dim)
        zeros = lambda: jnp.zeros(shape, dt)  # noqa: E731
        return KVCache(
            k=tuple(zeros() for _ in range(t.num_hidden_layers)),
            v=tuple(zeros() for _ in range(t.num_hidden_layers)),
            valid=jnp.zeros((batch, max_len), bool),
            index=jnp.zeros((), jnp.int32),
            next_pos=jnp.zeros((batch,), jnp.int32),
        )

    def extend(self, cache: KVCache, input_ids, chunk_mask, positions, image_feats=None, *, logits_at=None,
               fresh: bool = False):
        """Writes a chunk [B, C] at `cache.index`, returns (logits, cache).

        fresh (static): the cache is empty (index 0, nothing valid), as for a prompt prefill: the
        chunk attends within itself (blocked causal attention over C keys, not the S slots).

        chunk_mask [B, C]: 1 for real tokens (0 leaves a hole: padding, or a row sitting out).
        positions int[3, B, C]: M-RoPE ids (from `rope.mrope_positions(..., start=cache.next_pos)`).
        image_feats [N, D]: features for the image tokens of this chunk, or None.
        logits_at int[B] (optional): return only the logits of that chunk column, [B, V].
        """
        c = input_ids.shape[1]
        chunk_mask = chunk_mask.astype(bool)
        valid = jax.lax.dynamic_update_slice(cache.valid, chunk_mask, (0, cache.index))
        mask = text.causal_mask(chunk_mask) if fresh else text.cache_mask(valid, cache.index, c)
        x = self.embed_tokens(input_ids, image_feats)
        h, kvs = self._decoder(x, positions, mask, list(zip(cache.k, cache.v, strict=True)), cache.index, fresh)
        chunk_next = jnp.max(jnp.where(chunk_mask, positions.max(axis=0), -1), axis=1) + 1
        new_cache = KVCache(
            k=tuple(kv[0] for kv in kvs),
            v=tuple(kv[1] for kv in kvs),
            valid=valid,
            index=cache.index + c,
            next_pos=jnp.maximum(cache.next_pos, chunk_next.astype(jnp.int32)),
        )
        if logits_at is not None:
            h = jnp.take_along_axis(h, logits_at[:, None, None].astype(jnp.int32), axis=1)
            return self.logits(h)[:, 0], new_cache
        return self.logits(h), new_cache

    # ----------------------------------------------------- host-level API
    def prepare(self, input_ids, attention_mask=None, pixel_values=None, image_grid_thw=None, *, start=0, **bucket) -> dict[str, Any]:
        """Host-side preparation shared by `__call__` and callers that jit `forward` themselves."""
        ids = np.asarray(input_ids)
        if ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, seq]; got shape {ids.shape}")
        mask = np.ones_like(ids, np.int32) if attention_mask is None else np.asarray(attention_mask, np.int32)
        if (pixel_values is None) != (image_grid_thw is None):
            raise ValueError("pass pixel_values and image_grid_thw together (both from the processor)")
        check_placeholders(ids, image_grid_thw, self.cfg)
        pos, next_pos = rope.mrope_positions(
            ids, mask, image_grid_thw, image_token_id=self.cfg.image_token_id,
            spatial_merge_size=self.cfg.vision.spatial_merge_size, start=start,
        )
        vis = None if pixel_values is None else VisionInputs.build(pixel_values, image_grid_thw, self.cfg, **bucket)
        return dict(input_ids=jnp.asarray(ids, jnp.int32), positions=jnp.asarray(pos), attention_mask=jnp.asarray(mask), vis=vis, next_pos=next_pos)

    def __call__(self, input_ids, attention_mask=None, pixel_values=None, image_grid_thw=None):
        """Logits float[B, T, V], equal to `transformers`' Qwen2_5_VLForConditionalGeneration."""
        p = self.prepare(input_ids, attention_mask, pixel_values, image_grid_thw)
        return _jit_forward(self, p["input_ids"], p["positions"], p["attention_mask"], p["vis"])


# Tree mode: graph-mode nnx.jit returns every Variable as an output, copying the whole model on
# each call; a forward never mutates the model.
@functools.partial(nnx.jit, graph=False)
def _jit_forward(model, input_ids, positions, attention_mask, vis):
    return model.forward(input_ids, positions, attention_mask, vis)


def num_params(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts from `jax.eval_shape` (no memory used): total and vision tower."""
    abstract = nnx.eval_shape(lambda: Qwen25VL(cfg, rngs=nnx.Rngs(0)))
    state = nnx.state(abstract, nnx.Param)
    leaves = jax.tree.leaves_with_path(state)
    total = sum(int(np.prod(v.shape)) for _, v in leaves)
    vis = sum(int(np.prod(v.shape)) for p, v in leaves if getattr(p[0], "key", None) == "visual")
    return {"total": total, "vision": vis}


__all__ = ["Qwen25VL", "KVCache", "VisionInputs", "check_placeholders", "num_params"]
