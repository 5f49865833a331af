"""Host helpers around the static KV cache: prefill, append-prefill with images, jit decode loop.

`extend_host` is the one entry for prompt prefill and for observations appended mid-trajectory:
it computes the chunk's M-RoPE positions on the host starting at each row's `cache.next_pos`
(so images in the chunk get the positions they would have in a full forward), encodes the
chunk's images in one batched vision call, and writes the chunk into the cache.
`greedy_decode` is a `lax.fori_loop` over one-token `extend` steps inside one jit.
The rollout sampler (temperature, top-p/k, stop strings; `codedance_jax.rollout`) builds on the
same `extend`; `compact_cache` / `drop_slots` keep a long multi-turn batch inside the static cache,
and `vision_inputs` / `encode_vision` / `extend_arrays` are the bucketed array-level entries it uses.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from codedance_jax.model import rope
from codedance_jax.model.qwen25vl import KVCache, Qwen25VL, VisionInputs, check_placeholders


# Tree mode (graph=False): graph-mode `nnx.jit` returns every model Variable as a jit output, so each
# call copied all parameters (~700 MB for the benchmark model, ~0.4 s on CPU) even though nothing
# changed. Inference never mutates the model, so tree mode loses nothing here.
# Public: the pod preflight lowers these same jitted functions (`codedance_jax.preflight.rollout`).
@functools.partial(nnx.jit, graph=False)
def encode_jit(model: Qwen25VL, vis: VisionInputs):
    return model.encode_images(vis)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def zeros_features(n: int, d: int, dtype) -> jax.Array:
    """A zero feature buffer [1, n, d] for `encode_into_jit`."""
    return jnp.zeros((1, n, d), dtype)


@functools.partial(nnx.jit, donate_argnames=("feats",), graph=False)
def encode_into_jit(model: Qwen25VL, feats, vis: VisionInputs, offset):
    """feats [1, N, D] with the features of `vis` (one image, in its plan's shape) written from
    unit `offset` on: a chunk's images are encoded one per call into one buffer, so the vision
    tower's full-attention blocks never span two images (O(patches^2) per image, not per call)
    and every call has one shape."""
    f = model.encode_images(vis).astype(feats.dtype)
    return jax.lax.dynamic_update_slice(feats, f, (0, offset, 0))


@functools.partial(nnx.jit, static_argnames=("last_only", "fresh"), donate_argnames=("cache",), graph=False)
def extend_jit(model: Qwen25VL, cache: KVCache, ids, mask, positions, feats, last_only: bool, fresh: bool = False):
    if last_only:
        # Last real token of each row (chunks may be right-padded within the row).
        last = jnp.maximum(jnp.sum(jnp.cumsum(mask[:, ::-1], axis=1) > 0, axis=1) - 1, 0)
        return model.extend(cache, ids, mask, positions, feats, logits_at=last, fresh=fresh)
    return model.extend(cache, ids, mask, positions, feats, fresh=fresh)


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
        feats = encode_jit(model, VisionInputs.build(pixel_values, image_grid_thw, cfg, **bucket))
    fresh = int(cache.index) == 0 and not bool(jnp.any(cache.valid))  # a prompt into an empty cache
    return extend_jit(model, cache, jnp.asarray(ids, jnp.int32), jnp.asarray(mask), jnp.asarray(pos), feats, last_only,
                      fresh)


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


# ------------------------------------------------------------------ cache maintenance for rollouts
# The cache's write index is shared by the batch, so every decode step and every appended chunk
# uses a slot in every row, also in rows that sit out (holes). Two helpers keep a long multi-turn
# batch inside a fixed S: `drop_slots` invalidates slots (tokens sampled past a stop string, or a
# whole finished row), and `compact_cache` moves each row's valid slots to the front. Moving slots
# is exact: keys are stored already rotated by their M-RoPE position, and every cached slot is
# before any query of the next chunk, so attention only sees the set of valid slots, not their order.


@functools.partial(jax.jit, donate_argnums=(0,))
def compact_cache(cache: KVCache) -> KVCache:
    """Each row's valid slots first (in order), holes after; `index` = the longest row's length."""
    s = cache.max_len
    slot = jnp.arange(s, dtype=jnp.int32)[None, :]
    order = jnp.argsort(jnp.where(cache.valid, slot, slot + s), axis=1)  # [B, S] stable by construction

    def gather(x):  # [B, K, S, H]
        return jnp.take_along_axis(x, order[:, None, :, None], axis=2)

    return KVCache(
        k=tuple(gather(x) for x in cache.k),
        v=tuple(gather(x) for x in cache.v),
        valid=jnp.take_along_axis(cache.valid, order, axis=1),
        index=jnp.max(jnp.sum(cache.valid, axis=1)).astype(jnp.int32),
        next_pos=cache.next_pos,
    )


@functools.partial(jax.jit, donate_argnums=(0,))
def drop_slots(cache: KVCache, drop_bs, rewind_b) -> KVCache:
    """Invalidates slots drop_bs bool[B, S] and moves each row's next position back by rewind_b int[B]."""
    return cache.replace(valid=cache.valid & ~drop_bs, next_pos=cache.next_pos - rewind_b.astype(jnp.int32))


@functools.partial(jax.jit, static_argnums=(1,))  # not donated: a padded array cannot reuse the buffer
def grow_cache(cache: KVCache, slots: int) -> KVCache:
    """The cache with `slots` slots: the new ones are empty holes after the old (index unchanged)."""
    extra = slots - cache.max_len
    if extra < 0:
        raise ValueError(f"grow_cache: {slots} slots is fewer than the cache's {cache.max_len}")

    def pad(x):  # [B, K, S, H]
        return jnp.pad(x, ((0, 0), (0, 0), (0, extra), (0, 0)))

    return cache.replace(k=tuple(pad(x) for x in cache.k), v=tuple(pad(x) for x in cache.v),
                         valid=jnp.pad(cache.valid, ((0, 0), (0, extra))))


# ------------------------------------------------------------------ bucketed array-level entries
# The rollout engine computes positions itself (it tracks each row's next position on the host)
# and pads every shape to a bucket, so it calls the jitted pieces directly.


def vision_inputs(pixel_values, image_grid_thw, cfg, *, num_windows: int, num_units: int) -> VisionInputs:
    """`VisionInputs` padded to a bucket, pixel rows included (`VisionInputs.build`), so that calls
    with different images but the same bucket share one compiled vision tower."""
    return VisionInputs.build(pixel_values, image_grid_thw, cfg, num_windows=num_windows, num_units=num_units)


def encode_vision(model: Qwen25VL, vis: VisionInputs):
    """float[1, num_units, D]: image features (one compiled call per bucket)."""
    return encode_jit(model, vis)


def extend_arrays(model: Qwen25VL, cache: KVCache, ids, mask, positions, feats=None, *, last_only: bool = True,
                  fresh: bool = False):
    """`extend` with host-computed positions int[3, B, C]; last_only gives each row's last real token's logits;
    fresh: the caller knows the cache is empty (a prompt prefill; see `Qwen25VL.extend`)."""
    return extend_jit(model, cache, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32), jnp.asarray(positions),
                      feats, last_only, fresh)


# ------------------------------------------------------------------ row subsets of a batch cache
# A rollout batch holds every trajectory of a step, but at most steps only some rows take part
# (the rows appending an observation, the rows still decoding). Running the model over the whole
# batch with mask 0 for the others costs compute proportional to the batch; these helpers move the
# taking-part rows into a smaller cache (a row bucket), and back, so the cost follows those rows.
# Rows are independent in every cache step, so results do not depend on which rows share a call.


@jax.jit
def take_rows(cache: KVCache, rows_n) -> KVCache:
    """The cache of rows rows_n int[n] (same slots, same write index)."""
    return KVCache(k=tuple(x[rows_n] for x in cache.k), v=tuple(x[rows_n] for x in cache.v),
                   valid=cache.valid[rows_n], index=cache.index, next_pos=cache.next_pos[rows_n])


@functools.partial(jax.jit, static_argnums=(4,), donate_argnums=(0,))
def put_rows(cache: KVCache, sub: KVCache, rows_n, start, width: int) -> KVCache:
    """Writes `sub` (from `take_rows(cache, rows_n)` and then extended by at most `width` slots from
    slot `start`) back into rows rows_n; the other rows' slots past the old index stay invalid
    (holes), as if they had sat out with mask 0. Only that window of slots is written: the rest of
    `sub` is the cache's own (whole rows: 8.0 ms per call for 32 of the demo's 64 x 640-slot rows
    in isolation; a 32-slot window: 0.5 ms)."""
    slots = start + jnp.arange(width, dtype=jnp.int32)

    def put(x, s):  # [B, K, S, H] <- the window of [n, K, S, H]
        w = jax.lax.dynamic_slice_in_dim(s, start, width, axis=2)
        return x.at[rows_n[:, None], :, slots[None, :]].set(w.transpose(0, 2, 1, 3))

    valid = jax.lax.dynamic_slice_in_dim(sub.valid, start, width, axis=1)
    return KVCache(k=tuple(put(x, s) for x, s in zip(cache.k, sub.k, strict=True)),
                   v=tuple(put(x, s) for x, s in zip(cache.v, sub.v, strict=True)),
                   valid=cache.valid.at[rows_n[:, None], slots[None, :]].set(valid), index=sub.index,
                   next_pos=cache.next_pos.at[rows_n].set(sub.next_pos))


@jax.jit
def broadcast_rows(cache: KVCache, logits, src_b, on_b):
    """A cache of B rows where row b copies row src_b[b] of `cache` (rows with on_b False are
    empty): a prompt prefilled once is shared by its G group members. Returns (cache, logits)."""
    on = on_b.astype(bool)
    return KVCache(k=tuple(x[src_b] for x in cache.k), v=tuple(x[src_b] for x in cache.v),
                   valid=cache.valid[src_b] & on[:, None], index=cache.index,
                   next_pos=jnp.where(on, cache.next_pos[src_b], 0)), logits[src_b]


@jax.jit
def scatter_logits(full_bv, sub_nv, rows_n, on_n):
    """full_bv with rows rows_n replaced by sub_nv where on_n."""
    return full_bv.at[rows_n].set(jnp.where(on_n[:, None], sub_nv, full_bv[rows_n]))
