"""SFT step time: the demo preset (before vs after, side by side), Tunix's PeftTrainer, mesh shapes.

  python benchmarks/sft_step.py --case demo [--steps 60]     # the demo's SFT step, before vs after
  python benchmarks/sft_step.py --case tunix [--steps 20]    # 8 x 256 at Tunix's sizes, ours vs PeftTrainer
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/sft_step.py --case meshes [--quick]

demo: the demo's SFT run config (`configs/demo.py`: toy model, batch 16, its buckets) on a toy
world of `world.n_sft` trajectories, the real data pipeline and step. The same batches (same
seed, same grouping) go through the `--variants` in one invocation, step by step alternately on
copies of the same initial state: `before` (padded to the bucket, log-probs by the rematerialized
chunk map, as before issue 14's SFT work), `after` (the demo's step now: small logits in one
piece) and `packed` (`after` with several examples to a row: `--pack`, `--pack-row-multiple`). Per step it times the
data (next batch), the host->device put and the step (block_until_ready), counts compilations,
and checks that both layouts give the same loss. The 600-step phase is extrapolated as the
compile time plus 600 x the mean step after the first of each shape.

tunix: a text-only SFT step at 8 x 256 tokens at Tunix's test sizes (hidden 128, 2 layers, vocab
1024, fp32, every token trained), ours against Tunix's `PeftTrainer` (`benchmarks/tunix_sft.py`,
run in the separate venv of benchmarks/requirements-bench.txt as a subprocess), ours timed before
and after it (the mean of the two medians) so that a drifting load hits both sides alike.

meshes: for each model config (tiny; small = text 256 wide x 4 layers, vision 2 x 128, real vocabulary)
and each mesh shape (data, fsdp, tensor) over the 8 simulated CPU devices, it runs N steps of
`train.sft` on batches from `data.sft_pipeline` (synthetic trajectories, two length buckets) and
reports the median step time after the first step, tokens/s, model TFLOP/s with the formula of
`train/flops.py`, and the number of XLA compilations during the N steps (target: one per bucket
seen). Prints a table and writes benchmarks/results/sft_step_cpu.json.

demo and tunix print tables and write benchmarks/results/sft_step.json. Absolute times on a
shared machine are noisy: compare the ratios, taken in one invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

if "meshes" in " ".join(sys.argv):  # 8 simulated devices for the mesh shapes; demo and tunix run on one, as the demo
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


def meshes_main(args):
    steps = 4 if args.quick else (args.steps or 20)
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


HERE = os.path.dirname(os.path.abspath(__file__))


# ----------------------------------------------------------------------------------- demo preset
def demo_case(args):
    from configs import demo as demo_configs
    from runs import setup
    from runs import sft as rsft
    from runs.demo import pipeline

    c = demo_configs.get_config()
    work = args.workdir or tempfile.mkdtemp(prefix="sft_demo_")
    t0 = time.perf_counter()
    world = pipeline.make_world(c, work)  # reused when WORKDIR/world exists
    print(f"world: {world['splits']['sft']['n']} SFT trajectories ({time.perf_counter() - t0:.1f} s)", flush=True)
    config = pipeline.sft_config(c, work)
    wd = os.path.join(work, "sft_bench")
    os.makedirs(wd, exist_ok=True)
    cfg = setup.model_config(config)
    rules, mesh = setup.sharding_rules(config), setup.make_mesh(config)
    tx, sched = optim.make_optimizer(config.optim, config.total_steps)
    rsft.prepare_files(config, wd)
    proc = Processor.from_pretrained(rsft.processor_path(config, wd))
    variants = {}
    pack = tuple(int(x) for x in args.pack.split(","))
    from codedance_jax.train import logprobs

    whole = logprobs.SMALL_LOGITS_BYTES
    names = args.variants.split(",")
    for name in names:
        vc = config.copy_and_resolve_references()
        vc.data.pack, vc.data.pack_row_multiple = (pack if name == "packed" else ()), args.pack_row_multiple
        it, _ = rsft.make_data(vc, proc, cfg, wd, config.batch_size, rsft.packed_row_multiple(vc, mesh))
        mdef, state, state_sh = st.create_train_state(cfg, tx, mesh, seed=config.seed, rules=rules)
        variants[name] = dict(it=it, state=state, fns={}, rows=[], small_logits=0 if name == "before" else whole)
    for i in range(args.steps):
        for v in variants.values():
            logprobs.SMALL_LOGITS_BYTES = v["small_logits"]  # read when a new shape is traced
            t0 = time.perf_counter()
            local = next(v["it"])
            t1 = time.perf_counter()
            fields = {k: x for k, x in local.items() if k in sft.BATCH_FIELDS}
            bsh = sft.batch_shardings(fields, mesh, rules)
            key = setup.batch_key(fields)
            new_shape = key not in v["fns"]
            if new_shape:
                v["fns"][key] = sft.make_train_step(mdef, tx, sched, state_sh, bsh, mesh, rules=rules)
            gb = rsft.global_batch(fields, bsh)
            jax.block_until_ready(gb)
            t2 = time.perf_counter()
            c0 = COMPILES[0]
            v["state"], m = v["fns"][key](v["state"], gb, jax.random.key(0))
            m = jax.device_get(m)
            t3 = time.perf_counter()
            v["rows"].append(dict(data_s=t1 - t0, put_s=t2 - t1, step_s=t3 - t2, new_shape=new_shape,
                                  compiles=COMPILES[0] - c0, shape=list(local["input_ids"].shape),
                                  tokens=int(local["attention_mask"].sum()), slots=int(local["attention_mask"].size),
                                  loss=float(m["loss"])))
        print(f"step {i:3d}: " + " | ".join(f"{n} {variants[n]['rows'][-1]['shape']} {variants[n]['rows'][-1]['step_s']:.3f} s "
                                          f"loss {variants[n]['rows'][-1]['loss']:.4f}" for n in names), flush=True)
    logprobs.SMALL_LOGITS_BYTES = whole
    out = {"steps": args.steps, "batch": config.batch_size, "pack": list(pack), "pack_row_multiple": args.pack_row_multiple,
           "model_params": int(sum(x.size for x in jax.tree.leaves(variants[names[0]]["state"].params)))}
    for name, v in variants.items():
        rows = v["rows"]
        steady = [r for r in rows if not r["new_shape"]]
        per = lambda k, rs=steady: statistics.mean(r[k] for r in rs) if rs else float("nan")  # noqa: E731
        first = sum(r["step_s"] for r in rows if r["new_shape"])
        mean_total = per("data_s") + per("put_s") + per("step_s")
        out[name] = dict(shapes=len(v["fns"]), compiles=sum(r["compiles"] for r in rows), first_of_shape_s=first,
                         mean_data_s=per("data_s"), mean_put_s=per("put_s"), mean_step_s=per("step_s"),
                         median_step_s=statistics.median(r["step_s"] for r in steady) if steady else float("nan"),
                         fill=sum(r["tokens"] for r in rows) / sum(r["slots"] for r in rows),
                         extrapolated_600_s=first + 600 * mean_total, rows=rows)
    pa, pk = out[names[0]], out[names[-1]]
    out["compared"] = [names[0], names[-1]]
    out["max_loss_rel_diff"] = max(abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(pa["rows"], pk["rows"], strict=True))
    out["speedup_steady"] = (pa["mean_data_s"] + pa["mean_put_s"] + pa["mean_step_s"]) / (
        pk["mean_data_s"] + pk["mean_put_s"] + pk["mean_step_s"])
    print(f"\ndemo SFT preset, {args.steps} steps each, alternating (load avg {os.getloadavg()[0]:.1f})")
    print(f"{'layout':8s} {'shapes':>6s} {'compiles':>8s} {'1st/shape s':>11s} {'data s':>7s} {'put s':>6s} {'step s':>7s} "
          f"{'median':>7s} {'fill':>5s} {'600 steps s':>11s}")
    for name in names:
        r = out[name]
        print(f"{name:8s} {r['shapes']:6d} {r['compiles']:8d} {r['first_of_shape_s']:11.1f} {r['mean_data_s']:7.3f} "
              f"{r['mean_put_s']:6.3f} {r['mean_step_s']:7.3f} {r['median_step_s']:7.3f} {r['fill']:5.2f} "
              f"{r['extrapolated_600_s']:11.1f}")
    print(f"steady-state speed-up {names[-1]} over {names[0]} {out['speedup_steady']:.2f}x; max relative loss "
          f"difference {out['max_loss_rel_diff']:.1e}")
    return out


# ----------------------------------------------------------------------------------- Tunix sizes
TUNIX = dict(vocab=1024, hidden=128, layers=2, heads=4, kv_heads=4, head_dim=32, mlp=512, batch=8, seq=256)


def tunix_case(args):
    from codedance_jax.model.config import ModelConfig, TextConfig, VisionConfig

    s = TUNIX
    v = s["vocab"]
    cfg = ModelConfig(  # text-only batches: the (minimal) vision tower is never called
        vision=VisionConfig(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, window_size=56,
                            out_hidden_size=s["hidden"], fullatt_block_indexes=(0,)),
        text=TextConfig(vocab_size=v, hidden_size=s["hidden"], intermediate_size=s["mlp"], num_hidden_layers=s["layers"],
                        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], mrope_section=(4, 6, 6)),
        image_token_id=v - 1, video_token_id=v - 2, vision_start_token_id=v - 3, vision_end_token_id=v - 4,
        bos_token_id=1, eos_token_id=2, dtype="float32", param_dtype="float32",
    )
    oc = ml_collections.ConfigDict(dict(lr=1e-4, warmup_ratio=0.0, weight_decay=0.0, b1=0.9, b2=0.999, eps=1e-8,
                                        clip_norm=0.0, schedule="constant"))
    tx, sched = optim.make_optimizer(oc, 100)
    mesh = shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    mdef, state, sh = st.create_train_state(cfg, tx, mesh, seed=0)
    b, t = s["batch"], s["seq"]
    rng = np.random.default_rng(0)

    def batch():
        ids = rng.integers(3, v - 8, (b, t)).astype(np.int32)
        targets = np.concatenate([ids[:, 1:], np.zeros((b, 1), np.int32)], axis=1)
        loss = np.ones((b, t), np.float32)
        loss[:, -1] = 0
        return dict(input_ids=ids, attention_mask=np.ones((b, t), np.int32), targets=targets, loss_mask=loss,
                    positions=np.broadcast_to(np.arange(t, dtype=np.int32), (3, b, t)).copy())

    bsh = sft.batch_shardings(batch(), mesh)
    step = sft.make_train_step(mdef, tx, sched, sh, bsh, mesh)
    warm = 3

    def ours():
        nonlocal state
        times = []
        for _ in range(args.steps):
            x = batch()
            t0 = time.perf_counter()
            state, m = step(state, {k: jax.device_put(a, bsh[k]) for k, a in x.items()}, jax.random.key(0))
            jax.block_until_ready(m["loss"])
            times.append(time.perf_counter() - t0)
        return times

    # ours, Tunix, ours again: on a shared machine the load drifts, so ours brackets Tunix's run
    runs = [ours()]
    out = dict(sizes=s, ours_step_times=runs)
    print(f"\nTunix sizes, {b} x {t}: ours {statistics.median(runs[0][warm:]):.3f} s/step", flush=True)
    if args.tunix_python:
        cmd = [args.tunix_python, os.path.join(HERE, "tunix_sft.py"), "--steps", str(args.steps), "--warmup", str(warm),
               "--json", json.dumps(s)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            print(res.stderr[-3000:])
            out["tunix_error"] = res.stderr[-3000:]
        else:
            tx_res = json.loads(res.stdout.strip().splitlines()[-1])
            out["tunix"] = tx_res
            runs.append(ours())
            print(f"ours again: {statistics.median(runs[1][warm:]):.3f} s/step", flush=True)
            out["ours_step_s"] = statistics.mean(statistics.median(r[warm:]) for r in runs)
            out["ratio_vs_tunix"] = tx_res["step_s"] / out["ours_step_s"]
            print(f"tunix PeftTrainer: {tx_res['step_s']:.3f} s/step ({tx_res['tokens_per_s']:.0f} tok/s); ours (mean of "
                  f"the two runs) {out['ours_step_s']:.3f} s/step; ours / tunix rate {out['ratio_vs_tunix']:.2f}x")
    out.setdefault("ours_step_s", statistics.median(runs[0][warm:]))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="demo,tunix", help="comma list of: demo, tunix, meshes")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--configs", default="tiny,small", help="meshes: comma list of: " + ",".join(CONFIGS))
    ap.add_argument("--workdir", default="", help="demo: where the toy world is (generated when missing)")
    ap.add_argument("--pack", default="448,192,64", help="demo: the packed layout's row (tokens,image_tokens,windows)")
    ap.add_argument("--pack-row-multiple", type=int, default=4, help="demo: packed rows are a multiple of this")
    ap.add_argument("--variants", default="before,after",
                    help="demo, comma list (first vs last compared): before = padded, log-probs by the rematerialized chunk "
                         "map (the step before issue 14's SFT work); after = padded, the demo's step now; packed = "
                         "after with --pack rows")
    ap.add_argument("--tunix-python", default=os.environ.get("TUNIX_PYTHON", "/tmp/tunix-venv/bin/python"))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "sft_step_cpu.json"), help="meshes' JSON")
    ap.add_argument("--out-cases", default=os.path.join(HERE, "results", "sft_step.json"), help="demo/tunix JSON")
    args = ap.parse_args()
    cases = args.case.split(",")
    if args.tunix_python and not os.path.exists(args.tunix_python):
        args.tunix_python = None
    if "meshes" in cases:
        meshes_main(args)
    res = {"machine": f"{os.cpu_count()} CPU cores", "jax": jax.__version__}
    if "tunix" in cases:
        args.steps = args.steps or (8 if args.quick else 20)
        res["tunix_sizes"] = tunix_case(args)
    if "demo" in cases:
        args.steps = args.steps or (10 if args.quick else 60)
        res["demo"] = demo_case(args)
    if "tunix" in cases or "demo" in cases:
        res["load_avg_end"] = os.getloadavg()
        os.makedirs(os.path.dirname(args.out_cases), exist_ok=True)
        if os.path.exists(args.out_cases):  # keep the other case's last figures when one case runs
            with open(args.out_cases) as f:
                prev = json.load(f)
            res = {**{k: v for k, v in prev.items() if k not in res}, **res}
        with open(args.out_cases, "w") as f:
            json.dump(res, f, indent=2)
        print(f"wrote {args.out_cases}")


if __name__ == "__main__":
    main()
