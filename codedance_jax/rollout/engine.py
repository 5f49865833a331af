"""The multi-turn rollout engine: sample on device, run code in the sandbox, append observations.

    engine = RolloutEngine(model, processor, RolloutConfig.train(), SamplingConfig(temperature=1.0))
    trajectories, stats = engine.rollout(prompts, group_size=8, sandbox=pool)

Each prompt becomes `group_size` rows of one static batch (padded to a bucket) sharing one KV
cache (`device_batch.DeviceBatch`). A row is in one `rows.Phase`: DECODE (sampling its current
turn), EXEC (its code runs in its own sandbox session, created with the prompt's images:
`sandbox_turns.py`), READY (its observation is tokenized and waits to be appended) or DONE.
Everything one call holds (rows, device batch, sandbox side, stats) is a `RolloutState` that
`rollout()` creates and passes to its steps; the engine keeps only what lives across calls.

The loop (overlap mode):
  1. rows whose cell finished get their observation built (text truncated, images resized and
     capped, tokenized alone: it starts with `<|im_end|>`);
  2. all READY rows are appended in ONE chunk: their images in one batched vision call, M-RoPE
     positions from each row's next position (tracked on the host), the other rows sitting out
     with mask 0; the logits of each appended row's last token seed its next turn;
  3. the DECODE rows run one `decode_chunk` (N steps); rows in EXEC sit out, so the device
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
(`device_batch.RowPlacement`); rows are independent, so the trajectories are those of the unsplit
batch. `rollout.batch_multiple` must then be a multiple of the data size (every row bucket is).
With a `tensor` axis the KV cache is split by KV heads over it as well, beside the policy's
weights that `placement.sampling_params` split over it; GSPMD partitions the jitted steps. The
GRPO loop's engine runs on a host's sampling mesh (`placement.py`). Each call records its
placement in its stats: `sampling_devices` (the devices its cache and parameters lived on) and
`sampling_mesh` (the mesh's {axis: size}).

The last allowed turn's code is still executed (its status is part of the R_BAT signal) but
nothing is appended after it (`finish_reason="max_turns"`).

Recorded for downstream use, so nothing is recomputed: each assistant turn's decoded text
(`turns[m]["text"]`, the decode of exactly its sampled ids) and each image's processed vision
input (`Trajectory.vision`, in memory only).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx

from codedance_jax.errors import ConfigError
from codedance_jax.model import rope
from codedance_jax.model.generate import encode_into_jit, encode_vision, vision_inputs, zeros_features
from codedance_jax.protocol import get_turn_format
from codedance_jax.rollout import turns as turn_lib
from codedance_jax.rollout.buckets import CompileCounter, round_up, token_bucket, vision_bucket
from codedance_jax.rollout.config import RolloutConfig, RolloutStats
from codedance_jax.rollout.device_batch import DeviceBatch, RowPlacement, row_subset
from codedance_jax.rollout.placement import placement_record
from codedance_jax.rollout.prompts import Prompt, session_files
from codedance_jax.rollout.record import Trajectory, split_vision
from codedance_jax.rollout.rows import Phase, Row, pad_row, trajectory_rows
from codedance_jax.rollout.sampler import Sampler, SamplingConfig, build_stop_table
from codedance_jax.rollout.sandbox_turns import SandboxTurns
from codedance_jax.rollout.shapes import RolloutPlan, grid_needs, rollout_plan

Script = Callable[[int, int], "str | None"]  # (row, turn) -> text the policy is forced to write, or None


@dataclasses.dataclass
class RolloutState:
    """Everything one `rollout()` call holds: created by the call, passed to its steps, dropped at its
    end (but for its device batch, kept as `RolloutEngine.last_batch` until the next call)."""

    rows: list[Row]  # B rows: the trajectories (prompt-major, group members contiguous), then padding
    batch: DeviceBatch  # their KV cache, next-token logits and write index
    host: SandboxTurns  # their sandbox sessions and running cells
    stats: RolloutStats
    script: Script | None = None


@dataclasses.dataclass(frozen=True)
class _Released:
    """The engine's policy after `RolloutEngine.release`: its config only, no arrays."""

    cfg: object


class RolloutEngine:
    """Batched multi-turn rollouts of one policy (see the module docstring)."""

    def __init__(self, model, processor, cfg: RolloutConfig | None = None, sampling: SamplingConfig | None = None,
                 *, mesh: jax.sharding.Mesh | None = None):
        self.model, self.processor = model, processor
        self.cfg = cfg or RolloutConfig()
        # With a mesh whose `data` axis has several devices, every array with a row dimension (the KV
        # cache, logits, chunk inputs) is placed with its rows split over `data`, and with a `tensor`
        # axis the cache's KV heads over it; without one (or with data = tensor = 1) arrays are left
        # where jit puts them, as before.
        self.placement = RowPlacement(mesh)
        self.mesh = self.placement.mesh
        self.given_mesh = mesh  # recorded in the stats (`sampling_mesh`), data = 1 included
        if self.mesh is not None and self.cfg.batch_multiple % self.mesh.shape["data"]:
            raise ConfigError(
                f"rollout batch_multiple={self.cfg.batch_multiple} is not a multiple of the mesh's data axis "
                f"({self.mesh.shape['data']}): the batch's rows could not be split over it",
                f"set rollout.batch_multiple to a multiple of {self.mesh.shape['data']}, or the sampling mesh's "
                "data size (rollout.mesh_data) to a divisor of it")
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
        # The device batch of the latest call, kept for inspection (its shardings) until the next
        # call starts; nothing reads it during a call.
        self.last_batch: DeviceBatch | None = None
        # The shape plan of the last `warm_up` (None before): later calls with fewer rows or prompts
        # are padded to it, so they run the programs it compiled.
        self.plan: RolloutPlan | None = None

    @property
    def cache(self):
        """The latest call's KV cache (`last_batch.cache`), for inspection; None before the first."""
        return None if self.last_batch is None else self.last_batch.cache

    @property
    def logits(self):
        """The latest call's next-token logits (`last_batch.logits`), for inspection."""
        return None if self.last_batch is None else self.last_batch.logits

    # ------------------------------------------------------------------------------ public
    def set_model(self, model):
        """Roll out with `model` from now on (same structure: e.g. the policy after an update).
        Compiled functions are reused: the graph is static, only the parameter arrays change."""
        if model.cfg != self.model.cfg:
            raise ValueError("set_model: the new model's config differs from the engine's; build a new engine")
        self.model = model
        self.sampler.graphdef, self.sampler.state = nnx.split(model)

    def release(self) -> None:
        """Drop the device arrays the engine holds between calls: the last call's batch (KV cache and
        logits) and its policy's parameters, so that the update, and the next step's placement of
        the weights, have the chips' memory (the 7B on v5p-64 at tensor 4: 31.5 GiB of cache and
        3.9 GiB of weights per chip). `set_model` must come before the next call."""
        self.last_batch = None
        self.model = _Released(self.model.cfg)
        self.sampler.state = None

    def _check_model(self) -> None:
        if isinstance(self.model, _Released):
            raise RuntimeError("RolloutEngine: the policy was released (`release`); call set_model before rolling out")

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
        self._check_model()
        t0 = time.perf_counter()
        start_compiles = CompileCounter.total()
        self.last_batch = None  # the previous call's cache is freed before this one's is made
        stats = RolloutStats()
        rows = trajectory_rows(prompts, group_size, seed_offset, self.sampling.temperature, self.cfg.policy)
        b = round_up(len(rows), self.cfg.batch_multiple)
        if self.plan_holds(len(prompts), group_size):
            b = self.plan.rows  # the warmed-up shapes (padding rows sit out)
        grow = self.cfg.cache_grow
        slots = min(grow, self.cfg.cache_slots) if grow > 0 else self.cfg.cache_slots
        st = RolloutState(
            rows=rows + [pad_row(i) for i in range(len(rows), b)],
            batch=DeviceBatch(self.placement.init_cache(self.model, b, slots), placement=self.placement),
            host=SandboxTurns(self.cfg, self.processor, self.fmt, stats, sandbox,
                              [session_files(p.images) for p in prompts]),
            stats=stats,
            script=script,
        )
        try:
            st.host.start(st.rows)
            self._prefill(st, prompts)
            self._loop(st)
        finally:
            st.host.close(st.rows)
        stats.wall_s = time.perf_counter() - t0
        stats.sandbox_busy_s = st.host.busy_s(t0, t0 + stats.wall_s)
        stats.host_s = stats.wall_s - (
            stats.prefill_s + stats.decode_s + stats.append_s + stats.vision_s + stats.device_wait_s)
        stats.trajectories = len(rows)
        stats.generated_tokens = sum(int(np.sum(r.traj.loss_mask)) for r in rows)
        stats.compiles = CompileCounter.total() - start_compiles
        stats.row_shardings = st.batch.shardings()
        for k, v in placement_record(self.given_mesh, (st.batch.cache, self.sampler.state)).items():
            setattr(stats, k, v)
        self.last_batch = st.batch
        return [r.traj for r in rows], stats

    def shape_plan(self, prompts: int, group_size: int = 1) -> RolloutPlan:
        """The shapes a call of `prompts` x `group_size` rows can use (`shapes.rollout_plan`)."""
        image = self.processor.image_config
        return rollout_plan(self.cfg, self.model.cfg, rows=prompts * group_size, prompts=prompts,
                            prompt_max_pixels=image.max_pixels, min_pixels=image.min_pixels,
                            processor_max_pixels=image.max_pixels)

    def plan_holds(self, prompts: int, group_size: int = 1) -> bool:
        """Whether the warmed-up plan runs calls of `prompts` x `group_size` rows (padded to it)."""
        p = self.plan
        return p is not None and round_up(prompts * group_size, self.cfg.batch_multiple) <= p.rows and prompts <= p.prompt_rows

    def warm_up(self, prompts: int, group_size: int = 1) -> dict:
        """Compile every program of the shape plan for calls of up to `prompts` x `group_size` rows by
        running each once on dummy inputs (the same code paths as a rollout, so the jit caches hold
        exactly what the calls will look up). Later calls with fewer rows are padded to the plan.
        Returns {"programs", "compilations", "seconds"}."""
        self._check_model()
        t0, c0 = time.perf_counter(), CompileCounter.total()
        plan = self.plan = self.shape_plan(prompts, group_size)
        cfg, b, m = self.model.cfg, plan.rows, self.cfg.batch_multiple
        q, pd = cfg.vision.merge_unit, cfg.vision.patch_dim
        # Tiny images stand in for any: the vision calls' shape is the plan's, not the image's. Two
        # of them where the call has room: the first call into a chunk's buffer takes a fresh one,
        # the next ones the previous call's output (laid out by the model's mesh), two programs.
        m2 = cfg.vision.spatial_merge_size

        def chunk(batch, n, length, kind, img, src=None, sel=None, rows_b=None):
            ids = np.full((n, length), self.pad_id, np.int32)
            mask = np.zeros_like(ids)
            pos = np.zeros((3, n, length), np.int32)
            k = 2 if plan.vision(kind, n)[0] >= 2 * (plan.prompt_image if kind == "prefill" else plan.obs_image)[0] else 1
            grid, pv = np.tile([[1, m2, m2]], (k, 1)), np.zeros((k * q, pd), np.float32)
            feats = self._encode(kind, n, b, pv, grid) if img else None
            batch.index = 0  # dummy writes: nothing is read back
            self._device_chunk(batch, ids, mask, pos, feats, rows_b, src, sel)

        batch = DeviceBatch(self.placement.init_cache(self.model, b, plan.cache_sizes[0]), placement=self.placement)
        on = np.ones(b, bool)
        for length in plan.prompt_buckets:
            for img in (False, True):
                chunk(batch, plan.prompt_rows, length, "prefill", img, src=np.zeros(b, np.int32), rows_b=on)
        sizes = list(plan.cache_sizes)
        for k, size in enumerate(sizes):
            if k:  # every growth that can reach this size (the batch continues at the largest source)
                for a in sizes[:k]:
                    grown = DeviceBatch(self.placement.init_cache(self.model, b, a), batch.logits, 0, self.placement)
                    grown.grow(size)
                batch = grown
            for nb in plan.row_buckets:
                rows_b = np.arange(b) < nb
                sel = row_subset(rows_b, m)
                for length in plan.obs_buckets:
                    for img in (False, True):
                        chunk(batch, nb, length, "append", img, sel=sel, rows_b=rows_b)
                batch.index = 0
                z = np.zeros(b, np.int32)
                batch.decode(self.sampler, rows_b, z, np.full((b, self.hist_len), -1, np.int32),
                             np.full((b, self.cfg.decode_chunk), -1, np.int32), z, z, multiple=m)
            batch.drop(np.zeros((b, size), bool), np.zeros(b, np.int32))
            batch.compact(np.ones(b, bool))
        jax.block_until_ready(batch.cache)
        return {"programs": len(plan.programs()), "compilations": CompileCounter.total() - c0,
                "seconds": time.perf_counter() - t0}

    # ------------------------------------------------------------------------------ setup
    def _prefill(self, st: RolloutState, prompts):
        """Prefill each prompt (and encode its images) once, then copy its cache row to its G group
        members: the members share the prompt, so the G-fold work bought nothing."""
        t0 = time.perf_counter()
        encoded = [self.processor(text=[p.text], images=p.images or None) for p in prompts]
        prompt_ids = [np.asarray(enc["input_ids"][0], np.int32) for enc in encoded]
        vision = [split_vision(enc["pixel_values"], enc["image_grid_thw"]) if "pixel_values" in enc else []
                  for enc in encoded]
        for r in st.rows:
            if r.phase is Phase.PAD:
                continue
            enc, ids = encoded[r.prompt], prompt_ids[r.prompt]
            r.traj.tokens = ids.tolist()
            r.traj.prompt_len = len(ids)
            r.traj.loss_mask = [0] * len(ids)
            r.traj.turn_ids = [-1] * len(ids)
            r.traj.logprobs = [0.0] * len(ids)
            r.traj.vision = list(vision[r.prompt])  # the group shares the arrays (read-only)
            if "pixel_values" in enc:
                r.traj.image_grid_thw = np.asarray(enc["image_grid_thw"]).tolist()
        length = token_bucket(max(len(s) for s in prompt_ids), self.cfg.prompt_buckets, "a prompt")
        if length > self.cfg.max_total_tokens:
            raise ValueError(f"prompt bucket {length} > max_total_tokens {self.cfg.max_total_tokens}")
        n_src = round_up(len(prompts), self.cfg.batch_multiple)
        if self.plan is not None and len(prompts) <= self.plan.prompt_rows:
            n_src = self.plan.prompt_rows
        ids = np.full((n_src, length), self.pad_id, np.int32)
        mask = np.zeros_like(ids)
        for i, s in enumerate(prompt_ids):  # left padding: every row's last prompt token in the last column
            ids[i, length - len(s) :] = s
            mask[i, length - len(s) :] = 1
        pvs = [enc["pixel_values"] for enc in encoded if "pixel_values" in enc]
        grids = [enc["image_grid_thw"] for enc in encoded if "pixel_values" in enc]
        pv = np.concatenate(pvs) if pvs else None
        grid = np.concatenate(grids) if grids else None
        st.stats.prefill_s += time.perf_counter() - t0
        on = np.array([r.phase is not Phase.PAD for r in st.rows])
        src = np.array([r.prompt if on[i] else 0 for i, r in enumerate(st.rows)], np.int32)
        self._write_chunk(st, ids, mask, pv, grid, on, start=np.zeros(n_src, np.int32), kind="prefill", src=src)
        for r in st.rows:
            if r.phase is not Phase.PAD:
                self._start_turn(st, r)

    # ------------------------------------------------------------------------------ device calls
    def _ensure_room(self, st: RolloutState, n: int):
        """Make room for a chunk of n slots: grow the cache (`cache_grow`), else drop finished rows'
        slots and compact."""
        batch = st.batch
        if batch.fits(n):
            return
        grow, full = self.cfg.cache_grow, self.cfg.cache_slots
        if grow > 0 and batch.cache.max_len < full:
            # Grow before compacting (a smaller cache makes every decode step cheaper until then);
            # a chunk that does not fit even the full size compacts the full-size cache below.
            batch.grow(min(full, round_up(batch.index + n, grow)))
            st.stats.cache_growths += 1
            if batch.fits(n):
                return
        done = np.array([r.phase in (Phase.DONE, Phase.PAD) and r.slots_held for r in st.rows])
        batch.compact(done)
        for r, d in zip(st.rows, done, strict=True):
            r.slots_held = r.slots_held and not d
        st.stats.compactions += 1
        for r in st.rows:  # slot numbers of a running turn are stale after compaction
            r.turn_slots = []
        if not batch.fits(n):
            raise RuntimeError(f"the KV cache ({batch.cache.max_len} slots) cannot hold the batch: raise cache_len")

    def _write_chunk(self, st: RolloutState, ids, mask, pv, grid, rows_b, start, kind, src=None):
        """Append a chunk (rows_b bool[B]: which rows take part); positions start at `start`.

        ids [B, C], or [n, C] for the taking-part rows only: with `src` int[B] (prefill) the n rows
        make a fresh cache and row b copies row src[b]; without it the n rows are those of
        `rows_b` (in order), padded to a row bucket, and only they run through the model.
        """
        cfg = self.model.cfg
        t0 = time.perf_counter()
        self._ensure_room(st, ids.shape[1])
        b = len(st.rows)
        sel = None
        if src is None and ids.shape[0] == b:
            sel = row_subset(rows_b, self.cfg.batch_multiple)
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
        tv = time.perf_counter()
        feats = self._encode(kind, ids.shape[0], b, pv, grid)
        st.stats.vision_s += time.perf_counter() - tv
        t0 += time.perf_counter() - tv
        self._device_chunk(st.batch, ids, mask, pos, feats, rows_b, src, sel)
        if src is not None:
            rows_next = [(i, next_pos[src[i]]) for i in range(b) if rows_b[i]]
        elif sel is not None:
            rows_next = [(int(i), next_pos[j]) for j, i in enumerate(sel) if rows_b[i]]
        else:
            rows_next = [(i, next_pos[i]) for i in range(b) if rows_b[i]]
        for i, nxt in rows_next:
            st.rows[i].next_pos = int(nxt)
        dt = time.perf_counter() - t0
        if kind == "prefill":
            st.stats.prefill_s += dt
        else:
            st.stats.append_s += dt
            st.stats.appends += 1

    def _encode(self, kind: str, rows: int, batch: int, pv, grid):
        """Image features of a chunk of `rows` rows (None without images), in the plan's vision shape
        for (kind, rows) when the images fit it, else in a power-of-two bucket (outside the plan)."""
        if pv is None:
            return None
        cfg = self.model.cfg
        plan = self._plan_for(batch)
        if plan is not None:
            units, _ = plan.vision(kind, rows)
            u1, w1 = plan.prompt_image if kind == "prefill" else plan.obs_image
            grids = np.asarray(grid).reshape(-1, 3)
            needs = [grid_needs(g[None], cfg.vision) for g in grids]
            if sum(u for u, _ in needs) <= units and all(u <= u1 and w <= w1 for u, w in needs):
                # One call per image into one buffer, each in the plan's one-image shape (room for
                # the last image's padding past the plan's units).
                feats = zeros_features(units + u1, cfg.text.hidden_size, cfg.compute_dtype)
                off = p = 0
                for g, (u, _) in zip(grids, needs, strict=True):
                    n = int(np.prod(g))
                    vis = vision_inputs(pv[p : p + n], g[None], cfg, num_windows=w1, num_units=u1)
                    feats = encode_into_jit(self.model, feats, vis, np.int32(off))
                    off, p = off + u, p + n
                return jax.block_until_ready(feats)
        shape = vision_bucket(grid, cfg, self.cfg.vision_min_units)  # outside the plan: a power-of-two bucket
        return jax.block_until_ready(encode_vision(self.model, vision_inputs(pv, grid, cfg, **shape)))

    def _plan_for(self, batch: int) -> RolloutPlan | None:
        return self.plan if self.plan is not None and self.plan.rows == batch else None

    def _device_chunk(self, batch: DeviceBatch, ids, mask, pos, feats, rows_b, src, sel) -> None:
        """The chunk's device calls (see `_write_chunk`): host arrays placed, then a prefill or an extend."""
        place = self.placement.rows
        ids, mask, pos = place(np.asarray(ids, np.int32)), place(np.asarray(mask, np.int32)), place(pos, 1)
        if src is not None:  # prefill once per prompt, then share the rows
            batch.prefill(self.model, ids, mask, pos, feats, src, rows_b)
        else:
            batch.extend(self.model, ids, mask, pos, feats, rows_b, sel)

    # ------------------------------------------------------------------------------ the loop
    def _loop(self, st: RolloutState):
        overlap = self.cfg.overlap
        rows, host = st.rows, st.host
        while True:
            host.collect(rows)
            decoding = [r for r in rows if r.phase is Phase.DECODE]
            waiting = [r for r in rows if r.phase in (Phase.EXEC, Phase.QUEUED)]
            ready = [r for r in rows if r.phase is Phase.READY]
            if not overlap and not decoding:
                queued = [r for r in rows if r.phase is Phase.QUEUED]
                for r in queued:
                    host.submit(r)
                if waiting:
                    host.wait(rows, all_of=True)
                    continue
            if ready and (overlap or not waiting):
                if not decoding or len(ready) >= self.cfg.append_min_frac * (len(ready) + len(waiting)):
                    self._append(st, ready)
                    continue
            if decoding:
                self._decode(st)
                continue
            if waiting:
                host.wait(rows, all_of=False)
                continue
            break

    def _decode(self, st: RolloutState):
        c = self.cfg
        n = c.decode_chunk
        self._ensure_room(st, n)
        b = len(st.rows)
        active = np.array([r.phase is Phase.DECODE for r in st.rows])
        limit = np.zeros(b, np.int32)
        hist = np.full((b, self.hist_len), -1, np.int32)
        forced = np.full((b, n), -1, np.int32)
        uid = np.array([r.uid for r in st.rows], np.int32)
        count = np.array([r.sampled for r in st.rows], np.int32)
        for i, r in enumerate(st.rows):
            if not active[i]:
                continue
            limit[i] = self._limit(r)
            if limit[i] == 0:  # a budget ran out exactly at the end of the last observation
                active[i] = False
                r.finish("new_tokens" if r.sampled >= c.max_new_tokens else "length")
                continue
            h = r.turn_ids[-self.hist_len :]
            if h:
                hist[i, self.hist_len - len(h) :] = h
            f = r.forced[:n]
            forced[i, : len(f)] = f
        t0 = time.perf_counter()
        # Only the decoding rows (in a row bucket) run; rows in the sandbox or done sit out.
        out = st.batch.decode(self.sampler, active, limit, hist, forced, uid, count, multiple=c.batch_multiple)
        st.stats.decode_s += time.perf_counter() - t0
        st.stats.decode_steps += out.steps
        st.stats.decode_chunks += 1
        for i, r in enumerate(st.rows):
            if not active[i]:
                continue
            try:
                self._take_tokens(st, r, out, i)
            except Exception as e:  # noqa: BLE001 - one row's failure must not stop the batch
                r.fail(e)

    def _limit(self, r: Row) -> int:
        c = self.cfg
        seq = len(r.traj.tokens) + len(r.turn_ids)
        return max(0, min(c.max_turn_tokens - len(r.turn_ids), c.max_new_tokens - r.sampled, c.max_total_tokens - seq))

    def _take_tokens(self, st: RolloutState, r: Row, out, i):
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
            st.host.want_session(r)
        stop = turn_lib.find_stop(text, self.fmt)
        if stop is None and out.active[i]:
            return
        if stop is not None and stop[1] in self.processor.decode(r.turn_ids[:-1]):
            # The stop string was complete before the last token: the device missed its form.
            self._cut_after_stop(st, r, stop[1])
            text = self.processor.decode(r.turn_ids)
        self._end_turn(st, r, text, stop[1] if stop else None)

    def _cut_after_stop(self, st: RolloutState, r: Row, stop: str):
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
        mask = np.zeros((len(st.rows), st.batch.cache.max_len), bool)
        rewind = np.zeros(len(st.rows), np.int32)
        mask[r.index, slots] = True
        rewind[r.index] = drop
        st.batch.drop(mask, rewind)
        del r.turn_ids[lo:], r.turn_lps[lo:], r.turn_slots[lo:]
        r.sampled -= drop
        r.next_pos -= drop
        st.stats.rollbacks += 1

    def _start_turn(self, st: RolloutState, r: Row):
        r.phase = Phase.DECODE
        r.turn_ids, r.turn_lps, r.turn_slots = [], [], []
        r.forced = []
        if st.script is not None:
            text = st.script(r.index, r.turn)
            if text:
                r.forced = list(self.processor.tokenizer.encode(text))

    def _commit_turn(self, r: Row):
        t = r.traj
        t.tokens += r.turn_ids
        t.loss_mask += [1] * len(r.turn_ids)
        t.turn_ids += [r.turn] * len(r.turn_ids)
        t.logprobs += r.turn_lps

    def _end_turn(self, st: RolloutState, r: Row, text: str, stop: str | None):
        """Commit the turn (`text`: the decode of its sampled ids), then run its code or end the row."""
        self._commit_turn(r)
        t = r.traj
        t.turns.append({"status": None, "observation": "", "n_images": 0, "code": None, "stop": stop, "text": text})
        if stop == self.fmt.call_close:
            t.num_tool_calls += 1
            r.last_turn = r.turn + 1 >= self.cfg.max_turns
            block = turn_lib.extract_code(text, self.fmt)
            t.turns[-1]["code"] = block.code
            if block.code is None:
                st.host.observe(r, "error", "", f"Error: malformed code block: {block.error}.", [])
            elif st.host.session(r) is None:
                st.host.observe(r, "crashed", "", f"Error: the sandbox session is unavailable ({r.session_error}).", [])
            else:
                r.code = block.code
                r.phase = Phase.QUEUED
                if self.cfg.overlap:
                    st.host.submit(r)
            return
        t.turn_status.append("no_code")
        t.turns[-1]["status"] = "no_code"
        if stop == turn_lib.ANSWER_CLOSE:
            t.answer = turn_lib.extract_answer(text)
            r.finish("answer")
        elif stop is not None:
            r.finish("stop")
        elif len(r.turn_ids) >= self.cfg.max_turn_tokens:
            r.finish("turn_tokens")
        elif r.sampled >= self.cfg.max_new_tokens:
            r.finish("new_tokens")
        else:
            r.finish("length")

    def _append(self, st: RolloutState, ready: list[Row]):
        cap = self.cfg.append_images and max(self.cfg.append_images, self.cfg.obs_max_images)
        if cap:  # the first rows whose images fit one vision call; the others wait for the next append
            take, n = [], 0
            for r in ready:
                k = len(r.obs.images)
                if not take or n + k <= cap:
                    take.append(r)
                    n += k
            ready = take
        b = len(st.rows)
        length = token_bucket(max(len(r.obs.ids) for r in ready), self.cfg.obs_buckets, "an observation")
        ids = np.full((b, length), self.pad_id, np.int32)
        mask = np.zeros((b, length), np.int32)
        on = np.zeros(b, bool)
        pvs, grids = [], []
        chosen = {r.index for r in ready}
        for i, r in enumerate(st.rows):
            if i not in chosen:
                continue
            n = len(r.obs.ids)
            ids[i, :n] = r.obs.ids
            mask[i, :n] = 1
            on[i] = True
            if r.obs.images:
                pvs.append(r.obs.pixel_values)
                grids.append(r.obs.grid_thw)
        start = np.array([r.next_pos for r in st.rows], np.int32)
        pv = np.concatenate(pvs) if pvs else None
        grid = np.concatenate(grids) if grids else None
        self._write_chunk(st, ids, mask, pv, grid, on, start, kind="append")
        for i, r in enumerate(st.rows):
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
                t.vision += split_vision(obs.pixel_values, obs.grid_thw)
            r.obs = None
            r.turn += 1
            self._start_turn(st, r)
