"""`train_and_evaluate` for GRPO: rollouts through the sandbox, R_BAT, sharded updates, eval.

One step, each stage a function of `runs/grpo_stages.py` with a typed result:
  1. prompts: `PromptSchedule` picks this step's prompts (stateless: resume draws the same ones);
  2. rollout: `RolloutEngine` samples prompts x group_size trajectories with the current policy,
     code runs in the `SandboxPool` (owned by a `sandbox.PoolThread`);
  3. scores and advantages: R_acc, format, per-turn execution status (`rl.scoring`), then
     `rbat_advantages` on the global batch (jit kernel; reward parts for the logs), and which
     trajectories train (`config.filter`: dynamic sampling, masking of truncated ones);
  4. batch: trajectories -> the GRPO batch padded to a bucket (`train.rl_batch`);
  5. the frozen reference's log-probs when KL is on (the old policy's are the update's own forward:
     one update per batch, so a separate recompute, as verl's, would run the same forward twice);
  6. update: `train.grpo.grpo_train_step` (jitted, sharded, micro-batched); with
     `config.async_rollout=1` the next step's rollout runs meanwhile (`runs/grpo_overlap.py`);
  7. metrics (`runs/grpo_metrics.py`), evaluation on held-out prompts every `eval.every` steps
     (`eval.rollouts.evaluate`, the evaluation the demo and `launch.eval` use too), then the
     checkpoint (orbax, with the step number: prompts and sampling keys follow from it). Rows are
     written before the checkpoint and a resumed run drops those past it, so a kill loses nothing
     and duplicates nothing.
Before step 1, optionally (`config.data.filter_pass`): the difficulty filter keeps the RL prompts
the initial policy sometimes answers correctly (`filter_prompts`).
Setup (model, initial weights, state, checkpointer, metric writer, jit caches) is `runs.setup`'s,
shared with SFT. Each process rolls out its share of the prompts on its sampling mesh
(`config.rollout.mesh_data` of its own devices, all by default: rows split over `data`, the policy
replicated over it or split over groups of `config.rollout.mesh_tensor` devices, placed device to
device each step), the R_BAT statistics are taken over all hosts' trajectories, and the update
runs on the global mesh. Each step's rollout stats, with the placement (`sampling_devices`,
`sampling_mesh`: {data, fsdp, tensor}), go to WORKDIR/rollout_stats.jsonl (process h > 0:
rollout_stats.host<h>.jsonl).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time

import jax
import numpy as np

from codedance_jax.compile_watch import UnplannedCompiles
from codedance_jax.errors import ConfigError
from codedance_jax.rl import GRPOLossConfig, RBATConfig, selection
from codedance_jax.rollout import RolloutConfig, RolloutEngine, SamplingConfig
from codedance_jax.rollout.buckets import CompileCounter
from codedance_jax.rollout.placement import rollout_sampling_mesh
from codedance_jax.train import optim, run_record
from codedance_jax.train.batching import check_buckets
from codedance_jax.train.metrics import drop_rows_after
from runs import grpo_overlap, grpo_plan, setup
from runs import grpo_stages as stages
from runs.grpo_metrics import metrics_row
from runs.grpo_stages import GRPOContext, rollout_model

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------- config
def rbat_config(c, *, max_new_tokens: int | None = None) -> RBATConfig:
    """config.rbat -> RBATConfig; `max_new_tokens` (the rollout budget) is L_max of the overlong
    shaping when `overlong_max` is None."""
    presets = {"paper": RBATConfig.paper, "release": RBATConfig.release}
    if c.preset not in presets:
        raise ConfigError(f"config.rbat.preset={c.preset!r}: choose paper (the paper's formulas) or release "
                          f"(the released code's; SPEC, R_BAT presets)")
    base = presets[c.preset]
    optional = {k: float(c[k]) for k in ("seq_eps", "w_turn") if c.get(k) is not None}  # None: the preset's
    # Switches beyond the presets (absent from an older config: the paper's defaults).
    optional.update({k: c[k] for k in ("seq_norm", "turn_stats", "turn_baseline", "mastered") if c.get(k) is not None})
    cache = int(c.get("overlong_cache", 0) or 0)
    if cache:
        l_max = c.get("overlong_max") or max_new_tokens
        if not l_max:
            raise ConfigError(f"config.rbat.overlong_cache={cache}: set config.rbat.overlong_max (L_max) or the "
                              "rollout budget config.rollout.max_new_tokens")
        optional.update(overlong_cache=cache, overlong_max=int(l_max))
    return base(mode=c.mode, gamma=float(c.gamma), delta=float(c.delta), beta=float(c.beta), **optional)


def loss_config(c, *, max_new_tokens: int | None = None) -> GRPOLossConfig:
    """config.loss -> GRPOLossConfig; `max_new_tokens` is Dr. GRPO's constant L when `norm_length`
    is None."""
    optional = {k: float(c[k]) for k in ("clip_eps_low", "clip_eps_high") if c.get(k) is not None}
    if c.get("ratio") is not None:
        optional["ratio"] = c.ratio
    if c.aggregation == "seq_sum_norm":
        length = c.get("norm_length") or max_new_tokens
        if not length:
            raise ConfigError("config.loss.aggregation='seq_sum_norm' needs the constant L: set "
                              "config.loss.norm_length or config.rollout.max_new_tokens")
        optional["norm_length"] = int(length)
    try:
        return GRPOLossConfig(clip_eps=float(c.clip_eps), aggregation=c.aggregation, kl_coef=float(c.kl_coef), **optional)
    except ValueError as e:
        raise ConfigError(f"config.loss: {e}") from None


def filter_config(config) -> dict:
    """config.filter and config.data.filter_pass, checked: {"groups", "mask_truncated", "filter_pass",
    "filter_samples"} (filter_pass None = off)."""
    f = config.get("filter") or {}
    groups = f.get("groups", "off")
    if groups not in selection.GROUP_FILTERS:
        raise ConfigError(f"config.filter.groups={groups!r}: choose one of {selection.GROUP_FILTERS}")
    band = tuple(config.data.get("filter_pass", ()) or ())
    k = int(config.data.get("filter_samples", 8))
    if band and (len(band) != 2 or not band[0] < band[1] or k < 1):
        raise ConfigError(f"config.data.filter_pass={band}, filter_samples={k}: give (lo, hi) with lo < hi and k >= 1, "
                          "e.g. --config.data.filter_pass=0.0,1.0 (or () for off)")
    return {"groups": groups, "mask_truncated": bool(f.get("mask_truncated", False)),
            "filter_pass": tuple(float(x) for x in band) or None, "filter_samples": k}


def rollout_config(config, *, evaluation: bool = False) -> RolloutConfig:
    if evaluation:
        return RolloutConfig.from_block(config.rollout, evaluation=True, max_turns=int(config.eval.max_turns))
    return RolloutConfig.from_block(config.rollout)


def rollout_mesh(config) -> jax.sharding.Mesh:
    """The host's sampling mesh: `config.rollout.mesh_data` x `mesh_tensor` of this process's own
    devices as (data, 1, tensor), checked against `rollout.batch_multiple`
    (`placement.rollout_sampling_mesh`)."""
    return rollout_sampling_mesh(config.rollout)


def prepare_files(config, workdir: str) -> dict:
    """Process 0 builds the prompt datasets (and the toy world when asked); all wait at a barrier.
    Returns the paths the run reads."""
    d = config.data
    jsonl, eval_jsonl = list(d.jsonl), list(d.eval_jsonl)
    world = os.path.join(workdir, "world")
    processor_dir = config.init_from or config.processor_dir
    if not jsonl and d.toyworld:
        jsonl, eval_jsonl = [os.path.join(world, "rl", "prompts.jsonl")], [os.path.join(world, "eval", "prompts.jsonl")]
        processor_dir = processor_dir or os.path.join(world, "processor")
    if not jsonl:
        raise ConfigError("no RL prompts: set --config.data.jsonl=FILE[,FILE] (data/rl_prompts.py format) "
                         "or --config.data.toyworld=True to generate the toy world")
    if not processor_dir:
        raise ConfigError("no tokenizer: set --config.init_from=CHECKPOINT or --config.processor_dir=DIR")
    tfds_dir = d.tfds_dir or os.path.join(workdir, "tfds")

    def build():
        if d.toyworld and not os.path.exists(os.path.join(world, "world.json")) and not list(d.jsonl):
            from data.toyworld import generate_world

            n_sft, n_rl, n_eval = (int(x) for x in d.toy_sizes)
            generate_world(world, n_sft=n_sft, n_rl=n_rl, n_eval=n_eval, seed=config.seed)
        from data import rl_prompts

        rl_prompts.build_prompts(jsonl, tfds_dir, d.name)
        if eval_jsonl:
            rl_prompts.build_prompts(eval_jsonl, tfds_dir, d.eval_name)

    setup.on_process_zero("grpo_files_ready", build)
    return {"tfds_dir": tfds_dir, "processor_dir": processor_dir, "has_eval": bool(eval_jsonl)}


def open_context(config, workdir: str, run_setup) -> tuple[GRPOContext, setup.Run, RolloutEngine, list]:
    """Everything a step reads: processor, model, mesh, state (restored), prompt source, engines,
    the sandbox pool. `run_setup` collects what must be closed (an ExitStack)."""
    from codedance_jax.checkpoint.background import BackgroundExport
    from codedance_jax.processing import Processor
    from data import rl_prompts
    from eval.tool_analytics import record_step
    from sandbox import PoolThread

    rules, mesh = setup.sharding_rules(config), setup.make_mesh(config)
    sampler_mesh = rollout_mesh(config)
    budget = int(config.rollout.max_new_tokens)  # config errors before any work
    rb_cfg, loss_cfg = rbat_config(config.rbat, max_new_tokens=budget), loss_config(config.loss, max_new_tokens=budget)
    filter_config(config)
    files = prepare_files(config, workdir)
    processor = Processor.from_pretrained(files["processor_dir"], padding_side="left")
    cfg = setup.model_config(config, files["processor_dir"])
    hosts, g = jax.process_count(), int(config.group_size)
    if config.prompts_per_step % hosts:
        raise ConfigError(f"config.prompts_per_step={config.prompts_per_step} must divide over {hosts} processes")
    shards = mesh.shape["data"] * mesh.shape["fsdp"] * config.grad_accum
    rows = -(-config.prompts_per_step * g // shards) * shards  # global rows, padded to divide the mesh
    if rows % hosts:
        raise ConfigError(f"{rows} batch rows do not divide over {hosts} processes; change prompts_per_step")
    buckets = check_buckets(config.buckets)
    tx, sched = optim.make_optimizer(config.optim, config.total_steps)
    # With the KL term on, the frozen reference is the initial policy (also for a resumed run).
    run = setup.open_run(config, workdir, cfg, mesh, rules, tx, params=setup.initial_params(config, mesh, rules),
                         keep_initial=loss_cfg.kl_coef > 0)
    run_setup.callback(run.close)
    run_record.remember(config, workdir, "grpo")
    if jax.process_index() == 0:  # the resumed run writes these again (MetricWriter does metrics.jsonl)
        drop_rows_after(os.path.join(workdir, "eval.jsonl"), run.start)
        for name in os.listdir(workdir):
            if name.startswith("trajectories") and name.endswith(".jsonl"):
                drop_rows_after(os.path.join(workdir, name), run.start, step_of=lambda r: record_step(r) or 0)
    drop_rows_after(os.path.join(workdir, stats_file()), run.start)  # each process its own
    ref_params = run.initial_params
    source = rl_prompts.open_prompts(files["tfds_dir"], config.data.name)
    eval_prompts = []
    if files["has_eval"]:
        es = rl_prompts.open_prompts(files["tfds_dir"], config.data.eval_name)
        n = len(es) if not config.eval.limit else min(len(es), int(config.eval.limit))
        eval_prompts = [rl_prompts.to_prompt(es[i]) for i in range(n)]
    exporter = run_setup.enter_context(BackgroundExport())  # closed (joined) before the run's files
    pool = run_setup.enter_context(PoolThread(num_workers=config.sandbox.num_workers,
                                              timeout_s=config.sandbox.timeout_s, memory_mb=config.sandbox.memory_mb))
    model = rollout_model(run.mdef, run.state.params, sampler_mesh, rules)
    engine = RolloutEngine(model, processor, dataclasses.replace(rollout_config(config), policy=policy_path(workdir)),
                           SamplingConfig(temperature=config.rollout.temperature, top_p=config.rollout.top_p,
                                          top_k=config.rollout.top_k, seed=config.seed), mesh=sampler_mesh)
    eval_engine = RolloutEngine(model, processor, rollout_config(config, evaluation=True),
                                SamplingConfig(greedy=True, seed=config.seed), mesh=sampler_mesh)
    ctx = GRPOContext(config, workdir, processor, cfg, mesh, rules, tx, sched, rb_cfg, loss_cfg,
                      buckets, source, rl_prompts.PromptSchedule(len(source), config.prompts_per_step, config.seed),
                      engine, pool, rows, exporter, ref_params, sampling_mesh=sampler_mesh,
                      layout=grpo_plan.layout(config, rows // hosts, mesh.shape["data"] * mesh.shape["fsdp"]))
    return ctx, run, eval_engine, eval_prompts


class PromptSubset:
    """The prompt source restricted to `kept` indices (random access, as the TFDS source)."""

    def __init__(self, source, kept):
        self.source, self.kept = source, [int(i) for i in kept]

    def __len__(self) -> int:
        return len(self.kept)

    def __getitem__(self, i: int):
        return self.source[self.kept[i]]


def filter_prompts(ctx: GRPOContext, run: setup.Run) -> GRPOContext:
    """The difficulty filter of the RL split (`config.data.filter_pass` = (lo, hi), off when empty):
    before step 1 the initial policy samples `filter_samples` (k) rollouts of every RL prompt
    (`stages.pass_counts`) and the prompts with lo < passes/k < hi are kept
    (`rl.selection.keep_by_pass_rate`); the schedule then draws from those. The result is written to
    WORKDIR/prompt_filter.json, which a resumed run reads (its policy is no longer the initial one)."""
    from data import rl_prompts

    fc = filter_config(ctx.config)
    if fc["filter_pass"] is None:
        return ctx
    (lo, hi), k = fc["filter_pass"], fc["filter_samples"]
    path = os.path.join(ctx.workdir, "prompt_filter.json")
    if os.path.exists(path):
        with open(path) as f:
            rec = json.load(f)
        if (rec["k"], tuple(rec["filter_pass"]), rec["num_prompts"]) != (k, (lo, hi), len(ctx.source)):
            raise ConfigError(f"{path} was made with filter_samples={rec['k']}, filter_pass={rec['filter_pass']} "
                              f"over {rec['num_prompts']} prompts; this run asks for {k}, {(lo, hi)} over "
                              f"{len(ctx.source)}: use a fresh workdir or the first run's settings")
    elif run.start > 0:
        raise ConfigError(f"config.data.filter_pass={(lo, hi)} but the run resumes at step {run.start} without {path}: "
                          "the filter needs the initial policy; start in a fresh workdir")
    else:
        t0 = time.perf_counter()
        passes = stages.pass_counts(ctx, run, k)
        kept = np.flatnonzero(selection.keep_by_pass_rate(passes, k, lo, hi))
        rec = {"k": k, "filter_pass": [lo, hi], "num_prompts": len(ctx.source), "kept": kept.tolist(),
               "passes": passes.tolist(), "time_s": time.perf_counter() - t0}
        if ctx.host == 0:
            with open(path, "w") as f:
                json.dump(rec, f)
        run.writer.write(0, {"filter/prompts_kept": float(len(kept)), "filter/prompts_total": float(len(ctx.source)),
                             "filter/initial_pass_rate": float(np.mean(passes) / k), "filter/time_s": rec["time_s"]})
    kept = rec["kept"]
    msg = (f"difficulty filter: kept {len(kept)} of {rec['num_prompts']} RL prompts "
           f"({lo} < passes/{k} < {hi} under the initial policy)")
    log.info(msg)
    if ctx.host == 0:
        print(msg, flush=True)
    if not kept:
        raise ConfigError(f"config.data.filter_pass={(lo, hi)}: no RL prompt left ({path}); widen the band or raise "
                          "config.data.filter_samples")
    return dataclasses.replace(ctx, source=PromptSubset(ctx.source, kept),
                               schedule=rl_prompts.PromptSchedule(len(kept), ctx.config.prompts_per_step, ctx.config.seed))


def stats_file() -> str:
    """This process's rollout stats file in the workdir: one JSON row per step (`write_rollout_stats`)."""
    h = jax.process_index()
    return "rollout_stats.jsonl" if h == 0 else f"rollout_stats.host{h}.jsonl"


def write_rollout_stats(workdir: str, step: int, stats) -> None:
    """Appends this process's rollout stats of `step` (the metrics row's step): timings and counts
    (`RolloutStats.as_dict`), and where it ran: `sampling_devices`, `sampling_mesh`."""
    with open(os.path.join(workdir, stats_file()), "a") as f:
        f.write(json.dumps({"step": step, "host": jax.process_index(), **stats.as_dict()}) + "\n")


def policy_path(workdir: str) -> str:
    return os.path.join(workdir, "policy")


def run_evaluation(ctx: GRPOContext, run: setup.Run, engine: RolloutEngine, prompts: list, step: int) -> dict | None:
    """Greedy rollouts of the held-out prompts with the current policy; `eval/*` metrics, eval.jsonl."""
    from eval.rollouts import evaluate

    if not prompts:
        return None
    t0, c0 = time.perf_counter(), CompileCounter.total()
    engine.set_model(rollout_model(run.mdef, run.state.params, ctx.sampling_mesh, ctx.rules))
    res = evaluate(engine, prompts, ctx.pool, batch=int(ctx.config.eval.batch), keys=tuple(ctx.config.metric_keys))
    engine.release()  # its own engine: the cache and weights are not kept through the next steps
    summary = {f"eval/{k}": v for k, v in res.summary.items()}
    summary["eval/time_s"] = time.perf_counter() - t0
    summary["eval/compilations"] = float(CompileCounter.total() - c0)
    run.writer.write(step, summary)
    if ctx.host == 0:
        with open(os.path.join(ctx.workdir, "eval.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, **summary}) + "\n")
        print(f"eval @ step {step}: accuracy {summary.get('eval/accuracy', float('nan')):.3f} "
              f"turns {summary.get('eval/avg_turns', float('nan')):.2f} "
              f"exec_success {summary.get('eval/exec_success', float('nan')):.3f}", flush=True)
    return summary


# ----------------------------------------------------------------------------------- the loop
def train_and_evaluate(config, workdir: str) -> dict:
    """Runs GRPO to `config.total_steps`, resuming from the latest checkpoint in `workdir`."""
    workdir = os.path.abspath(workdir)
    run_record.check(config, workdir, "grpo")
    overlap = grpo_overlap.enabled(config)  # a config error before any work
    with contextlib.ExitStack() as closing:  # the run's files, then the sandbox pool, closed on any exit
        ctx, run, eval_engine, eval_prompts = open_context(config, workdir, closing)
        ctx = filter_prompts(ctx, run)
        warm_up(ctx, run, eval_engine, eval_prompts)
        # Every program is compiled: from here on, a compilation is a shape outside the plan (a
        # warning naming it, and the step's `compilations`).
        closing.enter_context(UnplannedCompiles())
        ahead = grpo_overlap.RolloutAhead(ctx, run) if overlap else None
        if ahead is not None:
            closing.callback(ahead.close)  # before the sandbox pool closes
        history, last_eval, ckpt_s = [], None, 0.0
        if run.start and config.eval.every and _eval_due(config, run.start) and not _has_eval(workdir, run.start):
            # The run stopped (preempted) after this step's checkpoint and before its evaluation.
            last_eval = run_evaluation(ctx, run, eval_engine, eval_prompts, run.start)
        elif config.eval.at_start and run.start == 0:
            last_eval = run_evaluation(ctx, run, eval_engine, eval_prompts, 0)
        for step in range(run.start, config.total_steps):
            # Row, evaluation, then checkpoint: whatever a kill loses is past the last checkpoint,
            # so the resumed run recomputes it (and `open_context` dropped its stale rows).
            history.append(train_step(ctx, run, step, ckpt_s, ahead))
            stop = run.ckpt.should_stop(step + 1)
            if not stop and config.eval.every and _eval_due(config, step + 1):
                if ahead is not None:
                    ahead.wait()  # the evaluation shares the sandbox pool and the devices
                last_eval = run_evaluation(ctx, run, eval_engine, eval_prompts, step + 1)
            ckpt_s = stages.checkpoint(ctx, run, step, stop)
            if stop:
                log.warning("preemption signal: saved step %d, stopping", step + 1)
                break
        from codedance_jax.checkpoint import orbax_io

        orbax_io.save(run.mdef.model(run.state.params), policy_path(workdir), ctx.processor)
    return {"step": int(run.state.step), "history": history, "eval": last_eval, "policy": policy_path(workdir)}


def warm_up(ctx: GRPOContext, run: setup.Run, eval_engine, eval_prompts: list) -> dict:
    """Compile the run's shape plan (`runs/grpo_plan.py`) before its first step; the plan's
    programs, compilations and time go to WORKDIR/shape_plan.json."""
    evaluates = ctx.config.eval.every or ctx.config.eval.get("at_start", False)
    n_eval = min(len(eval_prompts), int(ctx.config.eval.batch or len(eval_prompts))) if evaluates else 0
    out = grpo_plan.warm_up(ctx, run, eval_engine, n_eval)
    for engine in (ctx.engine, eval_engine):  # the warm-up's dummy batches and weights are not kept
        if engine is not None:
            engine.release()
    if ctx.host == 0:
        with open(os.path.join(ctx.workdir, "shape_plan.json"), "w") as f:
            json.dump({"programs": out["programs"], "compilations": out["compilations"], "seconds": out["seconds"]},
                      f, indent=1)
        print(f"shape plan: {len(out['programs'])} programs, {out['compilations']} compilations in "
              f"{out['seconds']:.1f} s", flush=True)
    return out


def _eval_due(config, step: int) -> bool:
    return step % config.eval.every == 0 or step == config.total_steps


def _has_eval(workdir: str, step: int) -> bool:
    path = os.path.join(workdir, "eval.jsonl")
    return os.path.exists(path) and any(json.loads(x)["step"] == step for x in open(path) if x.strip())


def train_step(ctx: GRPOContext, run: setup.Run, step: int, ckpt_s: float = 0.0,
               ahead: grpo_overlap.RolloutAhead | None = None) -> dict:
    """prompts -> rollouts -> scores and R_BAT advantages -> batch -> old log-probs -> update ->
    metrics. Returns the metrics row (written); `ckpt_s` is the previous step's checkpoint save.
    `ahead` (async_rollout): this step's rollouts may have been started during the previous update,
    and the next step's start before this one's update."""
    t_step, c0, config = time.perf_counter(), CompileCounter.total(), ctx.config
    got = ahead.take(step) if ahead is not None else None
    if got is None:
        prompts = stages.step_prompts(ctx, step)
        rollouts = stages.rollout(ctx, run, prompts, step)
    else:
        prompts, rollouts = got
    scores = stages.score(ctx, prompts, rollouts)
    t_traj = time.perf_counter()
    if config.trajectories_every and (step + 1) % config.trajectories_every == 0:
        stages.save_trajectories(ctx, rollouts, step)
    t_traj = time.perf_counter() - t_traj
    batch = stages.old_logprobs(ctx, run, stages.batch(ctx, rollouts, scores, step))
    rollouts = dataclasses.replace(rollouts, policy_model=None)  # its sampler copy, free once replaced
    if ahead is not None:
        if step + 1 < config.total_steps:
            ahead.start(step + 1)
    else:  # the update, then the next placement, get the chips without the rollout's cache and weights
        ctx.engine.release()
    update = stages.update(ctx, run, batch, step)
    run.state = update.state
    row = metrics_row(prompts, rollouts, scores, batch, update, cfg=ctx.cfg, group_size=ctx.group_size,
                      keys=tuple(config.metric_keys),
                      peak_flops=config.peak_tflops_per_device * 1e12 * jax.device_count())
    row["time/checkpoint_s"] = ckpt_s
    row["staleness"] = float(step - rollouts.version)  # updates the sampling policy was behind this update's
    row.update({"time/rollout_start": rollouts.started, "time/rollout_end": rollouts.ended,
                "time/update_start": update.started, "time/update_end": update.ended})
    row["time/trajectories_s"] = t_traj  # the jsonl and the policy's host copy (written from a thread)
    row["compilations"] = float(CompileCounter.total() - c0)
    row["step_time_s"] = time.perf_counter() - t_step
    run.writer.write(step + 1, row)
    write_rollout_stats(ctx.workdir, step + 1, rollouts.stats)
    if ctx.host == 0 and ((step + 1) % config.log_every == 0 or step + 1 == config.total_steps):
        print(run.progress.line(step + 1, {"acc": row["accuracy"], "turns": row["avg_turns"],
                                           "tool_rate": row["tool_rate"], "pg_loss": update.metrics.get("pg_loss", 0.0),
                                           "s/step": row["step_time_s"]}), flush=True)
    return row
