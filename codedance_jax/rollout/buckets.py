"""Shape buckets for rollouts, and a counter of XLA compilations.

Every array that enters jitted code during a rollout has a bucketed shape: the batch (a multiple
of `batch_multiple`), the cache length (fixed per engine), prompt and observation chunks (the
smallest listed token bucket that fits), and the vision call (image tokens and windows rounded up
to powers of two). After one rollout has visited the buckets, further rollouts compile nothing;
`CompileCounter` counts backend compilations (jitted functions and eager ops alike) to check it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import jax
import numpy as np

from codedance_jax.model import vision


def pow2(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum)."""
    n = max(int(n), int(minimum), 1)
    return 1 << (n - 1).bit_length()


def round_up(n: int, multiple: int) -> int:
    return -(-int(n) // multiple) * multiple


def token_bucket(n: int, buckets: Sequence[int], what: str) -> int:
    for b in sorted(buckets):
        if n <= b:
            return b
    raise ValueError(f"{what} of {n} tokens exceeds the largest token bucket {max(buckets)}; add a larger bucket")


def vision_bucket(grid_thw, cfg, min_units: int) -> dict[str, int]:
    """`num_windows`, `num_units` (powers of two) for one vision call over `grid_thw` int[I, 3]."""
    plan = vision.make_plan(grid_thw, cfg.vision)
    per_window = cfg.vision.window_merged**2
    windows = pow2(len(plan.unit_src) // per_window, max(1, min_units // per_window))
    return dict(num_windows=windows, num_units=pow2(plan.num_units, min_units))


_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_lock = threading.Lock()
_count = 0
_installed = False


def _listener(event: str, duration: float, **kwargs) -> None:
    global _count
    if event == _BACKEND_COMPILE:
        with _lock:
            _count += 1


class CompileCounter:
    """`with CompileCounter() as c: ...; c.count` = XLA backend compilations inside the block (all threads)."""

    def __init__(self):
        global _installed
        with _lock:
            if not _installed:
                jax.monitoring.register_event_duration_secs_listener(_listener)
                _installed = True
        self.start = self.count = 0

    @staticmethod
    def total() -> int:
        return _count

    def __enter__(self) -> CompileCounter:
        self.start = _count
        return self

    def __exit__(self, *exc) -> None:
        self.count = _count - self.start

    @property
    def so_far(self) -> int:
        return _count - self.start


def np_pad_to(a: np.ndarray, length: int, axis: int, value=0) -> np.ndarray:
    pad = [(0, 0)] * a.ndim
    pad[axis] = (0, length - a.shape[axis])
    return np.pad(a, pad, constant_values=value)
