"""The environment of a launcher that a test starts as a subprocess (`python -m launch.*`).

`fast_compile=True` is for compile-bound runs (a few tiny SFT steps compile for seconds and run for
milliseconds): LLVM's -O0 for XLA's CPU kernels cut a cold 8-step `launch.sft` tiny run from 73 s
to 50 s of CPU on this machine, with the same losses to the printed digits. Not for runs that
decode: a 2-step GRPO tiny run took 128 s of CPU at -O0 against 108 s at the default (its decode
ran ~7x slower); the demo's mini preset decodes so little that -O0 still wins there (164 -> 133 s of
CPU for `launch.demo`). In-process tests keep XLA's default: their tolerances were set against it (at -O0
one GRPO mesh-invariance bound, 1e-5 on parameters, saw 1.2e-5: reductions summed in another order).
"""

import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST_COMPILE_XLA_FLAGS = "--xla_backend_optimization_level=0"


def launcher_env(fast_compile: bool = False, drop=(), **extra) -> dict:
    """os.environ for a launcher: XLA_FLAGS without the test session's 8-device count (the
    launcher's --cpu_devices decides), the repo importable, `drop` removed, `extra` added."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", *drop)}
    if fast_compile:
        env["XLA_FLAGS"] = FAST_COMPILE_XLA_FLAGS
    env.update(PYTHONPATH=REPO, **extra)
    return env
