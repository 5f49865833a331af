"""The whole GRPO step, timed per stage, compilations counted (issue 14).

    python benchmarks/grpo_step.py [--quick] [--case demo|tunix|both] [--steps N] [--trace DIR]

Cases:
  demo   the demo's GRPO preset (`configs/demo.py` -> `demo.pipeline.grpo_config`): the toy model,
         8 prompts x 8 rollouts, <= 3 turns, the real sandbox (root), buckets and budgets as the
         demo's. A random-init toy model cannot write code, so every rollout replays a toy-world
         expert trajectory through the sampler (forced tokens cost a decode step like sampled
         ones; their log-probs are the policy's): even group members replay the expert's turns
         (code cells run in the sandbox, observations with images are appended), odd members
         answer at once. The stages are the loop's (`runs/grpo_stages.py`): rollout (prefill,
         vision, decode, appends, sandbox wait, host), scoring + advantages, batch, reference log-probs
         (0: no KL), update (its forward gives the old log-probs, checked against the sampler's). The
         first step compiles; the table shows the median of the later steps.
  tunix  text-only single turn at Tunix's test sizes (hidden 128, 2 layers, vocab 1024, fp32):
         16 rollouts of 32 tokens after a 64-token prompt, then the GRPO update. When
         `--tunix-python` points at a python with `google-tunix` (see benchmarks/requirements-bench.txt),
         `benchmarks/tunix_grpo.py` runs the same sizes there in a subprocess and the table shows both.

Prints tables; writes benchmarks/results/grpo_step.json. Absolute times on a shared machine are
noisy: compare ratios taken in one invocation.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from codedance_jax import sharding as shd  # noqa: E402
from codedance_jax.rl import rbat_advantages, scoring  # noqa: E402
from codedance_jax.rollout import RolloutEngine, SamplingConfig, rl_prompt  # noqa: E402
from codedance_jax.rollout.buckets import CompileCounter  # noqa: E402
from codedance_jax.train import grpo, optim, rl_batch, sft  # noqa: E402
from codedance_jax.train import state as st  # noqa: E402
from codedance_jax.train.batching import check_buckets  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
STAGES = ("prefill", "vision", "decode", "append", "sandbox_wait", "rollout_host", "rollout", "scoring", "batch",
          "logprob", "update", "step")


class GRPOStepper:
    """The loop's stages 2-7 on one process (the same library calls as `runs.grpo.train_step`)."""

    def __init__(self, gcfg, cfg, processor, *, seed=0):
        from runs.grpo import loss_config, rbat_config, rollout_config

        self.gcfg, self.cfg, self.processor = gcfg, cfg, processor
        self.mesh = shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])
        self.buckets = check_buckets(gcfg.buckets)
        self.rb_cfg, self.loss_cfg = rbat_config(gcfg.rbat), loss_config(gcfg.loss)
        self.tx, self.sched = optim.make_optimizer(gcfg.optim, 100)
        self.mdef, self.state, self.state_sh = st.create_train_state(cfg, self.tx, self.mesh, seed=seed)
        sampling = SamplingConfig(temperature=gcfg.rollout.temperature, seed=seed)
        self.engine = RolloutEngine(self.mdef.model(self.state.params), processor, rollout_config(gcfg), sampling)
        self.steps, self.lp_fns = {}, {}
        # With the KL term on (the demo's loss.kl_coef), the frozen reference is the initial policy.
        self.ref_params = jax.tree.map(jnp.copy, self.state.params) if self.loss_cfg.kl_coef > 0 else None

    def step(self, i, prompts, golds, group, pool, script):
        t = {}
        c0 = CompileCounter.total()
        t_step = time.perf_counter()
        self.engine.set_model(self.mdef.model(self.state.params))
        t0 = time.perf_counter()
        trajs, rs = self.engine.rollout(prompts, group_size=group, sandbox=pool, script=script,
                                        seed_offset=i * len(prompts) * group)
        t["rollout"] = time.perf_counter() - t0
        t.update(prefill=rs.prefill_s, vision=rs.vision_s, decode=rs.decode_s, append=rs.append_s,
                 sandbox_wait=rs.device_wait_s, rollout_host=rs.host_s)
        t0 = time.perf_counter()
        g = [x for x in golds for _ in range(group)]
        sc = scoring.score(trajs, g, self.processor, max_turns=self.engine.cfg.max_turns, cfg=self.rb_cfg)
        a_seq, a_turn = (np.asarray(x) for x in rbat_advantages(sc.acc, sc.fmt_ok, sc.turn_is_tool, sc.turn_failed,
                                                                 group_size=group, cfg=self.rb_cfg))
        t["scoring"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        exs = [rl_batch.trajectory_example(tr, self.processor, self.cfg, self.buckets) for tr in trajs]
        local = rl_batch.grpo_batch(trajs, self.processor, self.cfg, self.buckets, a_seq, a_turn, examples=exs)
        local.pop("num_tokens", None)
        bsh = sft.batch_shardings(local, self.mesh)
        gb = {k: jax.device_put(v, bsh[k]) for k, v in local.items()}
        t["batch"] = time.perf_counter() - t0
        # Old log-probs: the update's own forward (one update per batch; `grpo_train_step(old_from_forward=)`),
        # as in the loop; the logprob stage is the reference's forward, when the KL term is on.
        key = tuple((k, v.shape) for k, v in sorted(local.items()))
        t0 = time.perf_counter()
        if self.ref_params is not None:
            lp_in = {k: v for k, v in gb.items() if k in sft.BATCH_FIELDS}
            if key not in self.lp_fns:
                lp_bsh = {k: v for k, v in bsh.items() if k in sft.BATCH_FIELDS}
                self.lp_fns[key] = grpo.make_logprob_fn(self.mdef, self.state_sh.params, lp_bsh, self.mesh,
                                                        temperature=self.gcfg.rollout.temperature)
            gb["ref_logprobs"] = jax.block_until_ready(self.lp_fns[key](self.ref_params, lp_in))
            bsh["ref_logprobs"] = bsh["old_logprobs"]
        t["logprob"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        if key not in self.steps:
            self.steps[key] = grpo.make_grpo_step(self.mdef, self.tx, self.sched, self.loss_cfg, self.state_sh, bsh,
                                                  self.mesh, accum_steps=int(self.gcfg.grad_accum),
                                                  temperature=self.gcfg.rollout.temperature, old_from_forward=True)
        self.state, m = self.steps[key](self.state, gb, jax.random.key(i))
        m = jax.device_get(m)
        mismatch = float(m["logprob_mismatch"])
        t["update"] = time.perf_counter() - t0
        t["step"] = time.perf_counter() - t_step
        return dict(times=t, compiles=CompileCounter.total() - c0, mismatch=mismatch,
                    tokens=int(sum(len(tr.tokens) for tr in trajs)), trained=int(local["loss_mask"].sum()),
                    batch_shape=list(local["input_ids"].shape), gen_tokens=rs.generated_tokens,
                    packed_rows=(-(-local["pack_src"].size // local["input_ids"].shape[1]) if "pack_src" in local else None),
                    appends=rs.appends, decode_chunks=rs.decode_chunks, loss=float(m["loss"]))


def summarize(rows):
    later = rows[1:] or rows
    med = {k: statistics.median(r["times"][k] for r in later) for k in STAGES}
    return dict(first_step_s=rows[0]["times"]["step"], median=med, first_compiles=rows[0]["compiles"],
                later_compiles=sum(r["compiles"] for r in rows[1:]),
                max_logprob_mismatch=max(r["mismatch"] for r in rows), steps=rows)


def print_table(title, summ):
    print(f"\n{title}: first step {summ['first_step_s']:.2f} s ({summ['first_compiles']} compilations), "
          f"later steps {summ['later_compiles']} compilations, max |recomputed - sampled| log-prob "
          f"{summ['max_logprob_mismatch']:.2e}")
    print(" ".join(f"{k:>12}" for k in STAGES))
    print(" ".join(f"{summ['median'][k]:12.3f}" for k in STAGES))


# ----------------------------------------------------------------------------------- demo preset
def demo_case(args):
    from configs import demo as demo_configs
    from data.toyworld import generate_world, toy_model_config
    from runs.demo import pipeline
    from sandbox import SandboxPool

    c = demo_configs.get_config()
    n_prompts, group = (4, 4) if args.quick else (int(c.grpo.prompts_per_step), int(c.grpo.group_size))
    work = tempfile.mkdtemp(prefix="grpo_step_")
    gcfg = pipeline.grpo_config(c, work, policy="")
    gcfg.prompts_per_step, gcfg.group_size = n_prompts, group
    from codedance_jax.processing import Processor

    sb = c.grpo.sandbox
    with SandboxPool(num_workers=int(sb.num_workers), timeout_s=float(sb.timeout_s), memory_mb=int(sb.memory_mb)) as pool:
        world = os.path.join(work, "world")
        generate_world(world, n_sft=n_prompts, n_rl=1, n_eval=1, seed=0, pool=pool, max_pixels=c.world.max_pixels)
        processor = Processor.from_pretrained(os.path.join(world, "processor"), padding_side="left")
        cfg = toy_model_config(os.path.join(world, "processor")).replace(dtype=gcfg.dtype, param_dtype=gcfg.param_dtype,
                                                                         remat=gcfg.remat)
        from PIL import Image

        with open(os.path.join(world, "sft", "sft.jsonl")) as f:
            recs = [json.loads(x) for x in f if x.strip()]
        prompts, golds, scripts = [], [], []
        for rec in recs[:n_prompts]:
            im = Image.open(os.path.join(world, "sft", rec["images"][0])).convert("RGB")
            prompts.append(rl_prompt(processor, rec["id"], rec["meta"]["question"], [im]))
            golds.append(str(rec["meta"]["answer"]))
            scripts.append([m["content"] for m in rec["messages"] if m["role"] == "assistant"])

        def script(row, turn):
            turns = scripts[row // group]
            if (row % group) % 2:  # answer at once with the expert's final turn
                return turns[-1] if turn == 0 else None
            return turns[turn] if turn < len(turns) else None

        stepper = GRPOStepper(gcfg, cfg, processor)
        rows = []
        for i in range(args.steps):
            last = args.trace and i == args.steps - 1
            with jax.profiler.trace(args.trace, create_perfetto_trace=True) if last else contextlib.nullcontext():
                rows.append(stepper.step(i, prompts, golds, group, pool, script))
            print(f"demo step {i}: {rows[-1]['times']['step']:.2f} s, {rows[-1]['compiles']} compilations, "
                  f"batch {rows[-1]['batch_shape']} (packed rows {rows[-1]['packed_rows']})", flush=True)
    out = summarize(rows)
    out.update(prompts=n_prompts, group=group, model_params=int(sum(x.size for x in jax.tree.leaves(stepper.state.params))))
    print_table(f"demo GRPO preset ({n_prompts} prompts x {group}, real sandbox)", out)
    return out


# ----------------------------------------------------------------------------------- Tunix sizes
TUNIX = dict(vocab=1024, hidden=128, layers=2, heads=4, kv_heads=4, head_dim=32, mlp=512, prompt=64, gen=32,
             prompts=2, group=8)


def tunix_case(args):
    from codedance_jax.model.config import ModelConfig, TextConfig, VisionConfig
    from codedance_jax.processing import Processor
    from data.toyworld import write_toy_processor_files

    s = TUNIX
    work = tempfile.mkdtemp(prefix="grpo_tunix_")
    rng = np.random.default_rng(0)
    corpus = [" ".join(str(x) for x in rng.integers(0, 10_000, 400)) for _ in range(50)]
    write_toy_processor_files(work, corpus, vocab_size=s["vocab"] - 64)
    processor = Processor.from_pretrained(work, padding_side="left")
    n_tok = len(processor.tokenizer)
    cfg = ModelConfig(
        vision=VisionConfig(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, window_size=56,
                            out_hidden_size=s["hidden"], fullatt_block_indexes=(0,)),
        text=TextConfig(vocab_size=max(s["vocab"], -(-n_tok // 64) * 64), hidden_size=s["hidden"], intermediate_size=s["mlp"],
                        num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                        num_key_value_heads=s["kv_heads"], mrope_section=(4, 6, 6)),
        image_token_id=processor.tokenizer.token_to_id("<|image_pad|>"),
        video_token_id=processor.tokenizer.token_to_id("<|video_pad|>"),
        vision_start_token_id=processor.tokenizer.token_to_id("<|vision_start|>"),
        vision_end_token_id=processor.tokenizer.token_to_id("<|vision_end|>"),
        eos_token_id=processor.tokenizer.token_to_id("<|im_end|>"),
        dtype="float32", param_dtype="float32",
    )
    gcfg = _tunix_grpo_config(s)
    from codedance_jax.rollout import Prompt

    prompts = []
    for i in range(s["prompts"]):
        ids = rng.integers(10, processor.tokenizer.token_to_id("<|endoftext|>"), s["prompt"]).tolist()  # no specials
        text = processor.decode(ids)
        while len(processor.tokenizer.encode(text)) > s["prompt"]:  # BPE may re-merge decoded text
            ids = ids[:-1]
            text = processor.decode(ids)
        prompts.append(Prompt(f"p{i}", text, []))
    stepper = GRPOStepper(gcfg, cfg, processor)

    def ours(first):
        rows = []
        for i in range(first, first + args.steps):
            last = args.trace and first == 0 and i == args.steps - 1  # a jax.profiler trace of the first run's last step
            with jax.profiler.trace(args.trace, create_perfetto_trace=True) if last else contextlib.nullcontext():
                rows.append(stepper.step(i, prompts, ["0"] * len(prompts), s["group"], None, None))
        return rows

    # ours, Tunix, ours again: on a shared machine the load drifts, so ours brackets Tunix's run and
    # the figures compared are the mean of our two medians (the first run's first step compiles).
    rows = ours(0)
    out = summarize(rows)
    out["sizes"] = s
    out["rollout_tok_per_s"] = statistics.median(r["gen_tokens"] / r["times"]["rollout"] for r in rows[1:] or rows)
    print_table("Tunix sizes, ours", out)
    print(f"ours: rollout {out['median']['rollout']:.3f} s ({out['rollout_tok_per_s']:.0f} tok/s), "
          f"update {out['median']['update']:.3f} s, step {out['median']['step']:.3f} s", flush=True)
    if args.tunix_python:
        cmd = [args.tunix_python, os.path.join(HERE, "tunix_grpo.py"), "--steps", str(args.steps),
               "--json", json.dumps(s)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            print(res.stderr[-3000:])
            out["tunix_error"] = res.stderr[-3000:]
        else:
            tx = json.loads(res.stdout.strip().splitlines()[-1])
            out["tunix"] = tx
            again = ours(args.steps)
            out["steps_again"] = again
            med2 = {k: statistics.median(r["times"][k] for r in again) for k in STAGES}
            out["median_again"] = med2
            out["median_bracket"] = {k: (out["median"][k] + med2[k]) / 2 for k in STAGES}
            print(f"ours again: rollout {med2['rollout']:.3f} s, update {med2['update']:.3f} s, step {med2['step']:.3f} s")
            print(f"tunix: rollout {tx['rollout_s']:.3f} s ({tx['rollout_tok_per_s']:.0f} tok/s), update "
                  f"{tx['update_s']:.3f} s, step {tx['step_s']:.3f} s")
            mb = out["median_bracket"]
            # Tunix's "update" is its step minus its rollout; ours is the same span (batch, scoring and update)
            ours_update = mb["step"] - mb["rollout"]
            out["ratio_vs_tunix"] = {"rollout": tx["rollout_s"] / mb["rollout"], "update": tx["update_s"] / ours_update,
                                     "step": tx["step_s"] / mb["step"]}
            print(f"ours (mean of the two medians): rollout {mb['rollout']:.3f} s, step - rollout {ours_update:.3f} s, "
                  f"step {mb['step']:.3f} s (load avg {os.getloadavg()[0]:.1f})")
            print("ours / tunix rate:", {k: round(v, 2) for k, v in out["ratio_vs_tunix"].items()})
    return out


def _tunix_grpo_config(s):
    from configs import grpo as grpo_configs

    g = grpo_configs.get_config("tiny")
    g.prompts_per_step, g.group_size = s["prompts"], s["group"]
    g.rollout.update(max_turns=1, max_turn_tokens=s["gen"], max_new_tokens=s["gen"], max_total_tokens=2 * s["prompt"] + s["gen"],
                     decode_chunk=s["gen"], batch_multiple=8, prompt_buckets=(s["prompt"], 2 * s["prompt"]),
                     obs_buckets=(16,))
    g.buckets = ((s["prompt"] + s["gen"], 4, 1), (2 * s["prompt"] + s["gen"], 4, 1))  # text only: a minimal vision bucket
    g.optim.update(lr=1e-5, warmup_ratio=0.0, schedule="constant")
    return g


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="both", choices=("demo", "tunix", "both"))
    ap.add_argument("--quick", action="store_true", help="4 prompts x 4 in the demo case, 3 steps")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--tunix-python", default=os.environ.get("TUNIX_PYTHON", "/tmp/tunix-venv/bin/python"))
    ap.add_argument("--trace", default=None, help="a jax.profiler trace of the last step (tunix: of our first run) into this directory")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "grpo_step.json"))
    args = ap.parse_args()
    args.steps = args.steps or (3 if args.quick else 5)
    if args.tunix_python and not os.path.exists(args.tunix_python):
        args.tunix_python = None
    res = {"platform": platform.platform(), "devices": str(jax.devices()[0]), "quick": args.quick}
    if args.case in ("tunix", "both"):
        res["tunix_sizes"] = tunix_case(args)
    if args.case in ("demo", "both"):
        res["demo"] = demo_case(args)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    if os.path.exists(args.out):  # keep the other case's last figures when one case runs
        with open(args.out) as f:
            prev = json.load(f)
        res = {**{k: v for k, v in prev.items() if k not in res}, **res}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2, default=str)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
