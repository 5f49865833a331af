"""Metrics to `metrics.jsonl` and TensorBoard event files in the workdir (process 0 only),
and the human progress line with ETA."""

from __future__ import annotations

import json
import os
import time

import jax

from codedance_jax.errors import DataError


def drop_rows_after(path: str, step: int, step_of=lambda row: row.get("step", 0)) -> int:
    """Removes the rows of `path` (JSON lines; `step_of(row)` their step) past `step`; returns how many.

    A run resumed from the checkpoint at `step` recomputes every later step, so rows written after
    that checkpoint (by a run killed before its next save) would be duplicates. A last line that a
    crash tore in the middle of its write (no newline, not JSON) is dropped with them; a complete
    last row that lost only its newline gets it back. Any other line that is not JSON is someone
    else's edit: a `DataError` naming the line. The file is rewritten whole and renamed into
    place, so a kill here leaves the old or the new file."""
    if not os.path.exists(path):
        return 0
    with open(path, "rb") as f:
        parts = f.read().decode("utf-8", "replace").split("\n")
    lines = [p + "\n" for p in parts[:-1]] + [parts[-1]] * bool(parts[-1])
    keep = []
    for n, line in enumerate(lines, start=1):
        torn = n == len(lines) and not line.endswith("\n")
        if not line.strip():
            keep.append(line)
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if torn:
                continue
            raise DataError(f"{path}:{n}: not a JSON row ({e.msg})",
                            "the file was edited: fix or delete that line, then re-run to resume") from e
        if step_of(row) <= step:
            keep.append(line + "\n" if torn else line)
    if keep == lines:
        return 0
    with open(path + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)
    return len(lines) - len(keep)


class MetricWriter:
    """Appends rows to `{workdir}/metrics.jsonl`; `start` (the step a run resumes from) first drops
    the rows past it, since the run writes them again."""

    def __init__(self, workdir: str, *, tensorboard: bool = True, start: int | None = None):
        self.enabled = jax.process_index() == 0
        self._tb = None
        if not self.enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        path = os.path.join(workdir, "metrics.jsonl")
        if start is not None:
            drop_rows_after(path, start)
        self._f = open(path, "a")
        if tensorboard:
            from tensorboardX import SummaryWriter  # TensorBoard event files without TF's tensorboard package

            self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def write(self, step: int, metrics: dict):
        if not self.enabled:
            return
        row = {"step": int(step), **{k: float(v) for k, v in metrics.items()}}
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                self._tb.add_scalar(k, float(v), int(step))
            self._tb.flush()

    def close(self):
        if self.enabled:
            self._f.close()
            if self._tb is not None:
                self._tb.close()


class Progress:
    """`step 120/1000 (12%) loss 2.31 | 3.1 it/s | eta 4m43s` lines."""

    def __init__(self, total: int, start: int = 0):
        self.total, self.start, self.t0 = total, start, time.time()

    def line(self, step: int, metrics: dict) -> str:
        done = step - self.start
        rate = done / max(time.time() - self.t0, 1e-9)
        eta = (self.total - step) / rate if rate > 0 else float("inf")
        m = " ".join(f"{k} {v:.4g}" for k, v in metrics.items())
        eta_s = "?" if eta == float("inf") else f"{int(eta // 60)}m{int(eta % 60):02d}s"
        return f"step {step}/{self.total} ({100 * step / max(self.total, 1):.0f}%) {m} | {rate:.2f} it/s | eta {eta_s}"
