"""Examples and batches for the train steps: shape buckets, the unpadded `Example`, padding to a bucket.

SFT (`data/featurize.py` tokenizes a trajectory into an `Example`) and GRPO (`train/rl_batch.py`
builds one from a rollout) both pad with `collate`; this is the batch contract of `train/sft.py`.

A bucket is a triple (T tokens, Nb image tokens, Wb vision windows). An example fits a bucket when
its tokens, image tokens (merged units) and windows all fit; it goes to the first (smallest) bucket
that fits. Buckets must be non-decreasing in every field, so a batch of examples that each fit
some bucket fits the largest of their buckets; a batch is padded to that bucket, and a train step
compiles once per bucket at most.

Batch contract (all numpy, leading batch dim B; per-example vision so everything shards along B):
  input_ids int32[B, T], attention_mask int32[B, T] (right padding), targets int32[B, T]
  (input_ids shifted left by one, pad at the end), loss_mask float32[B, T] (1 where targets[b, t]
  is a trained assistant token), positions int32[3, B, T] (M-RoPE, 0 on padding),
  pixel_values float32[B, Pb, patch_dim] with Pb = Nb * Q, the vision plan per row —
  unit_src int32[B, Wb*U], pos_hw int32[B, Wb*U*Q, 2], image_id int32[B, Wb*U],
  out_index int32[B, Nb] — equal to `make_plan(grid_thw_of_row, cfg.vision, num_windows=Wb,
  num_units=Nb)` (rows without images: unit_src -1, image_id -1, out_index 0), and
  num_tokens int32[B] (loss tokens per row; sum it for the batch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from codedance_jax.model.config import VisionConfig
from codedance_jax.model.vision import make_plan


class Bucket(NamedTuple):
    tokens: int  # T
    image_tokens: int  # Nb, merged units; the bucket holds Pb = Nb * Q patches
    windows: int  # Wb


def check_buckets(buckets: Sequence[Sequence[int]]) -> tuple[Bucket, ...]:
    """Buckets as `Bucket`s, sorted; raises if a field is not a positive int or not monotone."""
    out = []
    for b in buckets:
        if len(b) != 3 or not all(isinstance(x, (int, np.integer)) and x >= 1 for x in b):
            raise ValueError(f"bucket {tuple(b)} must be three positive ints (tokens, image_tokens, windows)")
        out.append(Bucket(*(int(x) for x in b)))
    if not out:
        raise ValueError("buckets is empty: give at least one (tokens, image_tokens, windows) triple")
    out.sort()
    for a, b in zip(out, out[1:], strict=False):
        if not all(x <= y for x, y in zip(a, b, strict=True)):
            raise ValueError(
                f"buckets must be non-decreasing in every field (so a batch fits its largest example's bucket); "
                f"{a} and {b} are not"
            )
    return tuple(out)


def choose_bucket(needs: Bucket, buckets: Sequence[Bucket]) -> int | None:
    """Index of the first bucket that holds `needs`, or None."""
    for i, b in enumerate(buckets):
        if needs.tokens <= b.tokens and needs.image_tokens <= b.image_tokens and needs.windows <= b.windows:
            return i
    return None


def num_windows(grid_thw: np.ndarray, cfg: VisionConfig) -> int:
    """Windows `make_plan` lays out for these images (without bucket padding)."""
    m, wm = cfg.spatial_merge_size, cfg.window_merged
    return int(sum(int(t) * -(-(int(h) // m) // wm) * -(-(int(w) // m) // wm) for t, h, w in np.asarray(grid_thw)))


def max_bucket_across_hosts(index: int) -> int:
    """The largest bucket index any host chose for this step (identity on one process)."""
    import jax

    if jax.process_count() == 1:
        return index
    from jax.experimental import multihost_utils

    return int(np.max(multihost_utils.process_allgather(np.asarray(index, np.int32))))


@dataclasses.dataclass(frozen=True)
class Example:
    """One tokenized trajectory, unpadded. n tokens, I images, P patches."""

    input_ids: np.ndarray  # int32[n]
    trained: np.ndarray  # bool[n], True on assistant tokens
    positions: np.ndarray  # int32[3, n]
    pixel_values: np.ndarray  # float32[P, patch_dim]
    grid_thw: np.ndarray  # int64[I, 3]
    needs: Bucket
    bucket: int | None  # None: fits no bucket
    source: str


# The per-row vision plan fields of the batch contract (module docstring), in `VisionInputs` order.
VISION_KEYS = ("pixel_values", "unit_src", "pos_hw", "image_id", "out_index")


def collate(
    examples: Sequence[Example], bucket: Bucket, *, pad_id: int, vision_cfg: VisionConfig, vision: bool = True
) -> dict[str, np.ndarray]:
    """Pad `examples` into one batch of shape `bucket` (see the module docstring for the contract).
    vision=False leaves out the per-row vision fields (the caller lays the images out itself:
    `packing.share_images`)."""
    batch = _collate_rows([[ex] for ex in examples], len(examples), bucket, pad_id=pad_id, vision_cfg=vision_cfg,
                          vision=vision)
    del batch["segment_ids"]
    return batch


def empty_batch(rows: int, bucket: Bucket, *, pad_id: int, vision_cfg: VisionConfig) -> dict[str, np.ndarray]:
    """`collate` of `rows` empty rows: the contract's fields, shapes and dtypes at this bucket (the
    shape plans compile their steps on it before step 1)."""
    batch = _collate_rows([[]] * rows, rows, bucket, pad_id=pad_id, vision_cfg=vision_cfg)
    del batch["segment_ids"]
    return batch


def collate_packed(
    rows: Sequence[Sequence[Example]], num_rows: int, bucket: Bucket, *, pad_id: int, vision_cfg: VisionConfig
) -> dict[str, np.ndarray]:
    """Several examples per row (`train.packing.pack_examples`): the batch contract with `num_rows`
    rows of shape `bucket` (rows past len(rows) are padding) plus segment_ids int32[R, T] (k on the
    k-th example of the row, 1-based; 0 on padding). Each example keeps its own M-RoPE positions
    (from 0), its targets end with it, and a row's images are its examples' images in order (one
    vision plan per row: images never attend to each other), so a forward with a segment mask
    (`Qwen25VL.forward(segment_ids=)`) gives every token the hidden state it has unpacked."""
    if len(rows) > num_rows:
        raise ValueError(f"{len(rows)} packed rows do not fit in {num_rows}")
    return _collate_rows(list(rows) + [[]] * (num_rows - len(rows)), num_rows, bucket, pad_id=pad_id,
                         vision_cfg=vision_cfg)


def _collate_rows(rows, bsz: int, bucket: Bucket, *, pad_id: int, vision_cfg: VisionConfig,
                  vision: bool = True) -> dict[str, np.ndarray]:
    t, nb, wb = bucket
    q, u, pd = vision_cfg.merge_unit, vision_cfg.window_merged**2, vision_cfg.patch_dim
    batch = {
        "input_ids": np.full((bsz, t), pad_id, np.int32),
        "attention_mask": np.zeros((bsz, t), np.int32),
        "targets": np.full((bsz, t), pad_id, np.int32),
        "loss_mask": np.zeros((bsz, t), np.float32),
        "positions": np.zeros((3, bsz, t), np.int32),
        "pixel_values": np.zeros((bsz, nb * q, pd), np.float32),
        "unit_src": np.zeros((bsz, wb * u), np.int32),
        "pos_hw": np.zeros((bsz, wb * u * q, 2), np.int32),
        "image_id": np.zeros((bsz, wb * u), np.int32),
        "out_index": np.zeros((bsz, nb), np.int32),
        "segment_ids": np.zeros((bsz, t), np.int32),
    }
    if not vision:
        for k in VISION_KEYS:
            del batch[k]
    for b, row in enumerate(rows):
        need = Bucket(*(sum(getattr(ex.needs, f) for ex in row) for f in Bucket._fields))
        if need.tokens > t or need.image_tokens > nb or need.windows > wb:
            what = row[0].source if len(row) == 1 else f"{len(row)} examples ({row[0].source}, ...)"
            raise ValueError(f"{what}: needs {need}, more than bucket {bucket}")
        s, p = 0, 0
        for k, ex in enumerate(row):
            n = len(ex.input_ids)
            batch["input_ids"][b, s : s + n] = ex.input_ids
            batch["attention_mask"][b, s : s + n] = 1
            batch["segment_ids"][b, s : s + n] = k + 1
            batch["targets"][b, s : s + n - 1] = ex.input_ids[1:]
            batch["loss_mask"][b, s : s + n - 1] = ex.trained[1:]
            batch["positions"][:, b, s : s + n] = ex.positions
            if vision:
                batch["pixel_values"][b, p : p + len(ex.pixel_values)] = ex.pixel_values
            s, p = s + n, p + len(ex.pixel_values)
        if not vision:
            continue
        grids = [ex.grid_thw for ex in row if len(ex.grid_thw)]
        grid = np.concatenate(grids) if grids else np.zeros((0, 3), np.int64)
        plan = make_plan(grid, vision_cfg, num_windows=wb, num_units=nb)
        batch["unit_src"][b] = plan.unit_src
        batch["pos_hw"][b] = plan.pos_hw
        batch["image_id"][b] = plan.image_id
        batch["out_index"][b] = plan.out_index
    batch["num_tokens"] = batch["loss_mask"].sum(axis=1).astype(np.int32)
    return batch
