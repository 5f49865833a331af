"""SFT step time, tokens/s and compilations per mesh shape, through the real data pipeline.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/sft_step.py [--quick]

For each model config (tiny; small = text 256 wide x 4 layers, vision 2 x 128, real vocabulary)
and each mesh shape (data, fsdp, tensor) over the 8 simulated CPU devices, it runs N steps of
`train.sft` on batches from `data.sft_pipeline` (synthetic trajectories, two length buckets) and
reports the median step time after the first step, tokens/s, model TFLOP/s with the formula of
`train/flops.py`, and the number of XLA compilations during the N steps (target: one per bucket
seen). Prints a table and writes benchmarks/results/sft_step_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402

from codedance_jax import sharding as shd  # noqa: E402
from codedance_jax.model.config import ModelConfig, TextConfig, VisionConfig  # noqa: E402
from codedance_jax.processing import Processor  # noqa: E402
from codedance_jax.processing.reference_files import write_qwen25vl_processor_files  # noqa: E402
from codedance_jax.train import flops, optim, sft  # noqa: E402
from codedance_jax.train import state as st  # noqa: E402
from data import sft_pipeline, sft_tfds  # noqa: E402
from data.synthetic import write_synthetic_sft  # noqa: E402

COMPILES = [0]
jax.monitoring.register_event_duration_secs_listener(
    lambda name, *_a, **_k: COMPILES.__setitem__(0, COMPILES[0] + (name == "/jax/core/compile/backend_compile_duration")))

CONFIGS = {
    "tiny": ModelConfig.tiny(),
    "small": ModelConfig(
        vision=VisionConfig(depth=2, hidden_size=128, intermediate_size=256, num_heads=4, window_size=112,
                            out_hidden_size=256, fullatt_block_indexes=(1,)),
        text=TextConfig(vocab_size=151936, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, mrope_section=(8, 12, 12)),
    ),
}
MESHES = [(1, 1, 1), (8, 1, 1), (2, 4, 1), (2, 2, 2)]
BUCKETS = [(128, 16, 8), (256, 32, 16)]


def run(name, cfg, mesh_shape, source, proc, steps, batch):
    oc = ml_collections.ConfigDict(dict(lr=1e-3, warmup_ratio=0.1, weight_decay=0.0, b1=0.9, b2=0.95, eps=1e-8,
                                        clip_norm=1.0, schedule="cosine"))
    tx, sched = optim.make_optimizer(oc, steps)
    mesh = shd.make_mesh(*mesh_shape, devices=jax.devices()[: int(np.prod(mesh_shape))])
    mdef, state, sh = st.create_train_state(cfg, tx, mesh, seed=0)
    it = sft_pipeline.make_sft_iterator(source, proc, cfg, batch_size=batch, buckets=BUCKETS, seed=0, num_epochs=None)
    fns, times, toks, fl, shapes = {}, [], [], [], set()
    c0 = COMPILES[0]
    for i in range(steps):
        local = {k: v for k, v in next(it).items() if k in sft.BATCH_FIELDS}
        bsh = sft.batch_shardings(local, mesh)
        key = tuple((k, v.shape) for k, v in sorted(local.items()))
        shapes.add(local["input_ids"].shape)
        if key not in fns:
            fns[key] = sft.make_train_step(mdef, tx, sched, sh, bsh, mesh)
        t0 = time.perf_counter()
        state, m = fns[key](state, {k: jax.device_put(v, bsh[k]) for k, v in local.items()}, jax.random.key(0))
        jax.block_until_ready(m["loss"])
        dt = time.perf_counter() - t0
        if i > 0:
            times.append(dt)
            n = float(m["tokens"])
            toks.append(n / dt)
            patches = float((local["unit_src"] >= 0).sum() * cfg.vision.merge_unit)
            fl.append(flops.train_flops(cfg, n, local["input_ids"].shape[1], patches) / dt)
    return {
        "config": name, "mesh": list(mesh_shape), "steps": steps, "batch": batch,
        "step_time_s_median": float(np.median(times)), "tokens_per_s_median": float(np.median(toks)),
        "model_tflops_per_s": float(np.median(fl)) / 1e12, "compilations": COMPILES[0] - c0,
        "buckets_seen": len(shapes), "final_loss": float(m["loss"]),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--configs", default="tiny,small", help="comma list of: " + ",".join(CONFIGS))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "sft_step_cpu.json"))
    args = ap.parse_args()
    steps = 4 if args.quick else args.steps
    tmp = tempfile.mkdtemp()
    write_qwen25vl_processor_files(os.path.join(tmp, "proc"), max_pixels=112 * 112)
    proc = Processor.from_pretrained(os.path.join(tmp, "proc"))
    jsonl = write_synthetic_sft(os.path.join(tmp, "syn"), 32)
    sft_tfds.build_dataset([jsonl], os.path.join(tmp, "tfds"), "bench")
    source = sft_tfds.open_source(os.path.join(tmp, "tfds"), "bench")
    rows = []
    for name in args.configs.split(","):
        cfg = CONFIGS[name]
        for mesh_shape in MESHES[:2] if args.quick else MESHES:
            r = run(name, cfg, mesh_shape, source, proc, steps, args.batch)
            rows.append(r)
            print(f"{name:6s} mesh {str(tuple(mesh_shape)):10s} step {r['step_time_s_median']:.3f}s  "
                  f"{r['tokens_per_s_median']:8.1f} tok/s  {r['model_tflops_per_s'] * 1e3:7.1f} GFLOP/s  "
                  f"compiles {r['compilations']:2d} (buckets seen {r['buckets_seen']})", flush=True)
    load = os.getloadavg()
    if os.path.exists(args.out):  # merge with rows of other configs measured earlier
        with open(args.out) as f:
            rows = [r for r in json.load(f).get("rows", []) if r["config"] not in args.configs.split(",")] + rows
    out = {"machine": f"{os.cpu_count()} CPU cores, 8 simulated JAX devices", "load_avg_end": load, "rows": rows,
           "jax": jax.__version__}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"load average at end {load}; wrote {args.out}")


if __name__ == "__main__":
    main()
