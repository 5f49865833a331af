"""Rollout throughput on the tiny model with the sandbox in the loop: overlap vs a sequential baseline (issue 6).

    .venv/bin/python benchmarks/rollout.py [--prompts 4] [--group 4] [--repeats 2] [--fake]

The tiny random model cannot write code, so a scripted policy forces the code turns through the
same sampler/cache/append path (forced tokens cost a decode step like sampled ones): row r writes
r % 4 code cells (open the prompt image, crop it, some numpy work, show the crop and print), then
samples its last turn freely up to the turn budget. Each mode runs once to warm up (compile),
then `--repeats` measured times. Reported: trajectories/s, generated tokens/s, the fraction of wall
time the device waited for the sandbox (`device_idle`) and the sandbox had no cell in flight
(`sandbox_idle`), XLA compilations in the measured runs, and overlap's speed-up over sequential
(all decoding, then all code, turn by turn). Uses the real `SandboxPool` when run as root,
`--fake` (or no root) for a scripted stand-in with a fixed delay per cell. Prints a table and
writes benchmarks/results/rollout.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CELL = (
    "<think>look closer</think>\n<code>\n```python\nfrom PIL import Image\nimport numpy as np\n"
    "im = Image.open('image.png')\nw, h = im.size\ncrop = im.crop((0, 0, w // 2, h // 2))\n"
    "a = np.linalg.svd(np.random.rand({n}, {n}))[1][0]\ncrop.show()\nprint(w, h, round(float(a), 2))\n```\n</code>"
)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--svd", type=int, default=200, help="matrix size of the numpy work in each cell")
    ap.add_argument("--fake", action="store_true", help="scripted sandbox stand-in (no root needed)")
    ap.add_argument("--fake-delay", type=float, default=0.05)
    ap.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "rollout.json")
    )
    args = ap.parse_args()

    import jax
    from flax import nnx
    from PIL import Image

    from codedance_jax.model.config import ModelConfig
    from codedance_jax.model.qwen25vl import Qwen25VL
    from codedance_jax.processing import Processor, write_qwen25vl_processor_files
    from codedance_jax.rollout import RolloutConfig, RolloutEngine, SamplingConfig, rl_prompt

    d = tempfile.mkdtemp()
    write_qwen25vl_processor_files(d, min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64)
    processor = Processor.from_pretrained(d)
    model = Qwen25VL(ModelConfig.tiny(), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = [
        rl_prompt(
            processor,
            f"b{i}",
            f"What is in the corner? ({i})",
            [Image.fromarray(rng.integers(0, 255, (112, 168, 3), dtype=np.uint8))],
        )
        for i in range(args.prompts)
    ]
    cell = CELL.format(n=args.svd)

    def script(row, turn):
        return cell if turn < row % 4 else None

    use_fake = args.fake or os.geteuid() != 0
    if use_fake:
        sys.path.insert(
            0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "rollout")
        )
        from fakes import FakePool

        pool, sandbox_kind = FakePool(args.fake_delay), f"fake ({args.fake_delay * 1e3:.0f} ms per cell)"
    else:
        from sandbox import SandboxPool

        pool, sandbox_kind = SandboxPool(num_workers=4, timeout_s=15.0, memory_mb=1024), "SandboxPool (4 workers)"

    base = dict(
        max_turns=6,
        max_turn_tokens=160,
        max_new_tokens=768,
        max_total_tokens=1536,
        decode_chunk=8,
        batch_multiple=8,
        prompt_buckets=(256,),
        obs_buckets=(64, 128),
        vision_min_units=64,
        obs_max_pixels=28 * 28 * 64,
    )
    rows = []
    try:
        for overlap in (True, False):
            engine = RolloutEngine(model, processor, RolloutConfig(overlap=overlap, **base), SamplingConfig(seed=0))
            t0 = time.perf_counter()
            engine.rollout(prompts, args.group, pool, script=script)
            warm = time.perf_counter() - t0
            runs = [
                engine.rollout(prompts, args.group, pool, script=script, seed_offset=1000 * (k + 1))
                for k in range(args.repeats)
            ]
            stats = [s for _, s in runs]
            trajs = [t for ts, _ in runs for t in ts]
            wall = sum(s.wall_s for s in stats)
            rows.append(
                dict(
                    mode="overlap" if overlap else "sequential",
                    warmup_s=warm,
                    wall_s=wall / len(stats),
                    traj_per_s=sum(s.trajectories for s in stats) / wall,
                    gen_tok_per_s=sum(s.generated_tokens for s in stats) / wall,
                    device_idle=sum(s.device_wait_s for s in stats) / wall,
                    sandbox_idle=1 - sum(s.sandbox_busy_s for s in stats) / wall,
                    decode_s=sum(s.decode_s for s in stats) / len(stats),
                    append_s=sum(s.append_s for s in stats) / len(stats),
                    vision_s=sum(s.vision_s for s in stats) / len(stats),
                    executions=sum(s.executions for s in stats) / len(stats),
                    decode_steps=sum(s.decode_steps for s in stats) / len(stats),
                    compactions=sum(s.compactions for s in stats),
                    compiles=sum(s.compiles for s in stats),
                    turn_status=_count(st for t in trajs for st in t.turn_status),
                    finish=_count(t.finish_reason for t in trajs),
                )
            )
    finally:
        pool.close()

    speedup = rows[0]["traj_per_s"] / rows[1]["traj_per_s"]
    print(
        f"rollout, tiny model, {args.prompts} prompts x {args.group}, sandbox: {sandbox_kind}, backend "
        f"{jax.default_backend()}, {os.cpu_count()} CPUs"
    )
    print(
        f"{'mode':<11} {'traj/s':>7} {'gen tok/s':>9} {'dev idle':>8} {'sbx idle':>8} {'decode s':>8} "
        f"{'append s':>8} {'vision s':>8} {'cells':>5} {'compiles':>8} {'warm-up s':>9}"
    )
    for r in rows:
        print(
            f"{r['mode']:<11} {r['traj_per_s']:7.2f} {r['gen_tok_per_s']:9.1f} {r['device_idle']:8.1%} "
            f"{r['sandbox_idle']:8.1%} {r['decode_s']:8.2f} {r['append_s']:8.2f} {r['vision_s']:8.2f} "
            f"{r['executions']:5.0f} {r['compiles']:8d} {r['warmup_s']:9.1f}"
        )
    print(f"overlap / sequential trajectories/s: {speedup:.2f}x")
    out = dict(
        prompts=args.prompts,
        group=args.group,
        repeats=args.repeats,
        sandbox=sandbox_kind,
        backend=jax.default_backend(),
        jax=jax.__version__,
        machine=platform.platform(),
        cpu_count=os.cpu_count(),
        config=base,
        rows=rows,
        overlap_speedup=speedup,
    )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")


def _count(items):
    out = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return out


if __name__ == "__main__":
    main()
