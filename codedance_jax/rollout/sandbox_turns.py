"""The host side of a code turn in one rollout: each row's sandbox session, its cell's submission and
collection, and the observation that answers it.

Sessions are opened lazily: a row's session is opened when it first writes the tool-call tag
(`want_session`), on one background thread, in the order rows ask. A session costs ~30 ms of CPU
to open and ~12 ms to close (three forks of the warm zygote and a namespace set-up; 64 took 1.96 +
0.74 CPU-s on 2 cores, measured). Opened for every row up front, rows that answer without code
paid that too, on the cores XLA runs on. A code block spans several decode chunks, so an open
started at the tag still overlaps the rest of the block's decoding; `session(r)` waits for the
row's own if it has not.

Failure handling: a sandbox error, timeout or crash (and an exception from the pool, or a missing
session) becomes an error observation and a failed turn; an exception while handling one row ends
that row (`Row.fail`), never the batch.
"""

from __future__ import annotations

import concurrent.futures
import time

from codedance_jax.protocol import TurnFormat
from codedance_jax.rollout import turns as turn_lib
from codedance_jax.rollout.config import RolloutConfig, RolloutStats
from codedance_jax.rollout.rows import Phase, Row


class SandboxTurns:
    """The sandbox side of one `rollout()` call. `sandbox`: a `SandboxPool` (or anything with
    `new_session(files=) -> session` whose `submit(code)` returns a Future[ExecResult]), or None;
    `files[p]`: the files of prompt p's sessions (`prompts.session_files`)."""

    def __init__(self, cfg: RolloutConfig, processor, fmt: TurnFormat, stats: RolloutStats, sandbox,
                 files: list[dict]):
        self.cfg, self.processor, self.fmt, self.stats = cfg, processor, fmt, stats
        self.sandbox = sandbox
        self.files = files
        self.opener: concurrent.futures.ThreadPoolExecutor | None = None
        self.cells: list[list] = []  # [submitted at, finished at or None] of every cell, for `busy_s`

    def start(self, rows: list[Row]) -> None:
        if self.sandbox is None:
            for r in rows:
                r.session_error = "no sandbox was given to the rollout"

    def close(self, rows: list[Row]) -> None:
        """End the call: running cells are cancelled, sessions closed off this thread (`_close_later`)."""
        if self.opener is not None:
            self.opener.shutdown(wait=False)  # queued opens still run; `_close_later` closes them
        for r in rows:
            if r.future is not None:
                r.future.cancel()
            _close_later(r.session, r.session_future)
            r.session = r.session_future = None

    def busy_s(self, t0: float, t1: float) -> float:
        """Seconds of [t0, t1) during which at least one cell ran."""
        return _union_length(self.cells, t0, t1)

    # ------------------------------------------------------------------------------ sessions
    def want_session(self, r: Row) -> None:
        """Start opening the row's session in the background (once per row)."""
        if self.sandbox is None or r.session is not None or r.session_future is not None or r.phase is Phase.PAD:
            return
        if self.opener is None:
            self.opener = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout-sessions")
        r.session_future = self.opener.submit(self.sandbox.new_session, files=self.files[r.prompt])

    def session(self, r: Row):
        """The row's session (opening it now if it was never asked for, and waiting for it), or None
        with `session_error` set."""
        self.want_session(r)
        if r.session_future is not None:
            fut, r.session_future = r.session_future, None
            try:
                r.session = fut.result()
            except Exception as e:  # noqa: BLE001 - a row without a session answers code with a crash
                r.session_error = f"{type(e).__name__}: {e}"
        return r.session

    # ------------------------------------------------------------------------------ cells
    def submit(self, r: Row) -> None:
        try:
            r.future = r.session.submit(r.code)
        except Exception as e:  # noqa: BLE001 - e.g. the session died: a crashed turn
            self.observe(r, "crashed", "", f"Error: the sandbox refused the cell ({type(e).__name__}: {e}).", [])
            return
        r.phase = Phase.EXEC
        r.submitted_at = time.perf_counter()
        cell = [r.submitted_at, None]
        self.cells.append(cell)
        r.future.add_done_callback(lambda _f, cell=cell: cell.__setitem__(1, time.perf_counter()))
        self.stats.executions += 1

    def wait(self, rows: list[Row], all_of: bool) -> None:
        """Block until the first (or every) running cell finishes or the oldest passes its deadline,
        then collect; the time counts as the device's idle time."""
        running = [r for r in rows if r.phase is Phase.EXEC]
        t0 = time.perf_counter()
        if running:
            timeout = None
            if self.cfg.exec_deadline_s is not None:
                oldest = min(r.submitted_at for r in running)
                timeout = max(0.0, oldest + self.cfg.exec_deadline_s - t0)
            concurrent.futures.wait(
                [r.future for r in running],
                timeout=timeout,
                return_when=concurrent.futures.ALL_COMPLETED if all_of else concurrent.futures.FIRST_COMPLETED,
            )
        self.stats.device_wait_s += time.perf_counter() - t0
        self.collect(rows)

    def collect(self, rows: list[Row]) -> None:
        """Observe every finished (or late) cell without blocking."""
        now = time.perf_counter()
        for r in rows:
            if r.phase is not Phase.EXEC:
                continue
            late = self.cfg.exec_deadline_s is not None and now - r.submitted_at > self.cfg.exec_deadline_s
            if not (r.future.done() or late):
                continue
            r.traj.timings["sandbox_wait_s"] = r.traj.timings.get("sandbox_wait_s", 0.0) + now - r.submitted_at
            fut, r.future = r.future, None
            try:
                if not fut.done():
                    fut.cancel()
                    self.observe(r, "timeout", "", f"[engine] no result after {self.cfg.exec_deadline_s} s", [])
                    continue
                try:
                    res = fut.result()
                except Exception as e:  # noqa: BLE001 - the pool failed this cell: a crash, as SPEC says
                    self.observe(r, "crashed", "", f"[sandbox] {type(e).__name__}: {e}", [])
                    continue
                self.observe(r, res.status, res.stdout, res.stderr, list(res.images))
                r.traj.num_executions += 1
            except Exception as e:  # noqa: BLE001
                r.fail(e)

    def observe(self, r: Row, status: str, stdout: str, stderr: str, pngs: list[bytes]) -> None:
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
            r.finish("max_turns")
        elif len(t.tokens) + len(obs.ids) >= c.max_total_tokens:
            r.finish("length")
        else:
            r.obs = obs
            r.phase = Phase.READY


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
