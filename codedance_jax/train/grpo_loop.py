"""`train_and_evaluate` for GRPO: rollouts through the sandbox, R_BAT, sharded updates, eval.

One step:
  1. prompts: `PromptSchedule` picks this step's prompts (stateless: resume draws the same ones);
  2. rollout: `RolloutEngine` samples prompts x group_size trajectories with the current policy,
     code runs in the `SandboxPool` (its own thread: the pool's parent-death signal is per thread);
  3. scoring: R_acc, format, per-turn execution status (`rl.scoring`);
  4. advantages: `rbat_advantages` on the global batch (jit kernel; reward parts for the logs);
  5. batch: trajectories -> the GRPO batch padded to a bucket (`train.rl_batch`);
  6. log-probs: old-policy recompute (as verl) and the frozen reference when KL is on;
  7. update: `train.grpo.grpo_train_step` (jitted, sharded, micro-batched);
  8. metrics, checkpoint (orbax, with the step number: prompts and sampling keys follow from it),
     evaluation on held-out prompts every `eval.every` steps.
Rollouts run on the training mesh's parameters (one process). With several processes each host
rolls out its share of the prompts with a host-local copy of the parameters, the R_BAT statistics
are taken over all hosts' trajectories, and the update runs on the global mesh.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from codedance_jax import sharding as shd
from codedance_jax.model.config import ModelConfig
from codedance_jax.rl import GRPOLossConfig, RBATConfig, rbat_advantages, rbat_rewards, scoring
from codedance_jax.rollout import RolloutConfig, RolloutEngine, SamplingConfig, rl_prompt, save_jsonl
from codedance_jax.rollout.buckets import CompileCounter
from codedance_jax.train import checkpointing, flops, grpo, optim, rl_batch, sft
from codedance_jax.train import state as st
from codedance_jax.train.metrics import MetricWriter, Progress
from data.batching import check_buckets
from data.sft_pipeline import max_bucket_across_hosts

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------- setup
def rbat_config(c) -> RBATConfig:
    base = RBATConfig.release if c.preset == "release" else RBATConfig.paper
    return base(mode=c.mode, gamma=float(c.gamma), delta=float(c.delta), beta=float(c.beta))


def loss_config(c) -> GRPOLossConfig:
    return GRPOLossConfig(clip_eps=float(c.clip_eps), aggregation=c.aggregation, kl_coef=float(c.kl_coef))


def rollout_config(config, *, evaluation: bool = False) -> RolloutConfig:
    r = dict(config.rollout)
    for k in ("temperature", "top_p", "top_k"):
        r.pop(k)
    r["prompt_buckets"], r["obs_buckets"] = tuple(r["prompt_buckets"]), tuple(r["obs_buckets"])
    if evaluation:
        r["max_turns"] = int(config.eval.max_turns)
        return RolloutConfig.eval(**r)
    return RolloutConfig.train(**r)


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
        raise ValueError("no RL prompts: set --config.data.jsonl=FILE[,FILE] (data/rl_prompts.py format) "
                         "or --config.data.toyworld=True to generate the toy world")
    if not processor_dir:
        raise ValueError("no tokenizer: set --config.init_from=CHECKPOINT or --config.processor_dir=DIR")
    tfds_dir = d.tfds_dir or os.path.join(workdir, "tfds")
    if jax.process_index() == 0:
        if d.toyworld and not os.path.exists(os.path.join(world, "world.json")) and not list(d.jsonl):
            from data.toyworld import generate_world

            n_sft, n_rl, n_eval = (int(x) for x in d.toy_sizes)
            generate_world(world, n_sft=n_sft, n_rl=n_rl, n_eval=n_eval, seed=config.seed)
        from data import rl_prompts

        rl_prompts.build_prompts(jsonl, tfds_dir, d.name)
        if eval_jsonl:
            rl_prompts.build_prompts(eval_jsonl, tfds_dir, d.eval_name)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("grpo_files_ready")
    return {"tfds_dir": tfds_dir, "processor_dir": processor_dir, "has_eval": bool(eval_jsonl)}


def model_config(config, processor_dir: str) -> ModelConfig:
    if config.init_from:
        cfg = ModelConfig.from_hf_config(config.init_from)
    elif config.model == "toy":
        from data.toyworld import toy_model_config

        cfg = toy_model_config(processor_dir)
    else:
        from codedance_jax.train.sft_loop import model_config as preset_config

        return preset_config(config)
    return cfg.replace(dtype=config.dtype, param_dtype=config.param_dtype, remat=config.remat)


def load_params(config, mesh, rules):
    if not config.init_from:
        return None
    import codedance_jax

    model, _ = codedance_jax.from_pretrained(config.init_from, dtype=config.param_dtype, mesh=mesh, rules=rules,
                                             processor=False)
    _, params, _ = nnx.split(model, nnx.Param, ...)
    return params


class PoolThread:
    """Owns a `SandboxPool` in a long-lived thread (the pool's parent-death signal is per thread)."""

    def __init__(self, **kw):
        self._ready, self._stop = threading.Event(), threading.Event()
        self.pool, self.error = None, None
        self._t = threading.Thread(target=self._run, args=(kw,), daemon=True, name="sandbox-pool")
        self._t.start()
        self._ready.wait()
        if self.error is not None:
            raise self.error

    def _run(self, kw):
        from sandbox import SandboxPool

        try:
            with SandboxPool(**kw) as pool:
                self.pool = pool
                self._ready.set()
                self._stop.wait()
        except BaseException as e:  # noqa: BLE001 - surfaced to the caller
            self.error = e
            self._ready.set()

    def close(self):
        self._stop.set()
        self._t.join(timeout=60)


# ----------------------------------------------------------------------------------- helpers
def _global_view(local: np.ndarray) -> np.ndarray:
    """All hosts' rows of a host-local array, host-major (one process: the array itself)."""
    if jax.process_count() == 1:
        return local
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(local, tiled=True))


def _host_slice(global_arr: np.ndarray, n_local: int) -> np.ndarray:
    i = jax.process_index()
    return global_arr[i * n_local : (i + 1) * n_local]


def rollout_model(mdef, params, mesh):
    """The policy as a module for the rollout engine: the training arrays themselves on one
    process; a host-local replicated copy (on this host's first device) with several processes."""
    if jax.process_count() == 1:
        return mdef.model(params)
    gathered = jax.jit(lambda p: p, out_shardings=NamedSharding(mesh, PartitionSpec()))(params)
    local = jax.tree.map(lambda x: jax.device_put(x.addressable_data(0), jax.local_devices()[0]), gathered)
    return mdef.model(local)


def _mean(xs):
    return float(np.mean(xs)) if len(xs) else float("nan")


# ----------------------------------------------------------------------------------- evaluation
def evaluate(engine: RolloutEngine, prompts, pool, *, batch: int, keys, seed_offset: int = 0):
    """Greedy rollouts of held-out prompts; returns (summary metrics, trajectories)."""
    trajs = []
    cfg = engine.cfg
    for s in range(0, len(prompts), batch):
        chunk = prompts[s : s + batch]
        ps = [rl_prompt(engine.processor, p.id, p.question, p.images, cfg.turn_format) for p in chunk]
        out, _ = engine.rollout(ps, group_size=1, sandbox=pool, seed_offset=seed_offset + s)
        trajs += out
    sc = scoring.score(trajs, [p.answer for p in prompts], engine.processor, max_turns=cfg.max_turns,
                       turn_format=cfg.turn_format, questions=[p.question for p in prompts])
    return scoring.summarize(trajs, sc.acc, [p.meta for p in prompts], keys), trajs


# ----------------------------------------------------------------------------------- the loop
def train_and_evaluate(config, workdir: str) -> dict:
    """Runs GRPO to `config.total_steps`, resuming from the latest checkpoint in `workdir`."""
    workdir = os.path.abspath(workdir)
    os.makedirs(workdir, exist_ok=True)
    rules = tuple(tuple(r) for r in config.sharding_rules) if config.sharding_rules else None
    mesh = shd.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
    files = prepare_files(config, workdir)
    from codedance_jax.processing import Processor
    from data import rl_prompts

    processor = Processor.from_pretrained(files["processor_dir"], padding_side="left")
    cfg = model_config(config, files["processor_dir"])
    hosts, host = jax.process_count(), jax.process_index()
    g = int(config.group_size)
    if config.prompts_per_step % hosts:
        raise ValueError(f"config.prompts_per_step={config.prompts_per_step} must divide over {hosts} processes")
    n_local = config.prompts_per_step // hosts * g  # trajectories per host
    shards = mesh.shape["data"] * mesh.shape["fsdp"] * config.grad_accum
    rows = -(-config.prompts_per_step * g // shards) * shards  # global rows, padded to divide the mesh
    if rows % hosts:
        raise ValueError(f"{rows} batch rows do not divide over {hosts} processes; change prompts_per_step")
    buckets = check_buckets(config.buckets)
    rb_cfg, loss_cfg = rbat_config(config.rbat), loss_config(config.loss)
    tx, sched = optim.make_optimizer(config.optim, config.total_steps)
    mdef, state, state_sh = st.create_train_state(cfg, tx, mesh, seed=config.seed, rules=rules,
                                                  params=load_params(config, mesh, rules))
    ref_params = None
    if loss_cfg.kl_coef > 0:  # the frozen reference is the initial policy
        ref_params = jax.tree.map(lambda x: x.copy(), state.params)

    source = rl_prompts.open_prompts(files["tfds_dir"], config.data.name)
    schedule = rl_prompts.PromptSchedule(len(source), config.prompts_per_step, config.seed)
    eval_prompts = []
    if files["has_eval"]:
        es = rl_prompts.open_prompts(files["tfds_dir"], config.data.eval_name)
        n = len(es) if not config.eval.limit else min(len(es), int(config.eval.limit))
        eval_prompts = [rl_prompts.to_prompt(es[i]) for i in range(n)]

    ckpt = checkpointing.Checkpointer(workdir, keep=config.checkpoint.keep, every_steps=config.checkpoint.every_steps,
                                      async_save=config.checkpoint.async_save)
    ckpt.install_signal_handler()
    restored = ckpt.restore(state)
    if restored is not None:
        _, state, _ = restored
        log.info("resumed from step %d", int(state.step))
    start = int(state.step)

    pool = PoolThread(num_workers=config.sandbox.num_workers, timeout_s=config.sandbox.timeout_s,
                      memory_mb=config.sandbox.memory_mb)
    policy_dir = os.path.join(workdir, "policy")
    sampling = SamplingConfig(temperature=config.rollout.temperature, top_p=config.rollout.top_p,
                              top_k=config.rollout.top_k, seed=config.seed)
    model = rollout_model(mdef, state.params, mesh)
    engine = RolloutEngine(model, processor, dataclasses.replace(rollout_config(config), policy=policy_dir),
                           sampling)
    eval_engine = RolloutEngine(model, processor, rollout_config(config, evaluation=True),
                                SamplingConfig(greedy=True, seed=config.seed))
    writer = MetricWriter(workdir, tensorboard=config.tensorboard)
    steps: dict = {}
    lp_fns: dict = {}
    prog = Progress(config.total_steps, start)
    peak = config.peak_tflops_per_device * 1e12 * jax.device_count()
    keys = tuple(config.metric_keys)
    history = []
    n_dev = jax.device_count()

    def run_eval(step):
        if not eval_prompts:
            return None
        t0 = time.perf_counter()
        eval_engine.set_model(rollout_model(mdef, state.params, mesh))
        summary, trajs = evaluate(eval_engine, eval_prompts, pool.pool, batch=int(config.eval.batch), keys=keys)
        summary = {f"eval/{k}": v for k, v in summary.items()}
        summary["eval/time_s"] = time.perf_counter() - t0
        writer.write(step, summary)
        if host == 0:
            with open(os.path.join(workdir, "eval.jsonl"), "a") as f:
                f.write(json.dumps({"step": step, **summary}) + "\n")
            print(f"eval @ step {step}: accuracy {summary.get('eval/accuracy', float('nan')):.3f} "
                  f"turns {summary.get('eval/avg_turns', float('nan')):.2f} "
                  f"exec_success {summary.get('eval/exec_success', float('nan')):.3f}", flush=True)
        return summary

    last_eval = None
    try:
        if config.eval.at_start and start == 0:
            last_eval = run_eval(0)
        for step in range(start, config.total_steps):
            t_step = time.perf_counter()
            c0 = CompileCounter.total()
            # 1-2. prompts and rollouts
            idx = schedule.indices(step, host, hosts)
            prompts = [rl_prompts.to_prompt(source[i]) for i in idx]
            policy_model = rollout_model(mdef, state.params, mesh)
            engine.set_model(policy_model)
            rps = [rl_prompt(processor, f"{p.id}@{step}", p.question, p.images, config.rollout.turn_format)
                   for p in prompts]
            t0 = time.perf_counter()
            trajs, rstats = engine.rollout(rps, group_size=g, sandbox=pool.pool,
                                           seed_offset=(step * hosts + host) * len(rps) * g)
            t_rollout = time.perf_counter() - t0
            # 3-4. scoring and advantages (statistics over all hosts' trajectories)
            t0 = time.perf_counter()
            golds = [p.answer for p in prompts for _ in range(g)]
            sc = scoring.score(trajs, golds, processor, max_turns=engine.cfg.max_turns, cfg=rb_cfg,
                               turn_format=config.rollout.turn_format,
                               questions=[p.question for p in prompts for _ in range(g)])
            glob = [_global_view(a) for a in (sc.acc, sc.fmt_ok, sc.turn_is_tool, sc.turn_failed)]
            a_seq, a_turn = (np.asarray(x) for x in rbat_advantages(*glob, group_size=g, cfg=rb_cfg))
            parts = {k: np.asarray(v) for k, v in rbat_rewards(*glob, group_size=g, cfg=rb_cfg).items()}
            a_seq, a_turn = _host_slice(a_seq, n_local), _host_slice(a_turn, n_local)
            for i, t in enumerate(trajs):
                j = host * n_local + i
                t.rewards = {k: float(v[j]) for k, v in parts.items()}
                t.rewards.update(a_seq=float(a_seq[i]))
            t_score = time.perf_counter() - t0
            if config.trajectories_every and (step + 1) % config.trajectories_every == 0:
                # The sampling policy is exported before the update donates its arrays.
                pdir = os.path.join(workdir, "policies", f"step_{step}")
                for t in trajs:
                    t.policy = pdir
                from codedance_jax.checkpoint import orbax_io

                orbax_io.save(policy_model, pdir, processor)
                name = "trajectories.jsonl" if host == 0 else f"trajectories.host{host}.jsonl"
                save_jsonl(trajs, workdir, name=name, append=True)
            # 5. batch
            t0 = time.perf_counter()
            exs = [rl_batch.trajectory_example(t, processor, cfg, buckets) for t in trajs]
            misfit = [e for e in exs if e.bucket is None]
            if misfit:
                raise ValueError(f"step {step}: trajectory {misfit[0].source} needs {tuple(misfit[0].needs)} (tokens, "
                                 f"image tokens, windows), more than config.buckets={config.buckets}; raise the buckets "
                                 f"to cover the rollout budgets (rollout.max_total_tokens, obs_max_pixels, max_turns)")
            exs_bucket = max(e.bucket for e in exs)
            bucket = buckets[max_bucket_across_hosts(exs_bucket)]
            local = rl_batch.grpo_batch(trajs, processor, cfg, buckets, a_seq, a_turn, bucket=bucket, examples=exs)
            local = rl_batch.pad_rows(local, rows // hosts)
            local.pop("num_tokens", None)
            bsh = sft.batch_shardings(local, mesh, rules)
            gb = {k: jax.make_array_from_process_local_data(bsh[k], v) for k, v in local.items()}
            t_batch = time.perf_counter() - t0
            # 6. log-probs of the old policy (and the reference)
            t0 = time.perf_counter()
            key = tuple((k, v.shape) for k, v in sorted(local.items()))
            mismatch = float("nan")
            if config.recompute_old_logprobs or ref_params is not None:
                if key not in lp_fns:
                    lp_bsh = {k: v for k, v in bsh.items() if k in sft.BATCH_FIELDS}
                    lp_fns[key] = grpo.make_logprob_fn(mdef, state_sh.params, lp_bsh, mesh,
                                                       temperature=config.rollout.temperature,
                                                       accum_steps=config.grad_accum, rules=rules)
                lp_in = {k: v for k, v in gb.items() if k in sft.BATCH_FIELDS}
                if config.recompute_old_logprobs:
                    old = lp_fns[key](state.params, lp_in)
                    mask = local["loss_mask"] > 0
                    rec = np.asarray(old)[host * (rows // hosts):(host + 1) * (rows // hosts)] if hosts > 1 else np.asarray(old)
                    mismatch = float(np.abs(rec - local["old_logprobs"])[mask].max()) if mask.any() else 0.0
                    gb["old_logprobs"] = jax.device_put(old * gb["loss_mask"], bsh["old_logprobs"])
                if ref_params is not None:
                    gb["ref_logprobs"] = jax.device_put(lp_fns[key](ref_params, lp_in), bsh["old_logprobs"])
                    bsh = {**bsh, "ref_logprobs": bsh["old_logprobs"]}
                jax.block_until_ready(gb["old_logprobs"])
            t_logprob = time.perf_counter() - t0
            # 7. update
            t0 = time.perf_counter()
            skey = key + (("ref", ref_params is not None),)
            if skey not in steps:
                steps[skey] = grpo.make_grpo_step(mdef, tx, sched, loss_cfg, state_sh, bsh, mesh,
                                                  accum_steps=config.grad_accum, temperature=config.rollout.temperature,
                                                  rules=rules)
            state, m = steps[skey](state, gb, jax.random.key(step))
            m = {k: float(v) for k, v in jax.device_get(m).items()}
            t_update = time.perf_counter() - t0
            # 8. metrics, trajectories, checkpoint, eval
            summ = scoring.summarize(trajs, sc.acc, [p.meta for p in prompts for _ in range(g)], keys)
            gen_tok = float(rstats.generated_tokens)
            trained_tok = float(local["loss_mask"].sum())
            seq = int(local["input_ids"].shape[1])
            patches = float((local["unit_src"] >= 0).sum() * cfg.vision.merge_unit)
            fl = flops.train_flops(cfg, trained_tok * hosts, seq, patches * hosts)
            groups = sc.acc.reshape(-1, g)
            row = {
                **{k: v for k, v in summ.items() if k != "n"},
                **{f"reward/{k}": float(np.mean(v)) for k, v in parts.items()},
                "a_seq_abs": float(np.mean(np.abs(a_seq))),
                "a_turn_abs": float(np.abs(a_turn).sum() / max(1, (a_turn != 0).sum())),
                "groups_mixed": float(np.mean(groups.min(axis=1) != groups.max(axis=1))),
                "format_ok": float(np.mean(sc.fmt_ok)),
                **{f"train/{k}": v for k, v in m.items()},
                "logprob_mismatch": mismatch,
                "time/rollout_s": t_rollout, "time/decode_s": rstats.decode_s, "time/prefill_s": rstats.prefill_s,
                "time/append_s": rstats.append_s, "time/vision_s": rstats.vision_s,
                "time/sandbox_wait_s": rstats.device_wait_s, "time/scoring_s": t_score, "time/batch_s": t_batch,
                "time/logprob_s": t_logprob, "time/update_s": t_update,
                "gen_tokens_per_s_per_device": gen_tok / max(t_rollout, 1e-9) / jax.local_device_count(),
                "trained_tokens_per_s_per_device": trained_tok * hosts / max(t_update, 1e-9) / n_dev,
                "update_mfu": fl / max(t_update, 1e-9) / peak,
                "sandbox_idle_frac": rstats.sandbox_idle_frac,
                "device_idle_frac": rstats.device_idle_frac,
                "tokens_per_traj": float(np.mean([len(t.tokens) for t in trajs])),
            }
            t0 = time.perf_counter()
            stop = ckpt.should_stop(step + 1)
            ckpt.save(step + 1, state, {"kind": "json", "value": {"step": step + 1}},
                      force=stop or step + 1 == config.total_steps)
            row["time/checkpoint_s"] = time.perf_counter() - t0
            row["compilations"] = float(CompileCounter.total() - c0)
            row["step_time_s"] = time.perf_counter() - t_step
            writer.write(step + 1, row)
            history.append(row)
            if host == 0 and ((step + 1) % config.log_every == 0 or step + 1 == config.total_steps):
                print(prog.line(step + 1, {"acc": row["accuracy"], "turns": row["avg_turns"],
                                           "tool_rate": row["tool_rate"], "pg_loss": m.get("pg_loss", 0.0),
                                           "s/step": row["step_time_s"]}), flush=True)
            if stop:
                log.warning("preemption signal: saved step %d, stopping", step + 1)
                break
            if config.eval.every and ((step + 1) % config.eval.every == 0 or step + 1 == config.total_steps):
                last_eval = run_eval(step + 1)
        final = mdef.model(state.params)
        from codedance_jax.checkpoint import orbax_io

        orbax_io.save(final, policy_dir, processor)
    finally:
        ckpt.close()
        writer.close()
        pool.close()
    return {"step": int(state.step), "history": history, "eval": last_eval, "policy": policy_dir}
