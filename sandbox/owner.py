"""`PoolThread`: the one owner of a `SandboxPool` for trainers and evaluators.

The pool's zygote dies with the thread that created it (the parent-death signal is per thread),
so a pool created in a short-lived worker thread, or in a thread that ends before the run does,
would lose its sessions. `PoolThread` creates the pool in its own long-lived thread and keeps it
there until `close()`; the caller uses `.pool` from any thread (the pool is thread-safe).

    with PoolThread(num_workers=4, timeout_s=15.0, memory_mb=2048) as pool:
        session = pool.new_session(files={"image.png": png})
"""

from __future__ import annotations

import threading


class PoolThread:
    """Owns a `SandboxPool` in a long-lived thread; `SandboxPool` keyword arguments."""

    def __init__(self, **pool_kwargs):
        self._ready, self._stop = threading.Event(), threading.Event()
        self.pool, self.error = None, None
        self._t = threading.Thread(target=self._run, args=(pool_kwargs,), daemon=True, name="sandbox-pool")
        self._t.start()
        self._ready.wait()
        if self.error is not None:
            raise self.error

    def _run(self, kw):
        from sandbox.pool import SandboxPool

        try:
            with SandboxPool(**kw) as pool:
                self.pool = pool
                self._ready.set()
                self._stop.wait()
        except BaseException as e:  # noqa: BLE001 - surfaced to the caller
            self.error = e
            self._ready.set()

    def close(self):
        self._stop.set()
        self._t.join(timeout=60)

    def __enter__(self):
        return self.pool

    def __exit__(self, *exc):
        self.close()
        return False
