"""The demo pipeline: toy world -> SFT -> eval (before) -> GRPO with R_BAT -> eval (after) -> report.

Every phase is the real component a user would launch on a pod, with the toy world's sizes:
`data.toyworld.generate_world` (expert trajectories executed in the sandbox), `runs.sft`
(TFDS + grain + the sharded SFT step; it exports WORKDIR/sft/policy), evaluation = greedy
multi-turn rollouts of the held-out split through `RolloutEngine` + `SandboxPool`, `runs.grpo`
(rollouts, R_BAT, GRPO update; exports WORKDIR/grpo/policy), and `demo.report`.

Workdir layout: world/ (world.json, sft/, rl/, eval/, processor/), sft/ (checkpoints, metrics.jsonl,
policy/), eval_sft/ and eval_grpo/ (trajectories.jsonl + images/, summary.json), grpo/ (checkpoints,
metrics.jsonl, policy/), report/ (report.md, report.html, summary.json, plots/). A phase whose
output exists is skipped, so a killed demo continues where it stopped (SFT and GRPO resume from
their checkpoints).
"""

from __future__ import annotations

import json
import os
import time

import ml_collections

FAMILY_KEYS = ("family", "difficulty")


def _log(msg: str):
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def world_dir(workdir: str) -> str:
    return os.path.join(workdir, "world")


def make_world(c, workdir: str) -> dict:
    from data.toyworld import generate_world

    path = os.path.join(world_dir(workdir), "world.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    w = c.world
    return generate_world(world_dir(workdir), n_sft=w.n_sft, n_rl=w.n_rl, n_eval=w.n_eval, seed=c.seed,
                          hard_frac=w.hard_frac, workers=w.workers, max_pixels=w.max_pixels,
                          easy_code_rate=w.easy_code_rate, error_rate=w.error_rate)


def sft_config(c, workdir: str) -> ml_collections.ConfigDict:
    from configs import sft as sft_configs

    s = sft_configs.get_config("tiny")
    s.model = "toy"
    s.processor_dir = os.path.join(world_dir(workdir), "processor")
    s.seed = c.seed
    s.batch_size, s.grad_accum, s.total_steps = c.sft.batch_size, 1, c.sft.steps
    s.optim.lr, s.optim.warmup_ratio = c.sft.lr, c.sft.warmup_ratio
    s.mesh.update(data=1, fsdp=-1, tensor=1)
    s.data.jsonl = (os.path.join(world_dir(workdir), "sft", "sft.jsonl"),)
    s.data.synthetic = 0
    s.data.max_pixels = c.world.max_pixels
    s.data.buckets = tuple(tuple(b) for b in c.sft.buckets)
    s.checkpoint.update(every_steps=max(1, c.sft.steps // 4), keep=2)
    s.log_every = max(1, c.sft.steps // 20)
    s.tensorboard = False
    s.export_policy = True
    return s


def grpo_config(c, workdir: str, policy: str, *, mode: str | None = None) -> ml_collections.ConfigDict:
    from configs import grpo as grpo_configs

    g = grpo_configs.get_config("tiny")
    p = c.grpo
    g.init_from = policy
    g.seed = c.seed
    g.prompts_per_step, g.group_size, g.total_steps, g.grad_accum = p.prompts_per_step, p.group_size, p.steps, p.grad_accum
    g.optim.update(lr=p.lr, warmup_ratio=0.0, schedule="constant")
    g.rbat.update(mode=mode or p.mode, preset=p.preset)
    g.rollout.update(max_turns=p.max_turns, max_turn_tokens=p.max_turn_tokens, max_new_tokens=p.max_new_tokens,
                     max_total_tokens=p.max_total_tokens, temperature=p.temperature,
                     obs_max_pixels=112 * 112, prompt_buckets=(128, 256), obs_buckets=(64, 192))
    g.sandbox.num_workers = p.sandbox_workers
    g.buckets = tuple(tuple(b) for b in p.buckets)
    g.data.update(jsonl=(os.path.join(world_dir(workdir), "rl", "prompts.jsonl"),), eval_jsonl=(), toyworld=False)
    g.eval.every = 0  # the demo evaluates before and after itself, on the whole held-out split
    g.metric_keys = FAMILY_KEYS[1:]
    g.checkpoint.update(every_steps=max(1, p.steps // 3), keep=2)
    g.log_every = 1
    return g


def evaluate_policy(c, policy: str, out_dir: str, pool) -> dict:
    """Greedy rollouts of the held-out split; writes trajectories.jsonl (+ `text`, `meta`) and summary.json."""
    import codedance_jax
    from codedance_jax.rollout import RolloutConfig, RolloutEngine, SamplingConfig, save_jsonl
    from codedance_jax.runs.grpo import evaluate
    from data.rl_prompts import read_prompts_jsonl

    summary_path = os.path.join(out_dir, "summary.json")
    if os.path.exists(summary_path):
        with open(summary_path) as f:
            return json.load(f)
    prompts = read_prompts_jsonl(os.path.join(world_dir(c.workdir_), "eval", "prompts.jsonl"))
    if c.eval.limit:
        prompts = prompts[: c.eval.limit]
    model, processor = codedance_jax.from_pretrained(policy)
    p = c.grpo
    rcfg = RolloutConfig.eval(max_turns=c.eval.max_turns, max_turn_tokens=p.max_turn_tokens,
                              max_new_tokens=p.max_new_tokens, max_total_tokens=p.max_total_tokens,
                              decode_chunk=16, obs_max_pixels=112 * 112, prompt_buckets=(128, 256),
                              obs_buckets=(64, 192), append_min_frac=0.5, policy=policy)
    engine = RolloutEngine(model, processor, rcfg, SamplingConfig(greedy=True, seed=c.seed))
    t0 = time.perf_counter()
    summary, trajs = evaluate(engine, prompts, pool, batch=c.eval.batch, keys=FAMILY_KEYS)
    summary["time_s"] = time.perf_counter() - t0
    os.makedirs(out_dir, exist_ok=True)
    path = save_jsonl(trajs, out_dir)
    by_id = {q.id: q for q in prompts}
    lines = []
    with open(path) as f:
        for line, t in zip(f, trajs, strict=True):
            rec = json.loads(line)
            q = by_id[t.prompt_id]
            rec["text"] = t.response_text(processor)
            rec["meta"] = {**q.meta, "question": q.question, "gold": q.answer}
            lines.append(json.dumps(rec))
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(summary_path, "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def _read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


def run(c, workdir: str) -> dict:
    """Runs every phase (skipping finished ones) and returns the report's summary."""
    from codedance_jax.demo.report import write_report
    from codedance_jax.runs import grpo as grpo_loop
    from codedance_jax.runs import sft as sft_loop

    workdir = os.path.abspath(workdir)
    os.makedirs(workdir, exist_ok=True)
    c = ml_collections.ConfigDict(c.to_dict())
    c.workdir_ = workdir
    timings = {}
    t_all = time.perf_counter()

    t0 = time.perf_counter()
    _log("1/5 toy world: generating tasks and running the expert's code in the sandbox")
    world = make_world(c, workdir)
    timings["world"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    sft_dir = os.path.join(workdir, "sft")
    sft_policy = os.path.join(sft_dir, "policy")
    if not os.path.exists(os.path.join(sft_policy, "codedance.json")):
        _log(f"2/5 SFT: {c.sft.steps} steps, batch {c.sft.batch_size}, from random init")
        sft_loop.train_and_evaluate(sft_config(c, workdir), sft_dir)
    timings["sft"] = time.perf_counter() - t0

    pool = grpo_loop.PoolThread(num_workers=c.grpo.sandbox_workers, timeout_s=10.0, memory_mb=1024)
    try:
        t0 = time.perf_counter()
        _log("3/5 evaluating the SFT policy on the held-out split")
        ev_sft = evaluate_policy(c, sft_policy, os.path.join(workdir, "eval_sft"), pool.pool)
        _log(f"    SFT: accuracy {ev_sft['accuracy']:.3f}, tool-call rate {ev_sft['tool_rate']:.3f}")
        timings["eval_sft"] = time.perf_counter() - t0
    finally:
        pool.close()

    t0 = time.perf_counter()
    grpo_dir = os.path.join(workdir, "grpo")
    grpo_policy = os.path.join(grpo_dir, "policy")
    if not os.path.exists(os.path.join(grpo_policy, "codedance.json")):
        _log(f"4/5 GRPO with R_BAT ({c.grpo.mode}): {c.grpo.steps} steps x {c.grpo.prompts_per_step} prompts "
             f"x {c.grpo.group_size} rollouts")
        grpo_loop.train_and_evaluate(grpo_config(c, workdir, sft_policy), grpo_dir)
    timings["grpo"] = time.perf_counter() - t0

    pool = grpo_loop.PoolThread(num_workers=c.grpo.sandbox_workers, timeout_s=10.0, memory_mb=1024)
    try:
        t0 = time.perf_counter()
        _log("5/5 evaluating the GRPO policy and writing the report")
        ev_grpo = evaluate_policy(c, grpo_policy, os.path.join(workdir, "eval_grpo"), pool.pool)
        timings["eval_grpo"] = time.perf_counter() - t0
    finally:
        pool.close()

    total = time.perf_counter() - t_all  # the report adds the phases up itself
    _log(f"all phases: {total / 60:.1f} min")
    paths = write_report(
        os.path.join(workdir, "report"),
        evals={"sft": ev_sft, "grpo": ev_grpo},
        eval_trajectories={"sft": os.path.join(workdir, "eval_sft", "trajectories.jsonl"),
                           "grpo": os.path.join(workdir, "eval_grpo", "trajectories.jsonl")},
        sft_metrics=_read_jsonl(os.path.join(sft_dir, "metrics.jsonl")),
        grpo_metrics=_read_jsonl(os.path.join(grpo_dir, "metrics.jsonl")),
        world=world, timings=timings, targets=dict(c.targets), examples_per_group=c.examples_per_group,
    )
    with open(paths["summary.json"]) as f:
        summary = json.load(f)
    with open(paths["report.md"]) as f:
        print(f.read(), flush=True)
    _log(f"report: {paths['report.html']}")
    return summary


ABLATION_ROWS = (  # paper Table 3 rows, in its order
    ("outcome", "GRPO (R_acc + R_format)"),
    ("tool_bonus", "DeepEyes-style tool reward"),
    ("no_turn", "R_BAT without R_turn"),
    ("full", "R_BAT (full)"),
)


def prepare_sft(c, workdir: str) -> tuple[dict, str]:
    """World and SFT policy (reused when they exist), as the demo makes them."""
    from codedance_jax.runs import sft as sft_loop

    world = make_world(c, workdir)
    sft_dir = os.path.join(workdir, "sft")
    policy = os.path.join(sft_dir, "policy")
    if not os.path.exists(os.path.join(policy, "codedance.json")):
        _log(f"SFT: {c.sft.steps} steps, batch {c.sft.batch_size}, from random init")
        sft_loop.train_and_evaluate(sft_config(c, workdir), sft_dir)
    return world, policy


def ablate(c, workdir: str, modes=tuple(m for m, _ in ABLATION_ROWS)) -> dict:
    """Table 3 on the toy world: the reward variants trained from the same SFT policy with the same
    seeds (same prompts per step, same sampling keys), each evaluated on the held-out split."""
    from codedance_jax.demo.report import fmt_metric
    from codedance_jax.runs import grpo as grpo_loop

    workdir = os.path.abspath(workdir)
    c = ml_collections.ConfigDict(c.to_dict())
    c.workdir_ = workdir
    _, sft_policy = prepare_sft(c, workdir)
    results = {}
    pool = grpo_loop.PoolThread(num_workers=c.grpo.sandbox_workers, timeout_s=10.0, memory_mb=1024)
    try:
        results["sft"] = evaluate_policy(c, sft_policy, os.path.join(workdir, "eval_sft"), pool.pool)
    finally:
        pool.close()
    for mode in modes:
        run_dir = os.path.join(workdir, "ablate", mode)
        policy = os.path.join(run_dir, "policy")
        if not os.path.exists(os.path.join(policy, "codedance.json")):
            _log(f"GRPO, reward {mode}: {c.grpo.steps} steps")
            grpo_loop.train_and_evaluate(grpo_config(c, workdir, sft_policy, mode=mode), run_dir)
        pool = grpo_loop.PoolThread(num_workers=c.grpo.sandbox_workers, timeout_s=10.0, memory_mb=1024)
        try:
            results[mode] = evaluate_policy(c, policy, os.path.join(workdir, "ablate", f"eval_{mode}"), pool.pool)
        finally:
            pool.close()
    names = {"sft": "SFT cold start", **dict(ABLATION_ROWS)}
    cols = ("accuracy", "avg_turns", "exec_success", "difficulty=easy/tool_rate", "difficulty=hard/tool_rate")
    lines = ["| reward | accuracy | avg turns | exec success | tool rate easy | tool rate hard |",
             "|---|---|---|---|---|---|"]
    for key, summ in results.items():
        cells = [fmt_metric(col.rpartition("/")[2] or col, summ.get(col, float("nan"))) for col in cols]
        lines.append(f"| {names.get(key, key)} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    with open(os.path.join(workdir, "ablation.md"), "w") as f:
        f.write(f"# Table 3 on the toy world ({c.grpo.steps} GRPO steps per row, seed {c.seed})\n\n{table}\n")
    with open(os.path.join(workdir, "ablation.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(table, flush=True)
    return results
