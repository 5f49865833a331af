"""The environment of a process that a test starts (`python -m launch.*`, the server, the curator).

It gets the test session's XLA flags without the 8-device count (the launcher's --cpu_devices
decides), so it compiles at the session's optimization level: XLA's CPU backend at LLVM -O0
(`tests/conftest.py`). The tests' programs compile for seconds and run for milliseconds, and a
launcher whose numbers a test compares with in-process ones must compile them the same way.
"""

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def subprocess_xla_flags() -> str:
    """The session's XLA_FLAGS minus --xla_force_host_platform_device_count."""
    return re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", "")).strip()


def launcher_env(drop=(), **extra) -> dict:
    """os.environ for a launcher: the session's XLA flags without its device count, the repo
    importable, `drop` removed, `extra` added."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", *drop)}
    if flags := subprocess_xla_flags():
        env["XLA_FLAGS"] = flags
    env.update(PYTHONPATH=REPO, **extra)
    return env
