"""Packing a right-padded batch into fewer rows for the train-side forward (host plan + device unpack).

GRPO batches are padded to the largest bucket among their trajectories: one 400-token trajectory
makes 63 others of ~120 tokens cost 448 each in attention, MLP and the output layer. `pack_plan`
puts whole rows into bins of T slots (first fit, longest first) and writes `pack_src` int32[B, K]
(the flat source index b * T + t of each packed slot, -1 empty; the packed stream is cut into
ceil(B K / T) rows of T), K a fraction of the row length so that shapes stay bucketed
(PACK_SIXTEENTHS). `Qwen25VL.forward_packed` runs the decoder on the packed rows with a segment
mask and each token's own positions; `unpack` scatters per-slot values back to [B, T].

The field has the batch as its leading axis, so it shards and pads (`rl_batch.pad_rows`, -1) like
the others. It is built per process: with several processes the stream would be cut across hosts,
so `pack_plan` is only used with one (see `rl_batch.grpo_batch`).

SFT batches are packed on the host instead (`pack_examples` + `batching.collate_packed`): whole
examples share rows, each with its own positions, images and a `segment_ids` field that the forward
turns into a segment mask; the rows are built per host, so this works with any number of processes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from codedance_jax.train.batching import Bucket, Example

# K = T * n / 16 for the first n whose packed rows hold the batch: a few shapes per bucket (each one
# compiles the log-prob and update steps once), fine enough that a batch needs at most ~1.5x its rows.
PACK_SIXTEENTHS = (2, 3, 4, 6, 8)


def pack_plan(attention_mask_bt: np.ndarray, sixteenths: Sequence[int] = PACK_SIXTEENTHS) -> np.ndarray | None:
    """pack_src int32[B, K] for a right-padded batch, or None when packing would not save a factor 2.
    K = T n / 16 for the first n of `sixteenths` whose packed rows hold the batch (a run's shape
    plan lists the few it compiles)."""
    b, t = attention_mask_bt.shape
    lengths = attention_mask_bt.astype(bool).sum(axis=1)
    bins: list[list[int]] = []
    room: list[int] = []
    for row in np.argsort(-lengths, kind="stable"):
        n = int(lengths[row])
        if n == 0:
            continue
        for j, free in enumerate(room):
            if free >= n:
                bins[j].append(row)
                room[j] -= n
                break
        else:
            bins.append([row])
            room.append(t - n)
    for n16 in sorted(sixteenths):
        k = t * n16 // 16
        if k == 0 or len(bins) * t > b * k:
            continue
        stream = np.full(b * k, -1, np.int32)
        for j, rows in enumerate(bins):
            pos = j * t
            for row in rows:
                n = int(lengths[row])
                stream[pos : pos + n] = row * t + np.arange(n)
                pos += n
        return stream.reshape(b, k)
    return None


def gather_packed(x_bt, src_rt):
    """Values x[B, T] at the packed slots (0 where empty): [R, T]."""
    b, t = x_bt.shape
    return jnp.where(src_rt >= 0, x_bt.reshape(b * t)[jnp.maximum(src_rt, 0)], 0).astype(x_bt.dtype)


def unpack(x_rt, src_rt, shape_bt):
    """Per-slot values [R, T] back to the unpacked [B, T] layout (0 where no slot maps)."""
    b, t = shape_bt
    idx = jnp.where(src_rt >= 0, src_rt, b * t).reshape(-1)
    return jnp.zeros((b * t,), x_rt.dtype).at[idx].set(x_rt.reshape(-1), mode="drop").reshape(b, t)


def _first_fit(needs: Sequence[np.ndarray], cap: np.ndarray, order: Sequence[int]) -> list[list[int]]:
    """Items (taken in `order`) into bins of capacity `cap`: each goes to the first bin with room
    in every dimension. Returns each bin's item indices in placement order."""
    bins: list[list[int]] = []
    room: list[np.ndarray] = []
    for i in order:
        for j, free in enumerate(room):
            if (free >= needs[i]).all():
                bins[j].append(i)
                room[j] = free - needs[i]
                break
        else:
            bins.append([i])
            room.append(cap - needs[i])
    return bins


def pack_examples(examples: Sequence[Example], bucket: Bucket) -> list[list[Example]]:
    """Whole examples into rows of `bucket` (tokens, image tokens and windows all within it): first
    fit, longest first; each row keeps its examples in their batch order. For SFT batches
    (`batching.collate_packed`): a batch of 16 examples of ~130 tokens padded to its bucket fills
    ~60% of its slots, packed rows of the largest bucket ~90%."""
    cap = np.asarray(bucket)
    needs = [np.asarray(ex.needs) for ex in examples]
    for ex, need in zip(examples, needs, strict=True):
        if (need > cap).any():
            raise ValueError(f"{ex.source}: needs {ex.needs}, more than the packed row {bucket}")
    bins = _first_fit(needs, cap, sorted(range(len(examples)), key=lambda i: -examples[i].needs.tokens))
    return [[examples[i] for i in sorted(b)] for b in bins]


def share_images(examples: Sequence[Example], bucket: Bucket, vision_cfg, *, row_multiple: int = 1,
                 rows: int | None = None) -> dict[str, np.ndarray] | None:
    """The batch's distinct images packed into fewer vision rows, or None (no gain).

    A GRPO batch holds each prompt's image once per group member (G copies) and pads every row's
    vision plan to the bucket: the demo's update encoded 64 rows x 96 unit slots for 1,888 real
    units (244 distinct in the benchmark's replayed batch). Here identical images (same grid, same pixels) are encoded once, and the distinct ones go
    first fit into R rows of the bucket's vision plan (R = row_multiple * 2^k, so shapes stay few;
    row_multiple: what the mesh's batch axis needs). Returns those vision fields (pixel_values,
    unit_src, pos_hw, image_id, out_index, each [R, ...]) plus feat_src int32[B, nb]: for row b's
    j-th image placeholder, the flat index r * nb + u of its feature in the tower's [R, nb, D]
    output (`VisionInputs.feat_src`). A shared image's gradient is the sum over the rows that use
    it, as with one copy per row. Features move across rows, so the batch cannot be split into
    micro-batches (`grpo.whole_batch_fields` refuses), and the vision fields do not have the batch's
    rows (`rl_batch.pad_rows` leaves them).
    """
    from codedance_jax.train.batching import num_windows

    q, u, pd = vision_cfg.merge_unit, vision_cfg.window_merged**2, vision_cfg.patch_dim
    b, nb, wb = len(examples), bucket.image_tokens, bucket.windows
    distinct: dict[tuple, list[int]] = {}
    images: list[tuple[np.ndarray, np.ndarray, int, int]] = []  # (grid [1, 3], pixels, units, windows)
    uses: list[list[int]] = []  # per row: its images' indices into `images`, in placeholder order
    for ex in examples:
        row, p = [], 0
        for g in np.asarray(ex.grid_thw).reshape(-1, 3):
            n_patch = int(np.prod(g))
            pix = ex.pixel_values[p : p + n_patch]
            p += n_patch
            # A fingerprint of every 61st value, then an exact comparison: hashing every byte cost
            # more than the rest of the batch's host work (~80 ms per demo batch).
            key = (tuple(int(x) for x in g), hashlib.blake2b(np.ascontiguousarray(pix.reshape(-1)[::61]).tobytes(),
                                                             digest_size=16).digest())
            same = [i for i in distinct.get(key, ()) if np.array_equal(images[i][1], pix)]
            if not same:
                distinct.setdefault(key, []).append(len(images))
                grid = np.asarray(g, np.int64)[None]
                images.append((grid, pix, n_patch // q, num_windows(grid, vision_cfg)))
                same = [len(images) - 1]
            row.append(same[0])
        uses.append(row)
    if not images:
        return None
    needs = [np.asarray(im[2:]) for im in images]  # (units, windows)
    bins = _first_fit(needs, np.asarray([nb, wb]), sorted(range(len(images)), key=lambda i: -images[i][2]))
    if rows is not None:  # exactly this many vision rows (a shape plan's), or None when they do not hold the images
        return None if len(bins) > rows else _shared_fields(examples, images, uses, bins, rows, nb, wb, q, u, pd, vision_cfg)
    r = row_multiple
    while r < len(bins):
        r *= 2
    if r >= b:
        return None
    return _shared_fields(examples, images, uses, bins, r, nb, wb, q, u, pd, vision_cfg)


def _shared_fields(examples, images, uses, bins, r, nb, wb, q, u, pd, vision_cfg) -> dict[str, np.ndarray]:
    from codedance_jax.model.vision import make_plan

    b = len(examples)
    out = {
        "pixel_values": np.zeros((r, nb * q, pd), np.float32),
        "unit_src": np.full((r, wb * u), -1, np.int32),
        "pos_hw": np.zeros((r, wb * u * q, 2), np.int32),
        "image_id": np.full((r, wb * u), -1, np.int32),
        "out_index": np.zeros((r, nb), np.int32),
        "feat_src": np.zeros((b, nb), np.int32),
    }
    where = {}  # image -> flat feature index of its first unit
    for k, members in enumerate(bins):
        p = 0
        for i in members:
            where[i] = k * nb + p // q
            out["pixel_values"][k, p : p + len(images[i][1])] = images[i][1]
            p += len(images[i][1])
        plan = make_plan(np.concatenate([images[i][0] for i in members]), vision_cfg, num_windows=wb, num_units=nb)
        for f in ("unit_src", "pos_hw", "image_id", "out_index"):
            out[f][k] = getattr(plan, f)
    for k, row in enumerate(uses):
        if row:
            src = np.concatenate([where[i] + np.arange(images[i][2]) for i in row])
            out["feat_src"][k, : len(src)] = src
    return out
