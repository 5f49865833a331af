"""Host helpers around the static KV cache: prefill, append-prefill with images, jit decode loop.

`extend_host` is the one entry for prompt prefill and for observations appended mid-trajectory:
it computes the chunk's M-RoPE positions on the host starting at each row's `cache.next_pos`
(so images in the chunk get the positions they would have in a full forward), encodes the
chunk's images in one batched vision call, and writes the chunk into the cache.
`greedy_decode` is a `lax.fori_loop` over one-token `extend` steps inside one jit.
The rollout sampler (temperature, top-p/k, stop strings) builds on the same `extend`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from codedance_jax.model import rope
from codedance_jax.model.qwen25vl import KVCache, Qwen25VL, VisionInputs, check_placeholders


@nnx.jit
def _encode(model: Qwen25VL, vis: VisionInputs):
    return model.encode_images(vis)


@functools.partial(nnx.jit, static_argnames=("last_only",), donate_argnames=("cache",))
def _extend(model: Qwen25VL, cache: KVCache, ids, mask, positions, feats, last_only: bool):
    if last_only:
        # Last real token of each row (chunks may be right-padded within the row).
        last = jnp.maximum(jnp.sum(jnp.cumsum(mask[:, ::-1], axis=1) > 0, axis=1) - 1, 0)
        return model.extend(cache, ids, mask, positions, feats, logits_at=last)
    return model.extend(cache, ids, mask, positions, feats)


def extend_host(model: Qwen25VL, cache: KVCache, input_ids, chunk_mask=None, pixel_values=None,
                image_grid_thw=None, *, last_only: bool = False, **bucket):
    """Writes a chunk into the cache. Returns (logits [B, C, V] or [B, V] with last_only, cache)."""
    cfg = model.cfg
    ids = np.asarray(input_ids)
    mask = np.ones_like(ids, np.int32) if chunk_mask is None else np.asarray(chunk_mask, np.int32)
    if int(cache.index) + ids.shape[1] > cache.max_len:
        raise ValueError(
            f"cache overflow: {int(cache.index)} slots used + chunk of {ids.shape[1]} > max_len {cache.max_len}; "
            "allocate a longer cache (init_cache(batch, max_len))."
        )
    check_placeholders(ids, image_grid_thw, cfg)
    pos, _ = rope.mrope_positions(ids, mask, image_grid_thw, image_token_id=cfg.image_token_id,
                                  spatial_merge_size=cfg.vision.spatial_merge_size,
                                  start=np.asarray(cache.next_pos))
    feats = None
    if pixel_values is not None:
        feats = _encode(model, VisionInputs.build(pixel_values, image_grid_thw, cfg, **bucket))
    return _extend(model, cache, jnp.asarray(ids, jnp.int32), jnp.asarray(mask), jnp.asarray(pos), feats, last_only)


def decode_step(model: Qwen25VL, cache: KVCache, tokens_b, active_b=None):
    """One token per row at each row's next position. Returns (logits [B, V], cache)."""
    b = tokens_b.shape[0]
    active = jnp.ones((b,), bool) if active_b is None else active_b.astype(bool)
    positions = jnp.broadcast_to(cache.next_pos[None, :, None], (3, b, 1))
    logits, cache = model.extend(cache, tokens_b[:, None], active[:, None], positions)
    return logits[:, 0], cache


@functools.partial(jax.jit, static_argnums=(0, 4), donate_argnums=(2,))
def _greedy(graphdef, state, cache, first_logits, steps):
    model = nnx.merge(graphdef, state)
    b = first_logits.shape[0]
    tokens = jnp.zeros((b, steps), jnp.int32)

    def body(i, carry):
        cache, logits, tokens = carry
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        tokens = tokens.at[:, i].set(tok)
        logits, cache = decode_step(model, cache, tok)
        return cache, logits, tokens

    cache, logits, tokens = jax.lax.fori_loop(0, steps, body, (cache, first_logits, tokens))
    return tokens, cache, logits


def greedy_decode(model: Qwen25VL, cache: KVCache, first_logits, steps: int):
    """Greedy tokens [B, steps] from the logits after prefill; one compiled loop, no host syncs."""
    graphdef, state = nnx.split(model)
    return _greedy(graphdef, state, cache, first_logits, steps)
