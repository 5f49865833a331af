"""Finished trajectories -> the GRPO batch (host numpy), padded to a (T, Nb, Wb) bucket.

The batch is the SFT batch contract (`train/batching.py`: input_ids, attention_mask, targets,
loss_mask aligned with targets, positions [3, B, T], per-row vision plan) plus the GRPO fields of
`train/grpo.py`, all aligned with `targets` (column t is about token t + 1):

    old_logprobs float32[B, T]  the sampler's recorded log-probs (log_softmax(logits / T))
    turn_ids     int32[B, T]    the turn index of each sampled target token, -1 elsewhere
    a_seq        float32[B]     a_turn float32[B, M]  (R_BAT kernel)

Positions are recomputed from the full token sequence with `mrope_positions`; the rollout engine
wrote observation chunks at each row's next position, which is the same thing (tested), so the
recomputed log-probs equal the recorded ones up to float error. Images are encoded once per step:
the pixel values the engine fed the model travel with the trajectory (`Trajectory.vision`, in
memory only); a record loaded from JSONL is re-encoded from its PIL images (the exact images the
engine gave the processor). The grids must equal the recorded `image_grid_thw`, a cheap guard
against a processor mismatch.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from codedance_jax.model.config import ModelConfig
from codedance_jax.model.rope import mrope_positions
from codedance_jax.train.batching import VISION_KEYS, Bucket, Example, choose_bucket, collate, num_windows
from codedance_jax.train.packing import PACK_SIXTEENTHS, pack_plan
from codedance_jax.train.packing import share_images as share_images_layout


def trajectory_example(traj, processor, cfg: ModelConfig, buckets: Sequence[Bucket]) -> Example:
    ids = np.asarray(traj.tokens, np.int32)
    vision = getattr(traj, "vision", None) or []
    if traj.images and len(vision) == len(traj.images):  # encoded once, by the rollout engine
        pv = np.concatenate([np.asarray(v[0]) for v in vision])
        grid = np.concatenate([np.asarray(v[1]).reshape(-1, 3) for v in vision])
    elif traj.images:  # a record loaded from JSONL carries only the images
        pv, grid = processor.encode_images(list(traj.images))
    else:
        pv, grid = np.zeros((0, cfg.vision.patch_dim), np.float32), np.zeros((0, 3), np.int64)
    if traj.image_grid_thw and not np.array_equal(np.asarray(traj.image_grid_thw), grid):
        raise ValueError(f"trajectory {traj.id}: re-encoded image grids {grid.tolist()} differ from the recorded "
                         f"{traj.image_grid_thw}; the processor is not the one that rolled it out")
    pos, _ = mrope_positions(ids[None], None, grid if len(grid) else None, image_token_id=cfg.image_token_id,
                             spatial_merge_size=cfg.vision.spatial_merge_size)
    n_img = int(processor.num_image_tokens(grid).sum()) if len(grid) else 0
    needs = Bucket(len(ids), n_img, num_windows(grid, cfg.vision))
    trained = np.asarray(traj.loss_mask, bool)
    return Example(ids, trained, pos[:, 0], pv, grid, needs, choose_bucket(needs, buckets), traj.id)


def grpo_batch(trajs, processor, cfg: ModelConfig, buckets: Sequence[Bucket], a_seq: np.ndarray,
               a_turn: np.ndarray, *, bucket: Bucket | None = None, examples=None, pack: bool | None = None,
               share_images: bool | None = None, row_multiple: int | None = None,
               pack_sixteenths: Sequence[int] = PACK_SIXTEENTHS, vision_rows: int | None = None,
               drop_pixels: bool | None = None) -> dict[str, np.ndarray]:
    """The GRPO batch of `trajs` (row order kept). A trajectory that fits no bucket is an error
    naming the sizes (raise the buckets or lower the rollout budgets: they must agree).

    pack: add `pack_src` (`train.packing`) when the rows fit in half the slots or fewer, so the
    log-prob recompute and the update run the decoder over the packed rows (default: on with one
    process; the packed stream is not cut per host).
    share_images: encode each distinct image once, in fewer vision rows than the batch has, with
    `feat_src` mapping each row's placeholders to its features (`packing.share_images`; default:
    as `pack`). row_multiple: what the mesh's batch axis needs of the vision row count (default:
    the device count, which any mesh's batch axis divides). Neither layout suits micro-batches:
    pass both False with grad_accum > 1.

    A run's shape plan (`runs/grpo_plan.py`) narrows the layouts: `pack_sixteenths` the packed
    widths tried, `vision_rows` exactly that many shared vision rows (None: the fewest of
    row_multiple x 2^k), `drop_pixels` whether a text-only batch leaves out the vision fields
    (None: with one process; False keeps one field set for every batch)."""
    exs = examples if examples is not None else [trajectory_example(t, processor, cfg, buckets) for t in trajs]
    bad = [e for e in exs if e.bucket is None]
    if bad:
        raise ValueError(f"trajectory {bad[0].source} needs {tuple(bad[0].needs)} (tokens, image tokens, windows), "
                         f"more than the largest GRPO bucket {tuple(buckets[-1])}; raise config.buckets to cover "
                         f"rollout.max_total_tokens")
    if bucket is None:
        bucket = buckets[max(e.bucket for e in exs)]
    if pack is None:
        pack = jax.process_count() == 1
    share = pack if share_images is None else share_images
    shared = share_images_layout(exs, bucket, cfg.vision, row_multiple=row_multiple or jax.device_count(),
                                 rows=vision_rows) if share else None
    batch = collate(exs, bucket, pad_id=processor.pad_id, vision_cfg=cfg.vision, vision=shared is None)
    if shared is not None:
        batch.update(shared)
    t = bucket.tokens
    old = np.zeros((len(trajs), t), np.float32)
    tid = np.full((len(trajs), t), -1, np.int32)
    for b, tr in enumerate(trajs):
        n = len(tr.tokens)
        lp = np.asarray(tr.logprobs, np.float32)
        ti = np.asarray(tr.turn_ids, np.int32)
        m = np.asarray(tr.loss_mask, bool)
        old[b, : n - 1] = np.where(m[1:], lp[1:], 0.0)
        tid[b, : n - 1] = np.where(m[1:], ti[1:], -1)
    batch["old_logprobs"] = old
    batch["turn_ids"] = tid
    batch["a_seq"] = np.asarray(a_seq, np.float32)
    batch["a_turn"] = np.asarray(a_turn, np.float32)
    if drop_pixels is None:
        drop_pixels = jax.process_count() == 1
    if drop_pixels and not any(len(e.grid_thw) for e in exs):
        # Text only: without pixel_values the forward skips the vision tower (it would encode the
        # padding of the bucket: 3x the decoder's time at Tunix's sizes). The plan fields stay, for
        # the loop's metrics. One process only: hosts must agree on the batch's fields.
        batch.pop("pixel_values")
    if pack:
        src = pack_plan(batch["attention_mask"], pack_sixteenths)
        if src is not None:
            batch["pack_src"] = src
    return batch


def pad_rows(batch: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    """Pad the batch with empty rows (mask 0, no trained tokens) to `rows`, so it divides over the mesh."""
    b = batch["input_ids"].shape[0]
    if rows == b:
        return batch
    out = {}
    for k, v in batch.items():
        if "feat_src" in batch and k in VISION_KEYS:  # shared images: their own rows (`packing.share_images`)
            out[k] = v
            continue
        axis = 1 if k == "positions" else 0
        width = [(0, 0)] * v.ndim
        width[axis] = (0, rows - b)
        fill = -1 if k in ("turn_ids", "unit_src", "image_id", "pack_src") else 0
        out[k] = np.pad(v, width, constant_values=fill)
    return out
