"""The device side of a static batch of rows: one KV cache, each row's next-token logits, one write index.

Shared by the rollout engine (`engine.py`) and the serving batcher (`codedance_jax.serve.batcher`):
both keep B rows in one cache whose write index is shared (each row has its own valid slots and
positions), run device calls over only some of the rows, and make room by dropping finished rows'
slots and compacting. What lives here:

* `DeviceBatch`: the cache, the logits, the write index (tracked on the host, so no call syncs to
  read it), and the calls that change them: a chunk written into some rows (the others keep their
  logits: `merge_rows` / `scatter_logits`), a prompt prefilled once and copied to its group
  (`prefill`), one decode chunk of some rows, slots dropped, the cache grown or compacted;
* row buckets: a call that runs n of the B rows runs `row_bucket(n)` rows (a multiple x a power of
  two), either a gathered subset (`row_subset`, the engine) or the leading rows [0, k)
  (`head_rows` / `put_head_rows`, the batcher, whose busy rows stay packed at the front);
* `RowPlacement`: with a mesh whose `data` axis has several devices, every array with a row
  dimension is split over `data` (`sharding.row_sharding`), and with a `tensor` axis the KV cache's
  keys and values are split by KV heads over it too (`sharding.kv_sharding`), the cache created
  already so; without such a mesh arrays are left where jit puts them.

Rows are independent in every cache step, so which rows share a call never changes a row's result.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from codedance_jax import sharding
from codedance_jax.model.generate import (
    broadcast_rows,
    compact_cache,
    drop_slots,
    extend_arrays,
    grow_cache,
    put_rows,
    scatter_logits,
    take_rows,
)
from codedance_jax.model.qwen25vl import KVCache


@jax.jit
def merge_rows(rows_b, new_bv, old_bv):
    """new_bv on the rows that took part in a whole-batch call (rows_b bool[B]), old_bv on the rest."""
    return jnp.where(rows_b[:, None], new_bv, old_bv)


@functools.partial(jax.jit, static_argnames=("k",))
def head_rows(cache, logits, *, k: int):
    """(cache, logits) of rows [0, k), copied."""
    cut = lambda x: x[:k]  # noqa: E731
    return cache.replace(k=tuple(map(cut, cache.k)), v=tuple(map(cut, cache.v)), valid=cut(cache.valid),
                         next_pos=cut(cache.next_pos)), cut(logits)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def put_head_rows(cache, logits, sub, sub_logits):
    """Writes `head_rows`' (cache, logits), since extended, back into rows [0, k) in place (the full
    arrays are donated); the write index is the sub-cache's."""

    def put(full, part):
        return jax.lax.dynamic_update_slice_in_dim(full, part, 0, axis=0)

    return cache.replace(k=tuple(map(put, cache.k, sub.k)), v=tuple(map(put, cache.v, sub.v)),
                         valid=put(cache.valid, sub.valid), next_pos=put(cache.next_pos, sub.next_pos),
                         index=sub.index), put(logits, sub_logits)


def row_bucket(n: int, multiple: int, batch: int) -> int:
    """Rows of a device call that runs n rows: `multiple` x a power of two, at most the batch (few
    distinct shapes to compile, and a lightly used batch does not pay for all its rows)."""
    nb = multiple
    while nb < n:
        nb *= 2
    return min(nb, batch)


def row_subset(on: np.ndarray, multiple: int) -> np.ndarray | None:
    """Row indices (the `on` rows first, in order, then others as padding) of a row bucket, or None
    when the bucket is the whole batch."""
    idx = np.nonzero(on)[0]
    nb = row_bucket(len(idx), multiple, len(on))
    if nb == len(on):
        return None
    return np.concatenate([idx, np.nonzero(~on)[0][: nb - len(idx)]]).astype(np.int32)


class RowPlacement:
    """Where arrays with a row dimension live (see the module docstring). Lives across batches: it
    holds one compiled cache creation per cache shape, as the other jitted steps are compiled once."""

    def __init__(self, mesh: jax.sharding.Mesh | None = None):
        split = mesh is not None and (mesh.shape.get("data", 1) > 1 or mesh.shape.get("tensor", 1) > 1)
        self.mesh = mesh if split else None
        self._makers: dict = {}

    def rows(self, x, batch_dim: int = 0):
        """x with its rows (dimension `batch_dim`) on the mesh's data axis; unchanged without a mesh."""
        return x if self.mesh is None else sharding.place_rows(x, self.mesh, batch_dim)

    def layout(self, tree):
        """The sharding of each array of `tree` (arrays or their shapes): rows over `data`
        (`sharding.row_sharding`); a `KVCache`'s keys and values also split by KV heads over `tensor`
        (`sharding.kv_sharding`), beside the heads their device's share of the weights computes."""
        row = lambda a: sharding.row_sharding(self.mesh, a.shape)  # noqa: E731
        if isinstance(tree, KVCache):
            kv = lambda a: sharding.kv_sharding(self.mesh, a.shape)  # noqa: E731
            return tree.replace(k=tuple(map(kv, tree.k)), v=tuple(map(kv, tree.v)), valid=row(tree.valid),
                                index=row(tree.index), next_pos=row(tree.next_pos))
        return jax.tree.map(row, tree)

    def settle(self, tree):
        """`tree`'s arrays in their `layout`, moved only where a device call's output came out laid
        out otherwise. With a mesh, each call's inputs then have one sharding whatever call produced
        them, so a consumer compiles once per shape (the shape plan's warm-up covers it), not once
        per producer. Unchanged without a mesh."""
        if self.mesh is None:
            return tree
        return jax.tree.map(lambda a, want: a if a.sharding == want else jax.device_put(a, want), tree,
                            self.layout(tree))

    def init_cache(self, model, b: int, slots: int, dtype=None):
        """A fresh cache of b rows, created already in its `layout` (never whole on one device)."""
        if self.mesh is None:
            return model.init_cache(b, slots, dtype)
        key = (b, slots, None if dtype is None else jnp.dtype(dtype).name)
        if key not in self._makers:
            make = lambda: model.init_cache(b, slots, dtype)  # noqa: E731 - reads only the model's config
            self._makers[key] = jax.jit(make, out_shardings=self.layout(jax.eval_shape(make)))
        return self._makers[key]()


@dataclasses.dataclass
class DeviceBatch:
    """A batch's KV cache (B rows), its next-token logits float[B, V] (None before the first chunk)
    and the cache's write index, tracked on the host."""

    cache: KVCache
    logits: jax.Array | None = None
    index: int = 0
    placement: RowPlacement = dataclasses.field(default_factory=RowPlacement)

    def __setattr__(self, name, value):
        if name in ("cache", "logits") and value is not None and "placement" in self.__dict__:
            value = self.placement.settle(value)  # one layout per shape, whichever call made it
        super().__setattr__(name, value)

    @property
    def size(self) -> int:
        return int(self.cache.valid.shape[0])

    def fits(self, n: int) -> bool:
        """Whether a chunk of n slots fits after the write index."""
        return self.index + n <= self.cache.max_len

    def grow(self, slots: int) -> None:
        self.cache = grow_cache(self.cache, slots)

    def compact(self, free_b: np.ndarray) -> None:
        """Drop every slot of the rows free_b bool[B] (rows that hold no live sequence), then move each
        row's valid slots first (`compact_cache`, exact); the write index drops to the longest row."""
        if free_b.any():
            self.drop(jnp.asarray(np.repeat(free_b[:, None], self.cache.max_len, 1)), jnp.zeros(len(free_b), jnp.int32))
        self.cache = compact_cache(self.cache)
        self.index = int(self.cache.index)

    def drop(self, drop_bs, rewind_b) -> None:
        """Invalidate slots drop_bs bool[B, S]; move each row's next position back by rewind_b int[B]."""
        place = self.placement.rows
        self.cache = drop_slots(self.cache, place(drop_bs), place(rewind_b))

    def head(self, k: int):
        """(cache, logits) of rows [0, k): the whole arrays when k is the batch, else copies."""
        if k == self.size:
            return self.cache, self.logits
        cache, logits = head_rows(self.cache, self.logits, k=k)
        return self.placement.settle(cache), self.placement.settle(logits)  # laid out as a batch's: one program

    def put_head(self, k: int, cache, logits) -> None:
        """Take back what `head(k)` gave out, since extended (the write index comes with the cache)."""
        if k == self.size:
            self.cache, self.logits = cache, logits
        else:  # written back in place (the full arrays are donated)
            self.cache, self.logits = put_head_rows(self.cache, self.logits, cache, logits)

    def prefill(self, model, ids, mask, pos, feats, src_b: np.ndarray, on_b: np.ndarray) -> None:
        """Replace the batch by one prefilled from ids [n, C] (a fresh cache of n rows), row b copying
        row src_b[b] (rows with on_b False empty): a prompt is prefilled once for its whole group."""
        small = self.placement.init_cache(model, ids.shape[0], self.cache.max_len, self.cache.k[0].dtype)
        logits, small = extend_arrays(model, small, ids, mask, pos, feats, last_only=True, fresh=True)
        self.cache, self.logits = broadcast_rows(small, logits, jnp.asarray(src_b), jnp.asarray(on_b))
        jax.block_until_ready(self.logits)
        self.index += ids.shape[1]

    def extend(self, model, ids, mask, pos, feats, on_b: np.ndarray, sel: np.ndarray | None = None) -> None:
        """Write a chunk: ids [B, C], or [n, C] for the row subset `sel` int[n] (from `row_subset(on_b)`:
        only those rows run through the model). Rows with on_b False (mask 0) keep their logits."""
        if sel is not None:
            jsel = jnp.asarray(sel)
            sub = take_rows(self.cache, jsel)
            logits, sub = extend_arrays(model, sub, ids, mask, pos, feats, last_only=True)
            self.cache = put_rows(self.cache, sub, jsel, jnp.int32(self.index), ids.shape[1])
            self.logits = scatter_logits(self.logits, logits, jsel, jnp.asarray(on_b[sel]))
        else:
            logits, self.cache = extend_arrays(model, self.cache, ids, mask, pos, feats, last_only=True)
            self.logits = logits if self.logits is None else merge_rows(jnp.asarray(on_b), logits, self.logits)
        jax.block_until_ready(self.logits)
        self.index += ids.shape[1]

    def decode(self, sampler, active, limit, hist, forced, uid, count, *, multiple: int):
        """One `sampler.decode_chunk` over the rows active bool[B] (in a row bucket of `multiple`; the
        other rows sit out). Returns the chunk as a whole-batch `ChunkOut`."""
        place = self.placement.rows
        sel = row_subset(active, multiple)
        if sel is None:
            out, self.cache, self.logits = sampler.decode_chunk(
                self.cache, self.logits, *map(place, (active, limit, hist, forced, uid, count)), start=self.index
            )
        else:  # only the decoding rows (in a row bucket) run; rows in the sandbox or done sit out
            jsel = jnp.asarray(sel)
            sub, sub_logits = take_rows(self.cache, jsel), self.logits[jsel]
            args = map(place, (active[sel], limit[sel], hist[sel], forced[sel], uid[sel], count[sel]))
            out, sub, sub_logits = sampler.decode_chunk(sub, sub_logits, *args, start=self.index)
            self.cache = put_rows(self.cache, sub, jsel, jnp.int32(self.index), forced.shape[1])
            self.logits = scatter_logits(self.logits, sub_logits, jsel, jnp.asarray(active[sel]))
            out = out.expand(sel, len(active))
        self.index = out.start + out.steps
        return out

    def shardings(self) -> dict[str, str]:
        """PartitionSpecs of the batch's device arrays (KV cache keys, validity, logits) as strings."""
        out = {"cache.k": self.cache.k[0].sharding, "cache.valid": self.cache.valid.sharding}
        if self.logits is not None:
            out["logits"] = self.logits.sharding
        return {k: str(getattr(v, "spec", v)) for k, v in out.items()}
