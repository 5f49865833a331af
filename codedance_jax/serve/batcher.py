"""Continuous batching of chat completions onto the rollout sampler's jitted decode chunk.

One thread owns the device state: a static batch of `max_batch` rows sharing one KV cache (a
`rollout.device_batch.DeviceBatch`, as the rollout engine's: shared write index, per-row valid
slots and positions). Its loop:

  1. admit waiting sequences into free rows: their prompts are written in ONE chunk (right padded
     to a power-of-two bucket, every image in one vision call, positions from 0, the other rows
     sitting out with mask 0) — the rollout engine's append-prefill path;
  2. run one `Sampler.decode_chunk` (N steps) for every decoding row, each with its own
     temperature / top-p / greedy flag and its own key stream (`uid` from the request's seed);
  3. hand each row's new tokens to its request (streamed text deltas), end rows on EOS, a stop
     string, `max_tokens` or the context budget, and free their cache slots at once.

So a request that arrives while others decode waits at most one chunk plus its own prefill, and a
finished row returns as soon as its chunk ends, never after the batch's longest member. New
sequences take the lowest free rows and each device call covers only rows [0, k), k the smallest
power of two past the last busy row: one request alone decodes at batch 1, not at `max_batch`. When the
shared write index runs out of room, finished rows' slots are dropped and the cache is compacted
(`generate.compact_cache`, exact).

Room: a prefill is padded to a power of two but never past `max_context`, so after a compaction
(write index <= the longest row <= `max_context`) one prefill and one chunk always fit the
`2 * max_context + decode_chunk` slots; waiting sequences that still do not fit stay queued until
rows finish (never an error). A prompt over `max_context` is refused by the app (400) before it
gets here. A cancelled sequence (its client went away) is dropped from the queue, and its row is
freed after the chunk that is running.

Stop strings: the device stops a row on EOS (`<|im_end|>`, `<|endoftext|>`); request stops are
found on the decoded text after each chunk (the row is ended there and its text cut before the
stop, as OpenAI does; tokens sampled past it are discarded with the row).

Placement: `Batcher(..., mesh=)` with a sampling mesh (`rollout.placement.sampling_mesh`; the model's
parameters placed for it by `placement.sampling_params`) splits every array with a row dimension
over its `data` axis and the KV cache's heads over `tensor` (`device_batch.RowPlacement`, as the
rollout engine does), and row buckets are then `data` x a power of two (so each device holds whole
rows; `max_batch` must divide by `data`). Without one (or with a one-device mesh) arrays stay
where jit puts them, as before. Rows are independent, so a row's tokens do not depend on the mesh
beyond float noise (greedy replies are the same: tests/serve/test_serve_mesh.py).

Deviation from the rollout engine: greedy rows of a mixed batch take an extra argmax per step
(one compiled variant for all-greedy batches, one for mixed ones).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from codedance_jax.errors import ConfigError
from codedance_jax.model import rope
from codedance_jax.model.generate import encode_vision, extend_arrays, vision_inputs
from codedance_jax.protocol import END_MARKERS
from codedance_jax.rollout import CompileCounter, RowSampling, Sampler, SamplingConfig, build_stop_table, vision_bucket
from codedance_jax.rollout.buckets import pow2
from codedance_jax.rollout.device_batch import DeviceBatch, RowPlacement, merge_rows, row_bucket

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Choice:
    """One choice of one request: the prompt and its sampling settings, filled in by the batcher."""

    input_ids: np.ndarray  # int32[T]
    pixel_values: np.ndarray | None
    image_grid_thw: np.ndarray | None
    max_tokens: int
    temperature: float
    top_p: float
    greedy: bool
    uid: int
    stop: tuple[str, ...] = ()
    on_event: Callable[[dict], None] | None = None  # called from the batcher thread
    # results
    tokens: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of `text` already streamed
    finish_reason: str | None = None
    cancelled: bool = False  # set by the request's side when its client went away
    submitted_at: float = 0.0
    first_token_at: float | None = None


@dataclasses.dataclass
class _Slot:
    seq: Choice | None = None
    next_pos: int = 0


class Batcher:
    """`submit(choice)` from any thread; events arrive through `seq.on_event` (see `_emit`)."""

    def __init__(self, model, processor, *, max_batch: int = 8, max_context: int = 4096, decode_chunk: int = 16,
                 min_prefill: int = 64, vision_min_units: int = 64, mesh=None):
        self.model, self.processor = model, processor
        self.placement = RowPlacement(mesh)  # rows over the mesh's `data` axis (none without a mesh)
        self.multiple = 1 if self.placement.mesh is None else int(self.placement.mesh.shape["data"])
        if max_batch % self.multiple:
            raise ConfigError(f"max_batch={max_batch} does not split over the sampling mesh's {self.multiple} data slices",
                              f"set max_batch to a multiple of {self.multiple}, or mesh_data to a divisor of {max_batch}")
        self.max_batch, self.max_context, self.decode_chunk = max_batch, max_context, decode_chunk
        self.min_prefill, self.vision_min_units = min_prefill, vision_min_units
        cfg = model.cfg
        vocab_limit = min(len(processor.tokenizer), cfg.text.vocab_size)
        stops = build_stop_table(processor.tokenizer, END_MARKERS, cfg.text.vocab_size)
        banned = (cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id)
        # The config's temperature / top_p are unused: every chunk passes per-row settings.
        self.sampler = Sampler(model, stops, SamplingConfig(), vocab_limit, decode_chunk, banned)
        self.hist_len = stops.history
        self.pad_id = processor.pad_id
        # Room for the longest row plus one prefill and one chunk after a compaction.
        self.cache_slots = 2 * max_context + decode_chunk
        self.slots = [_Slot() for _ in range(max_batch)]
        self.batch = DeviceBatch(self.placement.init_cache(model, max_batch, self.cache_slots),
                                 self.placement.rows(np.zeros((max_batch, cfg.text.vocab_size), np.float32)),
                                 placement=self.placement)
        self.waiting: queue.Queue[Choice] = queue.Queue()
        self._backlog: list[Choice] = []
        self._admitting: list[Choice] = []  # taken from the backlog, not yet in a row (failed together on a bug)
        self._stop = threading.Event()
        self.stats = {"chunks": 0, "prefills": 0, "compactions": 0, "generated_tokens": 0, "max_rows": 0}
        self._compiles = CompileCounter()  # XLA compilations in this process (reported by /health)
        self._thread = threading.Thread(target=self._run, name="codedance-batcher", daemon=True)
        self.error: str | None = None

    # ------------------------------------------------------------------ public
    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self.waiting.put(None)  # wake the loop
        self._thread.join(timeout=30)

    def snapshot(self) -> dict:
        """Counters for /health: chunks, prefills, compactions, tokens, the most rows busy, compilations."""
        return {**self.stats, "compiles": CompileCounter.total(), "busy_rows": sum(s.seq is not None for s in self.slots),
                "waiting": self.waiting.qsize() + len(self._backlog)}

    def submit(self, seq: Choice) -> None:
        if self.error is not None:
            raise RuntimeError(f"the decode loop stopped: {self.error}")
        seq.submitted_at = time.perf_counter()
        self.waiting.put(seq)

    # ------------------------------------------------------------------ the loop
    def _run(self):
        try:
            while not self._stop.is_set():
                busy = any(s.seq is not None for s in self.slots)
                self._take_waiting(block=not busy)
                self._admit()
                if any(s.seq is not None for s in self.slots):
                    self._decode()
        except Exception as e:  # noqa: BLE001 - a bug must fail the requests, never hang them
            log.exception("decode loop failed")
            self.error = f"{type(e).__name__}: {e}"
            for s in self.slots:
                if s.seq is not None:
                    self._emit(s.seq, {"type": "error", "message": self.error})
            for seq in self._admitting + self._backlog:
                self._emit(seq, {"type": "error", "message": self.error})
            while True:
                try:
                    seq = self.waiting.get_nowait()
                except queue.Empty:
                    break
                if seq is not None:
                    self._emit(seq, {"type": "error", "message": self.error})

    def _take_waiting(self, block: bool):
        try:
            while True:
                seq = self.waiting.get(block=block and not self._backlog, timeout=0.5 if block else None)
                block = False
                if seq is not None:
                    self._backlog.append(seq)
        except queue.Empty:
            pass

    def _admit(self):
        free = [i for i, s in enumerate(self.slots) if s.seq is None]
        if not free or not self._backlog:
            return
        self._backlog = [q for q in self._backlog if not q.cancelled]
        take, self._backlog = self._backlog[: len(free)], self._backlog[len(free) :]
        if not take:
            return
        # Padded to a power of two (few shapes to compile) but never past max_context (see "Room").
        length = min(pow2(max(len(q.input_ids) for q in take), self.min_prefill), self.max_context)
        if not self._make_room(length):  # wait for rows to finish; nothing is lost
            self._backlog = take + self._backlog
            return
        self._admitting = take
        rows = free[: len(take)]  # the lowest free rows: busy rows stay packed at the front
        b = self._rows_in_use(max(rows) + 1)
        ids = np.full((b, length), self.pad_id, np.int32)
        mask = np.zeros((b, length), np.int32)
        on = np.zeros(b, bool)
        pvs, grids = [], []
        for i, q in zip(rows, take, strict=True):
            n = len(q.input_ids)
            ids[i, :n], mask[i, :n], on[i] = q.input_ids, 1, True
            if q.pixel_values is not None:
                pvs.append(q.pixel_values)
                grids.append(q.image_grid_thw)
        grid = np.concatenate(grids) if grids else None
        cfg = self.model.cfg
        pos, next_pos = rope.mrope_positions(ids, mask, grid, image_token_id=cfg.image_token_id,
                                             spatial_merge_size=cfg.vision.spatial_merge_size, start=0)
        feats = None
        if grids:
            vis = vision_inputs(np.concatenate(pvs), grid, cfg, **vision_bucket(grid, cfg, self.vision_min_units))
            feats = encode_vision(self.model, vis)
        place = self.placement.rows
        cache, old_logits = self.batch.head(b)
        logits, cache = extend_arrays(self.model, cache, place(ids), place(mask), place(pos, 1), feats, last_only=True)
        self.batch.put_head(b, cache, merge_rows(place(on), logits.astype(jnp.float32), old_logits))
        self.batch.index += length
        for i, q in zip(rows, take, strict=True):
            self.slots[i] = _Slot(seq=q, next_pos=int(next_pos[i]))
        self._admitting = []
        self.stats["prefills"] += 1
        self.stats["max_rows"] = max(self.stats["max_rows"], sum(s.seq is not None for s in self.slots))

    def _decode(self):
        n = self.decode_chunk
        self._ensure_room(n)
        b = self._rows_in_use(1 + max(i for i, s in enumerate(self.slots) if s.seq is not None))
        active = np.zeros(b, bool)
        limit = np.zeros(b, np.int32)
        hist = np.full((b, self.hist_len), -1, np.int32)
        uid = np.zeros(b, np.int32)
        count = np.zeros(b, np.int32)
        temp, top_p, greedy = np.ones(b, np.float32), np.ones(b, np.float32), np.ones(b, bool)
        for i, s in enumerate(self.slots[:b]):
            q = s.seq
            if q is None:
                continue
            active[i] = True
            limit[i] = min(q.max_tokens - len(q.tokens), self.max_context - s.next_pos)
            h = q.tokens[-self.hist_len :]
            if h:
                hist[i, self.hist_len - len(h) :] = h
            uid[i], count[i] = q.uid, len(q.tokens)
            temp[i], top_p[i], greedy[i] = (1.0 if q.greedy else q.temperature), q.top_p, q.greedy
        forced = np.full((b, n), -1, np.int32)
        place = self.placement.rows
        cache, logits = self.batch.head(b)
        out, cache, logits = self.sampler.decode_chunk(
            cache, logits, *map(place, (active, limit, hist, forced, uid, count)), rows=RowSampling(temp, top_p, greedy))
        self.batch.put_head(b, cache, logits)
        self.batch.index = out.start + out.steps
        self.stats["chunks"] += 1
        self.stats["row_steps"] = self.stats.get("row_steps", 0) + b * out.steps
        done = np.zeros(self.max_batch, bool)
        for i, s in enumerate(self.slots[:b]):
            q = s.seq
            if q is None:
                continue
            em = out.emitted[i]
            new = out.tokens[i, em].tolist()
            s.next_pos += len(new)
            self.stats["generated_tokens"] += len(new)
            if new and q.first_token_at is None:
                q.first_token_at = time.perf_counter()
            q.tokens += new
            q.logprobs += out.logprobs[i, em].tolist()
            if q.cancelled:
                reason = q.finish_reason = "cancelled"
            else:
                reason = self._finish_reason(q, s, bool(out.stopped[i]), bool(out.active[i]))
                self._stream(q, reason)
            if reason is not None:
                done[i] = True
                s.seq = None
        if done.any():  # free the rows: no valid slot, and positions back to 0 (extend keeps the max)
            self.batch.drop(np.repeat(done[:, None], self.cache_slots, 1),
                            jnp.where(self.placement.rows(done), self.batch.cache.next_pos, 0))

    def _finish_reason(self, q: Choice, s: _Slot, stopped: bool, still_active: bool) -> str | None:
        """Decode the row's text; cut at EOS or a request stop string. Returns the finish reason or None."""
        toks = q.tokens
        eos = [k for k, t in enumerate(toks) if t in self._eos_ids]
        if eos:
            del toks[eos[0]:], q.logprobs[eos[0]:]
        q.text = self.processor.decode(toks, skip_special_tokens=True)
        if q.stop:
            hits = [(q.text.find(st), st) for st in q.stop if st and st in q.text]
            if hits:
                cut = min(h[0] for h in hits)
                # Keep the tokens whose text ends before the stop (the shortest prefix holding it).
                k = len(toks)
                while k > 0 and len(self.processor.decode(toks[: k - 1], skip_special_tokens=True)) >= cut + 1:
                    k -= 1
                del toks[k:], q.logprobs[k:]
                q.text = q.text[:cut]
                return "stop"
        if eos or stopped:
            return "stop"
        if len(toks) >= q.max_tokens or s.next_pos >= self.max_context:
            return "length"
        if not still_active:  # the device ended the row for a reason the host does not see: budget
            return "length"
        return None

    @property
    def _eos_ids(self) -> frozenset:
        if not hasattr(self, "_eos_cache"):
            tok = self.processor.tokenizer
            self._eos_cache = frozenset(i for s in END_MARKERS for i in tok.encode(s))
        return self._eos_cache

    def _stream(self, q: Choice, reason: str | None):
        text = q.text
        if reason is None:
            # Hold back what could still become a stop string, and a partial UTF-8 character.
            hold = max((len(st) - 1 for st in q.stop), default=0)
            end = len(text) - hold
            while end > q.sent and text[end - 1] == "\ufffd":
                end -= 1
        else:
            end = len(text)
        if end > q.sent:
            self._emit(q, {"type": "delta", "text": text[q.sent : end]})
            q.sent = end
        if reason is not None:
            q.finish_reason = reason
            self._emit(q, {"type": "done", "finish_reason": reason})

    def _emit(self, q: Choice, event: dict):
        if q.on_event is not None:
            try:
                q.on_event(event)
            except Exception:  # noqa: BLE001 - a vanished client must not stop the loop
                log.exception("event handler failed")

    def _rows_in_use(self, n: int) -> int:
        """The rows a device call covers, [0, k): k the mesh's data size times a power of two, >= n (capped
        at max_batch), so a lightly loaded server does not pay for its whole batch every step, with few
        distinct shapes to compile, and each data slice holds whole rows."""
        return row_bucket(n, self.multiple, self.max_batch)

    def _make_room(self, n: int) -> bool:
        """Whether n slots fit after the write index, compacting the cache if they do not yet."""
        if self.batch.fits(n):
            return True
        self.batch.compact(np.array([s.seq is None for s in self.slots]))  # free rows' slots dropped
        self.stats["compactions"] += 1
        return self.batch.fits(n)

    def _ensure_room(self, n: int):
        if not self._make_room(n):  # a bug: a compacted cache always holds one chunk (see "Room")
            raise RuntimeError(f"the KV cache ({self.cache_slots} slots) cannot hold the batch")


_uids = itertools.count(1)


def request_uid(seed: int | None, choice: int) -> int:
    """The key stream of one choice: from the request's seed (reproducible) or a fresh counter."""
    if seed is None:
        return (0x40000000 + next(_uids) * 977 + choice) & 0x7FFFFFFF
    return (int(seed) * 1_000_003 + choice * 7919) & 0x3FFFFFFF
