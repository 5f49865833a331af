"""The grain input pipeline for SFT: records -> tokenized examples -> bucketed, padded batches.

    records[shard_index::shard_count]        disjoint per host (default: jax process index/count)
      .shuffle(seed).repeat(num_epochs)      deterministic; each epoch reshuffled from the seed
      .map(featurize)                        PIL decode, render, tokenize once, M-RoPE, bucket
      -> to_iter_dataset(threads)            featurization runs in `num_threads` reader threads
      .filter(fits a bucket)                 the rest is counted (kind "too_long", file:line)
    SftIterator: windows of `group_window` batches' worth of examples, grouped by bucket, cut into
      batches, each padded to the largest bucket of its examples (`codedance_jax.train.batching`),
      or, with `pack`, each batch's examples packed several to a row (`train.packing.pack_examples`)

Grouping by bucket inside a window: a batch padded to its longest example wastes the rest of the
rows (attention cost grows with T^2), so the iterator reads `group_window * batch_size` examples,
sorts them by bucket (stable), cuts them into batches and emits those in an order drawn from
(seed, window number). The state is grain's read position at the window start plus how many of
the window's batches were emitted: a restored iterator re-reads the window (deterministic) and
skips those, so a resumed run continues at exactly the same batch. `group_window=1` is plain
consecutive batching.

Multi-host: every host must feed the same shapes to a step, so with `process_count > 1` the
hosts agree on the batch bucket (the max of their choices, one tiny allgather per batch) before
padding. Use `num_epochs=None` (repeat forever, stop after a number of steps) across hosts: shards
differ by at most one record, and a host that ran out first would leave the others waiting.

`get_state()/set_state()` (JSON-serializable) hold grain's read position at the window start, the
window number, the batches emitted from it and the too-long counts. The order depends on (seed,
shard_index, shard_count, batch_size, group_window).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import grain
import numpy as np

from codedance_jax.errors import DataError
from codedance_jax.model.config import ModelConfig
from codedance_jax.protocol import CODE, TurnFormat
from codedance_jax.train import batching, packing
from codedance_jax.train.batching import Bucket, Example, max_bucket_across_hosts
from data import featurize as features
from data import sft_tfds
from data.trajectory import DataReport, Problem, handle_problem

log = logging.getLogger(__name__)


class SftIterator(grain.DatasetIterator):
    """Yields batch dicts (see `data.batching`); checkpointable with get_state/set_state."""

    def __init__(
        self,
        parent: grain.DatasetIterator,
        buckets: Sequence[Bucket],
        *,
        batch_size: int,
        group_window: int = 1,
        drop_remainder: bool = True,
        seed: int = 0,
        pad_id: int,
        vision_cfg,
        report: DataReport,
        agree_bucket: Callable[[int], int],
        pack: Bucket | None = None,
        pack_row_multiple: int = 1,
    ):
        super().__init__(parent)
        if group_window < 1:
            raise ValueError(f"group_window must be >= 1 (1 = no grouping), got {group_window}")
        self.buckets = tuple(buckets)
        self.report = report
        self._bs, self._window, self._drop, self._seed = batch_size, group_window, drop_remainder, seed
        self._pad_id, self._vision_cfg, self._agree = pad_id, vision_cfg, agree_bucket
        self._pack, self._row_multiple = pack, pack_row_multiple
        self._batches: list[list[Example]] = []
        self._window_state: Any = None  # grain state at the start of the current window
        self._window_index = -1
        self._emitted = 0
        self.last_bucket: int | None = None  # index of the bucket of the last batch (for metrics)

    def _fill(self) -> None:
        """Read the next window and cut it into batches (grouped by bucket, order from the seed)."""
        self._window_state = self._parent.get_state()
        self._window_index += 1
        self._emitted = 0
        examples: list[Example] = []
        for _ in range(self._window * self._bs):
            try:
                examples.append(next(self._parent))
            except StopIteration:
                break
        examples.sort(key=lambda ex: ex.bucket)  # stable: equal buckets keep the read order
        batches = [examples[i : i + self._bs] for i in range(0, len(examples), self._bs)]
        if batches and self._drop and len(batches[-1]) < self._bs:
            batches.pop()
        order = np.random.default_rng([self._seed, self._window_index]).permutation(len(batches))
        self._batches = [batches[i] for i in order]

    def __next__(self) -> dict[str, np.ndarray]:
        if self._emitted >= len(self._batches):
            self._fill()
            if not self._batches:
                raise StopIteration
        examples = self._batches[self._emitted]
        self._emitted += 1
        if self._pack is not None:  # same examples, same order of batches: only the layout changes
            rows = packing.pack_examples(examples, self._pack)
            m = self._row_multiple
            n_rows = self._agree(-(-len(rows) // m)) * m  # every host must feed the same shape
            self.last_bucket = None
            return batching.collate_packed(rows, n_rows, self._pack, pad_id=self._pad_id, vision_cfg=self._vision_cfg)
        idx = self._agree(max(ex.bucket for ex in examples))
        self.last_bucket = idx
        return batching.collate(examples, self.buckets[idx], pad_id=self._pad_id, vision_cfg=self._vision_cfg)

    def get_state(self) -> dict[str, Any]:
        if self._window_state is None:  # nothing read yet
            return {"grain": self._parent.get_state(), "window": 0, "emitted": 0,
                    "too_long": int(self.report.counts["too_long"])}
        return {"grain": self._window_state, "window": self._window_index, "emitted": self._emitted,
                "too_long": int(self.report.counts["too_long"])}

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state["grain"])
        self._batches, self._emitted = [], 0
        self._window_index = int(state.get("window", 0)) - 1  # the next _fill re-reads this window
        if state.get("emitted", 0):
            self._fill()
            self._emitted = int(state["emitted"])
        self.report.counts["too_long"] = int(state.get("too_long", 0))


def make_sft_iterator(
    source: Any,
    processor,
    model_cfg: ModelConfig,
    *,
    batch_size: int,
    buckets: Sequence[Sequence[int]],
    seed: int = 0,
    shard_index: int | None = None,
    shard_count: int | None = None,
    num_epochs: int | None = 1,
    turn_format: str | TurnFormat = CODE,
    on_error: str = "skip",
    num_threads: int = 4,
    prefetch: int = 16,
    drop_remainder: bool = True,
    agree_bucket: Callable[[int], int] | None = None,
    group_window: int = 1,
    pack: Sequence[int] = (),
    pack_row_multiple: int = 1,
    cache_mb: float = 0,
) -> SftIterator:
    """Batches for the SFT step.

    Args:
      source: a random-access source of records (`sft_tfds.open_source(...)`, or a sequence of
        `Trajectory`), or a dataset directory `{data_dir}/sft_trajectories/{name}/{version}`.
      processor: `codedance_jax.processing.Processor` (tokenizer + image processor).
      model_cfg: the model's config (vision plan and image token id).
      buckets: (tokens, image_tokens, windows) triples, non-decreasing in every field.
      shard_index, shard_count: this host's shard; default `jax.process_index()/process_count()`.
      num_epochs: passes over this host's shard; None repeats forever.
      on_error: "skip" counts examples that fit no bucket (kind "too_long"); "stop" raises.
      agree_bucket: maps this host's batch bucket index to the one all hosts use; default
        `max_bucket_across_hosts` (identity on one process).
      group_window: group examples by bucket within windows of this many batches (1 = off).
      pack: a (tokens, image_tokens, windows) row shape, at least the largest bucket in every
        field: each batch's examples are packed into rows of it (`train.packing.pack_examples`,
        `batching.collate_packed`, with `segment_ids`) instead of one padded row each; the batch
        then has a multiple of `pack_row_multiple` rows (the same on every host). () = off.
      cache_mb: keep featurized examples in memory up to this many MB (pixels, ids, positions), so
        that later epochs skip the PIL decode, image processing and tokenization (~4 ms an example
        on these 2-core VMs: 37 s of the demo SFT's 600 steps, taken from the training step's
        cores). The examples and their order are the same with or without it; 0 = off.
    """
    if shard_index is None or shard_count is None:
        import jax

        shard_index, shard_count = jax.process_index(), jax.process_count()
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index {shard_index} is not in [0, shard_count={shard_count})")
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    _check_processor(processor, model_cfg)
    buckets = batching.check_buckets(buckets)
    pack_bucket = None
    if pack:
        pack_bucket = batching.check_buckets([pack])[0]
        if not all(x >= y for x, y in zip(pack_bucket, buckets[-1], strict=True)):
            raise ValueError(f"pack row {pack_bucket} must hold the largest bucket {buckets[-1]} in every field")
        if pack_row_multiple < 1:
            raise ValueError(f"pack_row_multiple must be >= 1, got {pack_row_multiple}")
    if isinstance(source, (str, os.PathLike)):
        import tensorflow_datasets as tfds

        source = tfds.builder_from_directory(os.fspath(source)).as_data_source(split="train")
    if len(source) < shard_count:
        raise ValueError(f"{len(source)} records cannot be split over {shard_count} hosts")
    report = DataReport()
    lock = threading.Lock()

    records = grain.MapDataset.source(source)[shard_index::shard_count]
    n_records = len(records)
    cache: dict[int, Example] = {}
    cached_bytes = [0]

    def featurize(i) -> Example:
        # The pipeline shuffles record *indices* (the same permutation as shuffling the records),
        # so an example can be cached by index across epochs.
        i = int(i)
        ex = cache.get(i)
        if ex is None:
            ex = features.featurize(sft_tfds.to_trajectory(records[i]), processor, model_cfg, buckets, turn_format)
            size = sum(x.nbytes for x in (ex.input_ids, ex.trained, ex.positions, ex.pixel_values, ex.grid_thw))
            with lock:
                if cached_bytes[0] + size <= cache_mb * 2**20:
                    cache[i] = ex
                    cached_bytes[0] += size
        return ex

    kept = [0]

    def fits(ex: Example) -> bool:
        if ex.bucket is not None:
            kept[0] += 1
            return True
        file, _, line = ex.source.rpartition(":")
        problem = Problem(
            file, int(line) if line.isdigit() else 0, "too_long", f"needs {ex.needs}; largest bucket {buckets[-1]}"
        )
        with lock:
            if report.counts["too_long"] < 20:
                log.warning("skipping example: %s", problem)
            handle_problem(problem, report, on_error)
            # Every record of a full pass dropped: repeating would spin forever without a batch.
            if not kept[0] and report.counts["too_long"] >= n_records:
                raise DataError(f"no example fits a bucket: all {n_records} records are too long, e.g. "
                                f"{problem.file}:{problem.line}: {problem.detail}",
                                "add a larger bucket to --config.data.buckets")
        return False

    ds = grain.MapDataset.range(n_records).shuffle(seed=seed).repeat(num_epochs).map(featurize)
    opts = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch)
    it_ds = ds.to_iter_dataset(opts).filter(fits)
    return SftIterator(
        iter(it_ds),
        buckets,
        batch_size=batch_size,
        group_window=group_window,
        drop_remainder=drop_remainder,
        seed=seed,
        pad_id=processor.pad_id,
        vision_cfg=model_cfg.vision,
        report=report,
        agree_bucket=agree_bucket or max_bucket_across_hosts,
        pack=pack_bucket,
        pack_row_multiple=pack_row_multiple,
    )


def _check_processor(processor, model_cfg: ModelConfig) -> None:
    """The processor and the model must agree on patch layout and the image token."""
    ic, vc = processor.image_config, model_cfg.vision
    pairs = {
        "image token id": (processor.image_token_id, model_cfg.image_token_id),
        "merge_size": (ic.merge_size, vc.spatial_merge_size),
        "patch_size": (ic.patch_size, vc.patch_size),
        "temporal_patch_size": (ic.temporal_patch_size, vc.temporal_patch_size),
    }
    bad = {k: v for k, v in pairs.items() if v[0] != v[1]}
    if bad:
        raise ValueError(f"processor and model config disagree (processor, model): {bad}")
