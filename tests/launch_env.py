"""The environment of a launcher that a test starts as a subprocess (`python -m launch.*`).

Those runs are compile-bound: a tiny model's steps compile for seconds and run for milliseconds.
LLVM's -O0 for XLA's CPU kernels cut a cold `launch.sft` tiny run's CPU time by about a third on
this machine (73 s -> 50 s user, same losses to the printed digits), so launcher subprocesses get it.
In-process tests keep XLA's default (their tolerances were set against it: at -O0 one GRPO
mesh-invariance bound, 1e-5 on parameters, saw 1.2e-5, reductions summed in another order).
Tests that compare a subprocess with an in-process run, or read back what an in-process run
compiled (test_grpo_loop's resume), do not use this.
"""

import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER_XLA_FLAGS = "--xla_backend_optimization_level=0"


def launcher_env(drop=(), **extra) -> dict:
    """os.environ for a launcher: XLA_FLAGS without the test session's 8-device count (the
    launcher's --cpu_devices decides), the repo importable, `drop` removed, `extra` added."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(XLA_FLAGS=LAUNCHER_XLA_FLAGS, PYTHONPATH=REPO, **extra)
    return env
