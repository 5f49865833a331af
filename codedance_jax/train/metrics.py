"""Metrics to `metrics.jsonl` and TensorBoard event files in the workdir (process 0 only),
and the human progress line with ETA."""

from __future__ import annotations

import json
import os
import time

import jax


class MetricWriter:
    def __init__(self, workdir: str, *, tensorboard: bool = True):
        self.enabled = jax.process_index() == 0
        self._tb = None
        if not self.enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        self._f = open(os.path.join(workdir, "metrics.jsonl"), "a")
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
