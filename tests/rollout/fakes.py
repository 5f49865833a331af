"""A scripted stand-in for the sandbox (same interface as `sandbox.SandboxPool`), for fast tests.

Cells are not executed; their text is read for markers: `print("...")` prints, `show(w, h)` returns
a w x h PNG (colour from the session's image and the call count), `raise` gives an error,
`while True` a timeout, `os._exit` a crash, `boom` makes `submit` itself fail,
`garbage` returns a non-result (the engine fails that row only). `delay_s` is slept
per cell in a worker thread, so cells overlap with decoding like the real pool.
"""

import concurrent.futures
import io
import re
import time

import numpy as np
from PIL import Image

from sandbox import ExecResult


class FakeSession:
    def __init__(self, pool, files):
        self.pool, self.files, self.calls, self.closed = pool, files, [], False

    def submit(self, code):
        if "boom" in code:
            raise RuntimeError("session lost")
        self.calls.append(code)
        return self.pool.executor.submit(self._run, code, len(self.calls))

    def _run(self, code, n):
        time.sleep(self.pool.delay_s)
        if "garbage" in code:
            return None  # not an ExecResult: the engine's handling of this row fails
        if "while True" in code:
            return ExecResult("timeout", "", "[sandbox] timed out", [], self.pool.delay_s)
        if "os._exit" in code:
            return ExecResult("crashed", "", "[sandbox] the cell crashed", [], self.pool.delay_s)
        out = "\n".join(re.findall(r'print\("([^"]*)"\)', code))
        if "raise" in code:
            return ExecResult("error", out, "Traceback ...\nValueError: bad", [], self.pool.delay_s)
        images = []
        for w, h in re.findall(r"show\((\d+), (\d+)\)", code):
            rgb = np.random.default_rng(n + len(self.files)).integers(0, 255, (int(h), int(w), 3), dtype=np.uint8)
            buf = io.BytesIO()
            Image.fromarray(rgb).save(buf, format="PNG")
            images.append(buf.getvalue())
        return ExecResult("ok", out, "", images, self.pool.delay_s)

    def close(self):
        self.closed = True


class FakePool:
    def __init__(self, delay_s=0.0, workers=4):
        self.delay_s = delay_s
        self.executor = concurrent.futures.ThreadPoolExecutor(workers)
        self.sessions = []

    def new_session(self, files=None):
        s = FakeSession(self, dict(files or {}))
        self.sessions.append(s)
        return s

    def close(self):
        self.executor.shutdown(wait=False, cancel_futures=True)
