"""Time of the jitted R_BAT advantage kernel against a NumPy loop baseline (issue 5).

    .venv/bin/python benchmarks/rbat_kernel.py [--prompts 256] [--group 8] [--turns 6] [--repeats 50]

Workload: the paper's RL batch, 256 prompts × 8 rollouts = 2048 trajectories with up to 6 turns,
random outcomes. Times the kernel after compilation (median of `--repeats` calls, results blocked
on), the compile time, the same on an 8-device CPU mesh with the batch sharded, and a per-trajectory
Python/NumPy loop (the shape of the release's reward-manager code). Prints a table and writes
benchmarks/results/rbat_kernel.json.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from codedance_jax.rl import RBATConfig, rbat_advantages  # noqa: E402


def numpy_loop(acc, fmt_ok, is_tool, failed, G, gamma=4.0, delta=0.2, beta=0.2):
    """The paper preset, one trajectory and one turn at a time (the baseline)."""
    B, M = is_tool.shape
    r = np.zeros(B)
    for b in range(B):
        r[b] = acc[b] + 0.5 * fmt_ok[b]
        n_total = int(is_tool[b].sum())
        if n_total:
            n_succ = int((is_tool[b] & ~failed[b]).sum())
            mu = float(np.mean(acc[b // G * G : b // G * G + G] > 0))
            d = 1 / (1 + math.exp(-gamma * (0.5 - mu))) - delta
            r[b] += (0.5 + 0.5 * (acc[b] > 0)) * d * n_succ / n_total
    a_seq = np.zeros(B)
    for p in range(B // G):
        g = r[p * G : (p + 1) * G]
        a_seq[p * G : (p + 1) * G] = (g - g.mean()) / (g.std() + 1e-6)
    returns = np.zeros((B, M))
    for b in range(B):
        nxt = 0.0
        for m in reversed(range(M)):
            returns[b, m] = (-0.5 if failed[b, m] and is_tool[b, m] else 0.0) + beta * nxt
            nxt = returns[b, m]
    vals = returns[is_tool]
    a_turn = np.where(is_tool, (returns - vals.mean()) / (vals.std() + 1e-6), 0.0)
    return a_seq, a_turn


def timeit(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "rbat_kernel.json"))
    args = ap.parse_args()

    P, G, M = args.prompts, args.group, args.turns
    B = P * G
    rng = np.random.default_rng(0)
    acc = (rng.random(B) < 0.6).astype(np.float32)
    fmt_ok = rng.random(B) < 0.9
    is_tool = np.arange(M)[None, :] < rng.integers(0, M + 1, size=B)[:, None]
    failed = is_tool & (rng.random((B, M)) < 0.2)

    rows = []
    for name, cfg in (("paper", RBATConfig.paper()), ("release", RBATConfig.release())):
        t0 = time.perf_counter()
        jax.block_until_ready(rbat_advantages(acc, fmt_ok, is_tool, failed, group_size=G, cfg=cfg))
        compile_s = time.perf_counter() - t0
        dev = [jax.device_put(x, jax.devices()[0]) for x in (acc, fmt_ok, is_tool, failed)]
        run_s = timeit(
            lambda c=cfg, d=dev: jax.block_until_ready(rbat_advantages(*d, group_size=G, cfg=c)), args.repeats
        )
        rows.append({"variant": f"jit, 1 device, {name}", "seconds": run_s, "compile_seconds": compile_s})

    if len(jax.devices()) >= 8:
        mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
        put = lambda x: jax.device_put(x, NamedSharding(mesh, PartitionSpec("data", *([None] * (x.ndim - 1)))))
        sharded = [put(x) for x in (acc, fmt_ok, is_tool, failed)]
        cfg = RBATConfig.paper()
        t0 = time.perf_counter()
        jax.block_until_ready(rbat_advantages(*sharded, group_size=G, cfg=cfg))
        compile_s = time.perf_counter() - t0
        run_s = timeit(lambda: jax.block_until_ready(rbat_advantages(*sharded, group_size=G, cfg=cfg)), args.repeats)
        rows.append({"variant": "jit, 8-device CPU mesh, paper", "seconds": run_s, "compile_seconds": compile_s})

    loop_s = timeit(lambda: numpy_loop(acc, fmt_ok, is_tool, failed, G), max(3, args.repeats // 10))
    rows.append({"variant": "NumPy loop baseline, paper", "seconds": loop_s, "compile_seconds": 0.0})
    want = numpy_loop(acc, fmt_ok, is_tool, failed, G)
    got = rbat_advantages(acc, fmt_ok, is_tool, failed, group_size=G, cfg=RBATConfig.paper())
    max_err = max(float(np.abs(np.asarray(g) - w).max()) for g, w in zip(got, want, strict=True))

    print(f"R_BAT kernel, B = {P}×{G} = {B} trajectories, M = {M} turns, {jax.default_backend()} backend")
    print(f"{'variant':<34} {'median ms':>10} {'compile s':>10} {'vs loop':>8}")
    for row in rows:
        print(
            f"{row['variant']:<34} {row['seconds'] * 1e3:>10.3f} {row['compile_seconds']:>10.2f} {loop_s / row['seconds']:>7.0f}x"
        )
    print(f"max |kernel − loop| = {max_err:.2e}")

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    result = {
        "batch": {"prompts": P, "group": G, "trajectories": B, "turns": M},
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "machine": platform.platform(),
        "cpu_count": os.cpu_count(),
        "repeats": args.repeats,
        "rows": rows,
        "max_abs_err_vs_loop": max_err,
    }
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
