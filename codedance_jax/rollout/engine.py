"""The multi-turn rollout engine: sample on device, run code in the sandbox, append observations.

    engine = RolloutEngine(model, processor, RolloutConfig.train(), SamplingConfig(temperature=1.0))
    trajectories, stats = engine.rollout(prompts, group_size=8, sandbox=pool)

Each prompt becomes `group_size` rows of one static batch (padded to a bucket) sharing one KV
cache. A row is in one phase: `decode` (sampling its current turn), `exec` (its code runs in its
own sandbox session, created with the prompt's images), `ready` (its observation is tokenized and
waits to be appended) or `done`.

The loop (overlap mode):
  1. rows whose cell finished get their observation built (text truncated, images resized and
     capped, tokenized alone: it starts with `<|im_end|>`);
  2. all `ready` rows are appended in ONE chunk: their images in one batched vision call, M-RoPE
     positions from each row's next position (tracked on the host), the other rows sitting out
     with mask 0; the logits of each appended row's last token seed its next turn;
  3. the `decode` rows run one `decode_chunk` (N steps); rows in `exec` sit out, so the device
     keeps decoding while code runs; a row that closes a code block submits it at once;
  4. with nothing to decode, the host blocks on the first finished cell (device idle time).
Sequential mode (`overlap=False`, the baseline): all rows decode until every running row ends
its turn, then all cells run, then all observations are appended, turn by turn.

Token in, token out: a trajectory's `tokens` are the prompt ids, then per turn the sampled ids
and the observation ids, exactly as written into the cache. When the host finds a stop string
that the device check missed (it ended inside a longer token), the turn is cut after the token
that completes it and the tokens sampled past it are removed from the cache (`drop_slots`), so
the cache always holds exactly `tokens`.

Failure handling: a sandbox error, timeout or crash (and an exception from the pool, or a missing
session) becomes an error observation and a failed turn; a malformed code block is answered with
an error observation without running anything; a trajectory that hits a budget ends with a
`finish_reason`; an exception while handling one row ends that row (`finish_reason="error"`,
message in `error`), never the batch.

Placement: `RolloutEngine(..., mesh=)` with a mesh whose `data` axis spans several devices splits
every array with a row dimension (cache, logits, chunk inputs) over `data`
(`sharding.row_sharding`); rows are independent, so the trajectories are those of the unsplit
batch. `rollout.batch_multiple` must then be a multiple of the data size (every row bucket is).

The last allowed turn's code is still executed (its status is part of the R_BAT signal) but
nothing is appended after it (`finish_reason="max_turns"`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from codedance_jax import sharding
from codedance_jax.errors import ConfigError
from codedance_jax.model import rope
from codedance_jax.model.generate import (
    broadcast_rows,
    compact_cache,
    drop_slots,
    encode_vision,
    extend_arrays,
    grow_cache,
    put_rows,
    scatter_logits,
    take_rows,
    vision_inputs,
)
from codedance_jax.protocol import get_turn_format
from codedance_jax.rollout import turns as turn_lib
from codedance_jax.rollout.buckets import CompileCounter, round_up, token_bucket, vision_bucket
from codedance_jax.rollout.config import RolloutConfig, RolloutStats
from codedance_jax.rollout.prompts import Prompt, session_files
from codedance_jax.rollout.record import Trajectory
from codedance_jax.rollout.sampler import Sampler, SamplingConfig, build_stop_table

Script = Callable[[int, int], "str | None"]  # (row, turn) -> text the policy is forced to write, or None


@dataclasses.dataclass
class _Row:
    traj: Trajectory
    uid: int
    session: Any = None
    session_future: Any = None  # the session being opened in the background (`_want_session`)
    session_error: str | None = None
    phase: str = "decode"  # decode | queued | exec | ready | done | pad
    turn: int = 0
    next_pos: int = 0
    sampled: int = 0
    turn_ids: list = dataclasses.field(default_factory=list)
    turn_lps: list = dataclasses.field(default_factory=list)
    turn_slots: list = dataclasses.field(default_factory=list)
    forced: list = dataclasses.field(default_factory=list)
    code: str | None = None
    future: Any = None
    submitted_at: float = 0.0
    obs: Any = None
    last_turn: bool = False
    slots_held: bool = True


class RolloutEngine:
    """Batched multi-turn rollouts of one policy (see the module docstring)."""

    def __init__(self, model, processor, cfg: RolloutConfig | None = None, sampling: SamplingConfig | None = None,
                 *, mesh: jax.sharding.Mesh | None = None):
        self.model, self.processor = model, processor
        self.cfg = cfg or RolloutConfig()
        # With a mesh whose `data` axis has several devices, every array with a row dimension (the KV
        # cache, logits, chunk inputs) is placed with its rows split over `data`; without one (or with
        # data = 1) arrays are left where jit puts them, as before.
        self.mesh = mesh if mesh is not None and mesh.shape.get("data", 1) > 1 else None
        if self.mesh is not None and self.cfg.batch_multiple % self.mesh.shape["data"]:
            raise ConfigError(
                f"rollout batch_multiple={self.cfg.batch_multiple} is not a multiple of the mesh's data axis "
                f"({self.mesh.shape['data']}): the batch's rows could not be split over it",
                "set rollout.batch_multiple to a multiple of mesh.data")
        self._cache_makers: dict = {}
        self.sampling = sampling or SamplingConfig()
        self.fmt = get_turn_format(self.cfg.turn_format)
        mcfg = model.cfg
        self.vocab_limit = min(len(processor.tokenizer), mcfg.text.vocab_size)
        stops = build_stop_table(processor.tokenizer, turn_lib.stop_strings(self.fmt), mcfg.text.vocab_size)
        # Vision placeholders are written by the host only; a sampled one would have no image.
        banned = (mcfg.image_token_id, mcfg.video_token_id, mcfg.vision_start_token_id, mcfg.vision_end_token_id)
        self.sampler = Sampler(model, stops, self.sampling, self.vocab_limit, self.cfg.decode_chunk, banned)
        self.hist_len = stops.history
        self.pad_id = processor.pad_id
        self._compiles = CompileCounter()

    # ------------------------------------------------------------------------------ public
    def set_model(self, model):
        """Roll out with `model` from now on (same structure: e.g. the policy after an update).
        Compiled functions are reused: the graph is static, only the parameter arrays change."""
        if model.cfg != self.model.cfg:
            raise ValueError("set_model: the new model's config differs from the engine's; build a new engine")
        self.model = model
        self.sampler.graphdef, self.sampler.state = nnx.split(model)

    def rollout(
        self,
        prompts: Sequence[Prompt],
        group_size: int = 1,
        sandbox=None,
        *,
        script: Script | None = None,
        seed_offset: int = 0,
    ) -> tuple[list[Trajectory], RolloutStats]:
        """Roll out every prompt `group_size` times. `sandbox`: a `SandboxPool` (or anything with
        `new_session(files=) -> session` whose `submit(code)` returns a Future[ExecResult]).
        `script(row, turn)`: text forced for that turn (scripted policies in tests; None = sample).
        Returns trajectories in row order (prompt-major, group members contiguous) and stats."""
        t0 = time.perf_counter()
        start_compiles = CompileCounter.total()
        self.stats = RolloutStats()
        self._cells: list[tuple[float, float | None]] = []
        rows = self._make_rows(prompts, group_size, seed_offset)
        b = round_up(len(rows), self.cfg.batch_multiple)
        self.rows = rows + [self._pad_row(i) for i in range(len(rows), b)]
        grow = self.cfg.cache_grow
        self.cache = self._init_cache(b, min(grow, self.cfg.cache_slots) if grow > 0 else self.cfg.cache_slots)
        self.index = 0
        self.logits = None
        self.script = script
        self._opener = None
        try:
            self._open_sessions(prompts, group_size, sandbox)
            self._prefill(prompts, group_size)
            self._loop()
        finally:
            if self._opener is not None:
                self._opener.shutdown(wait=False)  # queued opens still run; `_close_later` closes them
            for r in self.rows:
                if r.future is not None:
                    r.future.cancel()
                _close_later(r.session, r.session_future)
                r.session = r.session_future = None
        st = self.stats
        st.wall_s = time.perf_counter() - t0
        st.sandbox_busy_s = _union_length(self._cells, t0, t0 + st.wall_s)
        st.host_s = st.wall_s - (st.prefill_s + st.decode_s + st.append_s + st.vision_s + st.device_wait_s)
        st.trajectories = len(rows)
        st.generated_tokens = sum(int(np.sum(r.traj.loss_mask)) for r in rows)
        st.compiles = CompileCounter.total() - start_compiles
        st.row_shardings = self.row_shardings()
        return [r.traj for r in rows], st

    # ------------------------------------------------------------------------------ setup
    def _make_rows(self, prompts, group_size, seed_offset) -> list[_Row]:
        rows = []
        for p in prompts:
            for g in range(group_size):
                k = len(rows)
                traj = Trajectory(
                    id=f"{p.id}-{g}",
                    prompt_id=p.id,
                    group=g,
                    prompt_len=0,
                    tokens=[],
                    loss_mask=[],
                    turn_ids=[],
                    logprobs=[],
                    temperature=self.sampling.temperature,
                    images=list(p.images),
                    image_grid_thw=[],
                    turn_status=[],
                    turns=[],
                    policy=self.cfg.policy,
                )
                rows.append(_Row(traj=traj, uid=seed_offset + k))
        return rows

    def _pad_row(self, i) -> _Row:
        traj = Trajectory(
            id="",
            prompt_id="",
            group=0,
            prompt_len=0,
            tokens=[],
            loss_mask=[],
            turn_ids=[],
            logprobs=[],
            temperature=0.0,
            images=[],
            image_grid_thw=[],
            turn_status=[],
            turns=[],
        )
        return _Row(traj=traj, uid=0, phase="pad")

    def _prefill(self, prompts, group_size):
        """Prefill each prompt (and encode its images) once, then copy its cache row to its G group
        members: the members share the prompt, so the G-fold work bought nothing."""
        t0 = time.perf_counter()
        encoded = [self.processor(text=[p.text], images=p.images or None) for p in prompts]
        prompt_ids = [np.asarray(enc["input_ids"][0], np.int32) for enc in encoded]
        for r_i, r in enumerate(self.rows):
            if r.phase == "pad":
                continue
            enc, ids = encoded[r_i // group_size], prompt_ids[r_i // group_size]
            r.traj.tokens = ids.tolist()
            r.traj.prompt_len = len(ids)
            r.traj.loss_mask = [0] * len(ids)
            r.traj.turn_ids = [-1] * len(ids)
            r.traj.logprobs = [0.0] * len(ids)
            if "pixel_values" in enc:
                r.traj.image_grid_thw = np.asarray(enc["image_grid_thw"]).tolist()
        length = token_bucket(max(len(s) for s in prompt_ids), self.cfg.prompt_buckets, "a prompt")
        if length > self.cfg.max_total_tokens:
            raise ValueError(f"prompt bucket {length} > max_total_tokens {self.cfg.max_total_tokens}")
        n_src = round_up(len(prompts), self.cfg.batch_multiple)
        ids = np.full((n_src, length), self.pad_id, np.int32)
        mask = np.zeros_like(ids)
        for i, s in enumerate(prompt_ids):  # left padding: every row's last prompt token in the last column
            ids[i, length - len(s) :] = s
            mask[i, length - len(s) :] = 1
        pvs = [enc["pixel_values"] for enc in encoded if "pixel_values" in enc]
        grids = [enc["image_grid_thw"] for enc in encoded if "pixel_values" in enc]
        pv = np.concatenate(pvs) if pvs else None
        grid = np.concatenate(grids) if grids else None
        self.stats.prefill_s += time.perf_counter() - t0
        on = np.array([r.phase != "pad" for r in self.rows])
        src = np.array([i // group_size if on[i] else 0 for i in range(len(self.rows))], np.int32)
        self._write_chunk(ids, mask, pv, grid, on, start=np.zeros(n_src, np.int32), kind="prefill", src=src)
        for r in self.rows:
            if r.phase != "pad":
                self._start_turn(r)

    def _open_sessions(self, prompts, group_size, sandbox):
        """Get ready to give rows sandbox sessions; a row's session is opened when it first writes
        the tool-call tag (`_want_session`), on one background thread, in the order rows ask.

        A session costs ~30 ms of CPU to open and ~12 ms to close (three forks of the warm zygote
        and a namespace set-up; 64 took 1.96 + 0.74 CPU-s on 2 cores, measured). Opened for every
        row up front, rows that answer without code paid that too, on the cores XLA runs on. A
        code block spans several decode chunks, so an open started at the tag still overlaps the
        rest of the block's decoding; `_session(r)` waits for the row's own if it has not."""
        self._files = [session_files(p.images) for p in prompts]
        self._group_size = group_size
        self._sandbox = sandbox
        self._opener = None
        if sandbox is None:
            for r in self.rows:
                r.session_error = "no sandbox was given to the rollout"

    def _want_session(self, r: _Row):
        """Start opening the row's session in the background (once per row)."""
        if self._sandbox is None or r.session is not None or r.session_future is not None or r.phase == "pad":
            return
        if self._opener is None:
            self._opener = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout-sessions")
        files = self._files[self.rows.index(r) // self._group_size]
        r.session_future = self._opener.submit(self._sandbox.new_session, files=files)

    def _session(self, r: _Row):
        """The row's session (opening it now if it was never asked for, and waiting for it), or None
        with `session_error` set."""
        self._want_session(r)
        if r.session_future is not None:
            fut, r.session_future = r.session_future, None
            try:
                r.session = fut.result()
            except Exception as e:  # noqa: BLE001 - a row without a session answers code with a crash
                r.session_error = f"{type(e).__name__}: {e}"
        return r.session

    # ------------------------------------------------------------------------------ row placement
    def _rows(self, x, batch_dim: int = 0):
        """x with its rows (dimension `batch_dim`) on the mesh's data axis; unchanged without a mesh."""
        return x if self.mesh is None else sharding.place_rows(x, self.mesh, batch_dim)

    def _init_cache(self, b: int, slots: int, dtype=None):
        """A fresh cache of b rows, created already split over the data axis (never whole on one device)."""
        if self.mesh is None:
            return self.model.init_cache(b, slots, dtype)
        key = (b, slots, None if dtype is None else jnp.dtype(dtype).name)
        if key not in self._cache_makers:  # one compile per cache shape, as the other jitted steps
            make = lambda: self.model.init_cache(b, slots, dtype)  # noqa: E731 - reads only the model's config
            shard = jax.tree.map(lambda a: sharding.row_sharding(self.mesh, a.shape), jax.eval_shape(make))
            self._cache_makers[key] = jax.jit(make, out_shardings=shard)
        return self._cache_makers[key]()

    def row_shardings(self) -> dict[str, str] | None:
        """PartitionSpecs of the batch's device arrays (KV cache keys, validity, logits) as strings;
        None before the first rollout."""
        if getattr(self, "cache", None) is None:
            return None
        out = {"cache.k": self.cache.k[0].sharding, "cache.valid": self.cache.valid.sharding}
        if self.logits is not None:
            out["logits"] = self.logits.sharding
        return {k: str(getattr(v, "spec", v)) for k, v in out.items()}

    # ------------------------------------------------------------------------------ device calls
    def _ensure_room(self, n: int):
        if self.index + n <= self.cache.max_len:
            return
        grow, full = self.cfg.cache_grow, self.cfg.cache_slots
        if grow > 0 and self.cache.max_len < full:
            # Grow before compacting (a smaller cache makes every decode step cheaper until then);
            # a chunk that does not fit even the full size compacts the full-size cache below.
            self.cache = grow_cache(self.cache, min(full, round_up(self.index + n, grow)))
            self.stats.cache_growths += 1
            if self.index + n <= self.cache.max_len:
                return
        done = np.array([r.phase in ("done", "pad") and r.slots_held for r in self.rows])
        if done.any():
            self.cache = drop_slots(
                self.cache,
                self._rows(jnp.asarray(np.repeat(done[:, None], self.cache.max_len, 1))),
                self._rows(jnp.zeros(len(self.rows), jnp.int32)),
            )
            for r, d in zip(self.rows, done, strict=True):
                r.slots_held = r.slots_held and not d
        self.cache = compact_cache(self.cache)
        self.index = int(self.cache.index)
        self.stats.compactions += 1
        for r in self.rows:  # slot numbers of a running turn are stale after compaction
            r.turn_slots = []
        if self.index + n > self.cache.max_len:
            raise RuntimeError(f"the KV cache ({self.cache.max_len} slots) cannot hold the batch: raise cache_len")

    def _row_bucket(self, n: int) -> int:
        """Rows of a device call that runs n rows: batch_multiple x a power of two, at most the batch."""
        nb = self.cfg.batch_multiple
        while nb < n:
            nb *= 2
        return min(nb, len(self.rows))

    def _subset(self, on: np.ndarray) -> np.ndarray | None:
        """Row indices (the `on` rows first, in order, then others as padding) of a row bucket, or
        None when the bucket is the whole batch."""
        idx = np.nonzero(on)[0]
        nb = self._row_bucket(len(idx))
        if nb == len(self.rows):
            return None
        return np.concatenate([idx, np.nonzero(~on)[0][: nb - len(idx)]]).astype(np.int32)

    def _write_chunk(self, ids, mask, pv, grid, rows_b, start, kind, src=None):
        """Append a chunk (rows_b bool[B]: which rows take part); positions start at `start`.

        ids [B, C], or [n, C] for the taking-part rows only: with `src` int[B] (prefill) the n rows
        make a fresh cache and row b copies row src[b]; without it the n rows are those of
        `rows_b` (in order), padded to a row bucket, and only they run through the model.
        """
        cfg = self.model.cfg
        t0 = time.perf_counter()
        self._ensure_room(ids.shape[1])
        b = len(self.rows)
        sel = None
        if src is None and ids.shape[0] == b:
            sel = self._subset(rows_b)
            if sel is not None:  # placeholders keep their row-major order: taking-part rows come first, in order
                ids, mask, start = ids[sel], mask[sel], start[sel]
        pos, next_pos = rope.mrope_positions(
            ids,
            mask,
            grid,
            image_token_id=cfg.image_token_id,
            spatial_merge_size=cfg.vision.spatial_merge_size,
            start=start,
        )
        ids, mask, pos = self._rows(np.asarray(ids, np.int32)), self._rows(np.asarray(mask, np.int32)), self._rows(pos, 1)
        feats = None
        if pv is not None:
            tv = time.perf_counter()
            vis = vision_inputs(pv, grid, cfg, **vision_bucket(grid, cfg, self.cfg.vision_min_units))
            feats = jax.block_until_ready(encode_vision(self.model, vis))
            self.stats.vision_s += time.perf_counter() - tv
            t0 += time.perf_counter() - tv
        if src is not None:  # prefill once per prompt, then share the rows
            small = self._init_cache(ids.shape[0], self.cache.max_len, self.cache.k[0].dtype)
            logits, small = extend_arrays(self.model, small, ids, mask, pos, feats, last_only=True, fresh=True)
            self.cache, self.logits = broadcast_rows(small, logits, jnp.asarray(src), jnp.asarray(rows_b))
            rows_next = [(i, next_pos[src[i]]) for i in range(b) if rows_b[i]]
        elif sel is not None:
            sub = take_rows(self.cache, jnp.asarray(sel))
            logits, sub = extend_arrays(self.model, sub, ids, mask, pos, feats, last_only=True)
            self.cache = put_rows(self.cache, sub, jnp.asarray(sel), jnp.int32(self.index), ids.shape[1])
            on_n = rows_b[sel]
            self.logits = scatter_logits(self.logits, logits, jnp.asarray(sel), jnp.asarray(on_n))
            rows_next = [(int(i), next_pos[j]) for j, i in enumerate(sel) if on_n[j]]
        else:
            logits, self.cache = extend_arrays(self.model, self.cache, ids, mask, pos, feats, last_only=True)
            self.logits = logits if self.logits is None else _merge_rows(jnp.asarray(rows_b), logits, self.logits)
            rows_next = [(i, next_pos[i]) for i in range(b) if rows_b[i]]
        jax.block_until_ready(self.logits)
        self.index += ids.shape[1]
        for i, nxt in rows_next:
            self.rows[i].next_pos = int(nxt)
        dt = time.perf_counter() - t0
        if kind == "prefill":
            self.stats.prefill_s += dt
        else:
            self.stats.append_s += dt
            self.stats.appends += 1

    # ------------------------------------------------------------------------------ the loop
    def _loop(self):
        overlap = self.cfg.overlap
        while True:
            self._collect(block=False)
            decoding = [r for r in self.rows if r.phase == "decode"]
            waiting = [r for r in self.rows if r.phase in ("exec", "queued")]
            ready = [r for r in self.rows if r.phase == "ready"]
            if not overlap and not decoding:
                queued = [r for r in self.rows if r.phase == "queued"]
                for r in queued:
                    self._submit(r)
                if waiting:
                    self._wait(all_of=True)
                    continue
            if ready and (overlap or not waiting):
                if not decoding or len(ready) >= self.cfg.append_min_frac * (len(ready) + len(waiting)):
                    self._append(ready)
                    continue
            if decoding:
                self._decode()
                continue
            if waiting:
                self._wait(all_of=False)
                continue
            break

    def _decode(self):
        c = self.cfg
        n = c.decode_chunk
        self._ensure_room(n)
        b = len(self.rows)
        active = np.array([r.phase == "decode" for r in self.rows])
        limit = np.zeros(b, np.int32)
        hist = np.full((b, self.hist_len), -1, np.int32)
        forced = np.full((b, n), -1, np.int32)
        uid = np.array([r.uid for r in self.rows], np.int32)
        count = np.array([r.sampled for r in self.rows], np.int32)
        for i, r in enumerate(self.rows):
            if not active[i]:
                continue
            limit[i] = self._limit(r)
            if limit[i] == 0:  # a budget ran out exactly at the end of the last observation
                active[i] = False
                self._finish(r, "new_tokens" if r.sampled >= c.max_new_tokens else "length")
                continue
            h = r.turn_ids[-self.hist_len :]
            if h:
                hist[i, self.hist_len - len(h) :] = h
            f = r.forced[:n]
            forced[i, : len(f)] = f
        t0 = time.perf_counter()
        sel = self._subset(active)
        if sel is None:
            out, self.cache, self.logits = self.sampler.decode_chunk(
                self.cache, self.logits, *map(self._rows, (active, limit, hist, forced, uid, count)), start=self.index
            )
        else:  # only the decoding rows (in a row bucket) run; rows in the sandbox or done sit out
            jsel = jnp.asarray(sel)
            sub, sub_logits = take_rows(self.cache, jsel), self.logits[jsel]
            args = map(self._rows, (active[sel], limit[sel], hist[sel], forced[sel], uid[sel], count[sel]))
            out, sub, sub_logits = self.sampler.decode_chunk(sub, sub_logits, *args, start=self.index)
            self.cache = put_rows(self.cache, sub, jsel, jnp.int32(self.index), n)
            self.logits = scatter_logits(self.logits, sub_logits, jsel, jnp.asarray(active[sel]))
            out = out.expand(sel, b)
        self.stats.decode_s += time.perf_counter() - t0
        self.stats.decode_steps += out.steps
        self.stats.decode_chunks += 1
        self.index = out.start + out.steps
        for i, r in enumerate(self.rows):
            if not active[i]:
                continue
            try:
                self._take_tokens(r, out, i)
            except Exception as e:  # noqa: BLE001 - one row's failure must not stop the batch
                self._fail(r, e)

    def _limit(self, r: _Row) -> int:
        c = self.cfg
        seq = len(r.traj.tokens) + len(r.turn_ids)
        return max(0, min(c.max_turn_tokens - len(r.turn_ids), c.max_new_tokens - r.sampled, c.max_total_tokens - seq))

    def _take_tokens(self, r: _Row, out, i):
        em = out.emitted[i]
        steps = np.nonzero(em)[0]
        toks = out.tokens[i, em]
        r.turn_ids += toks.tolist()
        r.turn_lps += out.logprobs[i, em].tolist()
        r.turn_slots += (out.start + steps).tolist()
        r.sampled += len(toks)
        r.next_pos += len(toks)
        del r.forced[: len(toks)]
        text = self.processor.decode(r.turn_ids)
        if self.fmt.call_open in text:
            self._want_session(r)
        stop = turn_lib.find_stop(text, self.fmt)
        if stop is None and out.active[i]:
            return
        if stop is not None and stop[1] in self.processor.decode(r.turn_ids[:-1]):
            # The stop string was complete before the last token: the device missed its form.
            self._cut_after_stop(r, stop[1])
            text = self.processor.decode(r.turn_ids)
        self._end_turn(r, text, stop[1] if stop else None)

    def _cut_after_stop(self, r: _Row, stop: str):
        """Keep the shortest prefix of the turn whose text holds `stop`; drop the rest from the cache."""
        lo, hi = 1, len(r.turn_ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if stop in self.processor.decode(r.turn_ids[:mid]):
                hi = mid
            else:
                lo = mid + 1
        drop = len(r.turn_ids) - lo
        if drop == 0:
            return
        # The dropped tokens all come from the last chunk (stops are checked after every chunk),
        # whose slots are known even if a compaction reset the older ones.
        slots = r.turn_slots[-drop:]
        if len(slots) != drop:
            raise RuntimeError("cannot roll back tokens sampled past a stop string: their cache slots are unknown")
        mask = np.zeros((len(self.rows), self.cache.max_len), bool)
        rewind = np.zeros(len(self.rows), np.int32)
        row = self.rows.index(r)
        mask[row, slots] = True
        rewind[row] = drop
        self.cache = drop_slots(self.cache, self._rows(mask), self._rows(rewind))
        del r.turn_ids[lo:], r.turn_lps[lo:], r.turn_slots[lo:]
        r.sampled -= drop
        r.next_pos -= drop
        self.stats.rollbacks += 1

    def _start_turn(self, r: _Row):
        r.phase = "decode"
        r.turn_ids, r.turn_lps, r.turn_slots = [], [], []
        r.forced = []
        if self.script is not None:
            text = self.script(self.rows.index(r), r.turn)
            if text:
                r.forced = list(self.processor.tokenizer.encode(text))

    def _commit_turn(self, r: _Row):
        t = r.traj
        t.tokens += r.turn_ids
        t.loss_mask += [1] * len(r.turn_ids)
        t.turn_ids += [r.turn] * len(r.turn_ids)
        t.logprobs += r.turn_lps

    def _end_turn(self, r: _Row, text: str, stop: str | None):
        self._commit_turn(r)
        t = r.traj
        t.turns.append({"status": None, "observation": "", "n_images": 0, "code": None, "stop": stop})
        if stop == self.fmt.call_close:
            t.num_tool_calls += 1
            r.last_turn = r.turn + 1 >= self.cfg.max_turns
            block = turn_lib.extract_code(text, self.fmt)
            t.turns[-1]["code"] = block.code
            if block.code is None:
                self._observe(r, "error", "", f"Error: malformed code block: {block.error}.", [])
            elif self._session(r) is None:
                self._observe(r, "crashed", "", f"Error: the sandbox session is unavailable ({r.session_error}).", [])
            else:
                r.code = block.code
                r.phase = "queued"
                if self.cfg.overlap:
                    self._submit(r)
            return
        t.turn_status.append("no_code")
        t.turns[-1]["status"] = "no_code"
        if stop == turn_lib.ANSWER_CLOSE:
            t.answer = turn_lib.extract_answer(text)
            self._finish(r, "answer")
        elif stop is not None:
            self._finish(r, "stop")
        elif len(r.turn_ids) >= self.cfg.max_turn_tokens:
            self._finish(r, "turn_tokens")
        elif r.sampled >= self.cfg.max_new_tokens:
            self._finish(r, "new_tokens")
        else:
            self._finish(r, "length")

    def _submit(self, r: _Row):
        try:
            r.future = r.session.submit(r.code)
        except Exception as e:  # noqa: BLE001 - e.g. the session died: a crashed turn
            self._observe(r, "crashed", "", f"Error: the sandbox refused the cell ({type(e).__name__}: {e}).", [])
            return
        r.phase = "exec"
        r.submitted_at = time.perf_counter()
        cell = [r.submitted_at, None]
        self._cells.append(cell)
        r.future.add_done_callback(lambda _f, cell=cell: cell.__setitem__(1, time.perf_counter()))
        self.stats.executions += 1

    def _wait(self, all_of: bool):
        futs = [r.future for r in self.rows if r.phase == "exec"]
        t0 = time.perf_counter()
        if futs:
            timeout = None
            if self.cfg.exec_deadline_s is not None:
                oldest = min(r.submitted_at for r in self.rows if r.phase == "exec")
                timeout = max(0.0, oldest + self.cfg.exec_deadline_s - t0)
            concurrent.futures.wait(
                futs,
                timeout=timeout,
                return_when=concurrent.futures.ALL_COMPLETED if all_of else concurrent.futures.FIRST_COMPLETED,
            )
        self.stats.device_wait_s += time.perf_counter() - t0
        self._collect(block=False)

    def _collect(self, block: bool):
        now = time.perf_counter()
        for r in self.rows:
            if r.phase != "exec":
                continue
            late = self.cfg.exec_deadline_s is not None and now - r.submitted_at > self.cfg.exec_deadline_s
            if not (r.future.done() or late):
                continue
            r.traj.timings["sandbox_wait_s"] = r.traj.timings.get("sandbox_wait_s", 0.0) + now - r.submitted_at
            fut, r.future = r.future, None
            try:
                if not fut.done():
                    fut.cancel()
                    self._observe(r, "timeout", "", f"[engine] no result after {self.cfg.exec_deadline_s} s", [])
                    continue
                try:
                    res = fut.result()
                except Exception as e:  # noqa: BLE001 - the pool failed this cell: a crash, as SPEC says
                    self._observe(r, "crashed", "", f"[sandbox] {type(e).__name__}: {e}", [])
                    continue
                self._observe(r, res.status, res.stdout, res.stderr, list(res.images))
                r.traj.num_executions += 1
            except Exception as e:  # noqa: BLE001
                self._fail(r, e)

    def _observe(self, r: _Row, status: str, stdout: str, stderr: str, pngs: list[bytes]):
        """Record the turn's execution status and build its observation (or end the trajectory)."""
        c = self.cfg
        t = r.traj
        t.turn_status.append(status)
        obs = turn_lib.build_observation(
            self.processor,
            self.fmt,
            status,
            stdout,
            stderr,
            pngs,
            max_chars=c.obs_max_chars,
            max_images=c.obs_max_images,
            max_pixels=c.obs_max_pixels,
            max_tokens=c.max_obs_tokens,
        )
        t.turns[-1].update(status=status, observation=obs.text, n_images=len(obs.images))
        if r.last_turn:
            self._finish(r, "max_turns")
        elif len(t.tokens) + len(obs.ids) >= c.max_total_tokens:
            self._finish(r, "length")
        else:
            r.obs = obs
            r.phase = "ready"

    def _append(self, ready: list[_Row]):
        b = len(self.rows)
        length = token_bucket(max(len(r.obs.ids) for r in ready), self.cfg.obs_buckets, "an observation")
        ids = np.full((b, length), self.pad_id, np.int32)
        mask = np.zeros((b, length), np.int32)
        on = np.zeros(b, bool)
        pvs, grids = [], []
        for i, r in enumerate(self.rows):
            if r.phase != "ready":
                continue
            n = len(r.obs.ids)
            ids[i, :n] = r.obs.ids
            mask[i, :n] = 1
            on[i] = True
            if r.obs.images:
                pvs.append(r.obs.pixel_values)
                grids.append(r.obs.grid_thw)
        start = np.array([r.next_pos for r in self.rows], np.int32)
        pv = np.concatenate(pvs) if pvs else None
        grid = np.concatenate(grids) if grids else None
        self._write_chunk(ids, mask, pv, grid, on, start, kind="append")
        for i, r in enumerate(self.rows):
            if not on[i]:
                continue
            t, obs = r.traj, r.obs
            n = len(obs.ids)
            t.tokens += obs.ids.tolist()
            t.loss_mask += [0] * n
            t.turn_ids += [-1] * n
            t.logprobs += [0.0] * n
            t.images += obs.images
            if obs.grid_thw is not None:
                t.image_grid_thw += np.asarray(obs.grid_thw).tolist()
            r.obs = None
            r.turn += 1
            self._start_turn(r)

    def _finish(self, r: _Row, reason: str):
        r.phase = "done"
        r.traj.finish_reason = reason

    def _fail(self, r: _Row, e: BaseException):
        r.traj.error = "".join(traceback.format_exception_only(type(e), e)).strip()
        if r.future is not None:
            r.future.cancel()
            r.future = None
        self._finish(r, "error")


_CLOSER: concurrent.futures.ThreadPoolExecutor | None = None


def _close_quietly(session) -> None:
    try:
        session.close()
    except Exception:  # noqa: BLE001 - closing is best effort; the pool cleans up what is left
        pass


def _close_later(session, opening) -> None:
    """Close a rollout's session off the caller's thread: a close waits until the session's
    processes are gone (~18 ms each, 64 took 1.15 s one after another, 0.72 s on 4 threads), which
    the next stage (scoring, the update) need not wait for. `opening`: a session still being
    opened; it is cancelled, or closed once it opens."""
    global _CLOSER
    if session is None and opening is None:
        return
    if _CLOSER is None:
        _CLOSER = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="rollout-close")
    if session is not None:
        _CLOSER.submit(_close_quietly, session)
    if opening is not None and not opening.cancel():
        opening.add_done_callback(lambda f: f.exception() is None and _CLOSER.submit(_close_quietly, f.result()))


@jax.jit
def _merge_rows(rows_b, new_bv, old_bv):
    return jnp.where(rows_b[:, None], new_bv, old_bv)


def _union_length(intervals, t0: float, t1: float) -> float:
    """Total length of the union of [start, end) intervals (open ends run to t1)."""
    spans = sorted((s, t1 if e is None else e) for s, e in intervals)
    total, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        s, e = max(s, t0), min(e, t1)
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total
