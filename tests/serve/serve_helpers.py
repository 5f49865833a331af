"""Helpers of the serving tests and benchmarks/serve.py: the tiny random checkpoint and a real
`python -m launch.serve` process on 127.0.0.1 (a free port picked by the OS)."""

import os
import re
import subprocess
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for benchmarks/serve.py
from launch_env import launcher_env  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_CONTEXT = 1024


def write_tiny_checkpoint(d: str) -> str:
    """What `quickstart.make_random_checkpoint(d, ModelConfig.tiny())` writes, weights drawn in numpy."""
    import numpy as np

    from codedance_jax.checkpoint import hf
    from codedance_jax.checkpoint.build import model_from_tensors
    from codedance_jax.model.config import ModelConfig
    from codedance_jax.processing.reference_files import write_qwen25vl_processor_files

    rng = np.random.default_rng(0)
    model = model_from_tensors(
        ModelConfig.tiny(),
        lambda r: (0.05 * rng.standard_normal(r.hf_shape)).astype(np.float32) + (1.0 if "norm" in r.hf_name else 0.0),
    )
    hf.export_hf(model, d)
    write_qwen25vl_processor_files(d, max_pixels=448 * 448)
    return d


def server_env() -> dict:
    # The server runs on one CPU device, like the in-test reference engine, and compiles with the
    # test session's other XLA flags (its optimization level), so their greedy tokens compare.
    env = launcher_env(PYTHONUNBUFFERED="1")
    env.setdefault("JAX_COMPILATION_CACHE_DIR", "/tmp/jax_cache")
    return env


class ServerProcess:
    def __init__(self, ckpt: str, *flags: str):
        cmd = [sys.executable, "-m", "launch.serve", f"--checkpoint={ckpt}", "--port=0",
               f"--max_context={MAX_CONTEXT}", "--decode_chunk=8", *flags]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=server_env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.port = None
        ready = threading.Event()

        def read():
            for line in self.proc.stdout:
                self.lines.append(line)
                m = re.search(r"listening on http://127\.0\.0\.1:(\d+)/v1", line)
                if m:
                    self.port = int(m.group(1))
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        ready.wait(timeout=400)
        if self.port is None:
            self.close()
            raise RuntimeError("launch.serve did not start:\n" + "".join(self.lines[-40:]))
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def close(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def bomb_png(side: int = 13000) -> bytes:
    """A ~20 KB PNG that declares side x side pixels (1-bit, all zero): 169 MP at 13000."""
    import struct
    import zlib

    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))

    row, z = b"\0" * (1 + (side + 7) // 8), zlib.compressobj(9)
    data = b"".join(z.compress(row) for _ in range(side)) + z.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0))
            + chunk(b"IDAT", data) + chunk(b"IEND", b""))
