"""The stages of one GRPO step, each a function with a typed result (as tunix's learner hands a
`TrainExample` from generation to the loss):

    prompts  -> StepPrompts     this step's prompts (stateless schedule: a resumed run draws the same)
    rollout  -> Rollouts        prompts x group_size trajectories, code run in the sandbox pool
    score    -> Scores          R_acc, format, per-turn execution status, R_BAT advantages (global stats),
                                the trajectories that train (`config.filter`, `rl.selection`)
    batch    -> GRPOBatch       trajectories -> the padded GRPO batch, on the mesh
    old_logprobs -> GRPOBatch   the reference's log-probs (KL on)
    update   -> Update          one jitted, sharded GRPO update; the old policy's log-probs are its
                                own forward's (one update per batch), checked against the sampler's;
                                with `config.async_rollout` the sampler's recorded ones (`old_from_forward`)

`GRPOContext` holds what every step reads (configs, mesh, engine, prompt source, caches). Each host
rolls out its share of the prompts on its sampling mesh (its own devices, rows split over `data`,
the parameters replicated over it or split over `tensor`: `rollout_model`); R_BAT statistics are
taken over all hosts' trajectories (allgather) and the update runs on the global mesh.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from codedance_jax.model.config import ModelConfig
from codedance_jax.rl import GRPOLossConfig, RBATConfig, rbat_advantages, rbat_rewards, scoring, selection
from codedance_jax.rollout import RolloutEngine, RolloutStats, Trajectory, rl_prompt, save_jsonl
from codedance_jax.rollout.placement import sampling_params
from codedance_jax.train import grpo, rl_batch, sft
from codedance_jax.train.batching import Bucket, max_bucket_across_hosts
from runs import setup


@dataclasses.dataclass
class UpdateLayout:
    """The batch layouts a planned run uses: packed rows of T n / 16 slots for n in `pack_sixteenths`
    with exactly `vision_rows` shared vision rows, else (either does not hold the step) unpacked rows
    with per-row images; `images`: keep the vision fields in text-only batches too."""

    pack_sixteenths: tuple[int, ...]
    vision_rows: int
    images: bool = True

    def batch_kwargs(self) -> dict:
        return dict(pack_sixteenths=self.pack_sixteenths, vision_rows=self.vision_rows, drop_pixels=not self.images)


@dataclasses.dataclass
class GRPOContext:
    """What every step of a GRPO run reads (built once by `runs.grpo.train_and_evaluate`)."""

    config: Any
    workdir: str
    processor: Any
    cfg: ModelConfig
    mesh: Any
    rules: tuple | None
    tx: Any
    sched: Any
    rbat: RBATConfig
    loss: GRPOLossConfig
    buckets: tuple[Bucket, ...]
    source: Any  # the RL prompt dataset (random access)
    schedule: Any  # data.rl_prompts.PromptSchedule
    engine: RolloutEngine
    pool: Any  # a SandboxPool
    rows: int  # global batch rows, padded to divide data*fsdp*grad_accum
    exporter: Any  # checkpoint.background.BackgroundExport: the sampling policies of save_trajectories
    ref_params: Any = None  # the frozen reference (KL on)
    lp_fns: setup.StepCache = dataclasses.field(default_factory=setup.StepCache)
    # The host's sampling mesh (`config.rollout.mesh_data` of its local devices) the engines run on;
    # None: the trainer's arrays as they are (tests that build a context by hand).
    sampling_mesh: Any = None
    # The update's batch layouts of the run's shape plan (`runs/grpo_plan.py`); None: any layout.
    layout: UpdateLayout | None = None

    @property
    def group_size(self) -> int:
        return int(self.config.group_size)

    @property
    def hosts(self) -> int:
        return jax.process_count()

    @property
    def host(self) -> int:
        return jax.process_index()

    @property
    def n_local(self) -> int:
        """Trajectories per host."""
        return self.config.prompts_per_step // self.hosts * self.group_size


@dataclasses.dataclass
class StepPrompts:
    prompts: list  # data.rl_prompts.RLPrompt, this host's share
    golds: list[str]  # one per trajectory (prompt-major, group members contiguous)
    questions: list[str]
    metas: list[dict]


@dataclasses.dataclass
class Rollouts:
    trajectories: list[Trajectory]
    stats: RolloutStats
    policy_model: Any  # the module that sampled them (exported with the trajectories)
    time_s: float
    version: int = -1  # updates applied to the sampling policy (the step's own number: on-policy)
    started: float = 0.0  # wall clock (time.time()) of the rollout's start and end
    ended: float = 0.0


@dataclasses.dataclass
class Scores:
    acc: np.ndarray  # float32[b], this host's trajectories
    fmt_ok: np.ndarray  # bool[b]
    a_seq: np.ndarray  # float32[b]
    a_turn: np.ndarray  # float32[b, M]
    parts: dict[str, np.ndarray]  # the reward parts of the global batch (rbat_rewards), [B]
    time_s: float
    # acc, fmt_ok, a_seq, a_turn of the global batch (all hosts' rows, host-major); None = the local ones
    glob: dict[str, np.ndarray] | None = None
    keep: np.ndarray | None = None  # bool[b]: the trajectories that train (config.filter); None = all
    counts: dict[str, float] = dataclasses.field(default_factory=dict)  # filter/* metrics (global batch)


@dataclasses.dataclass
class GRPOBatch:
    local: dict[str, np.ndarray]  # this host's rows (numpy)
    arrays: dict[str, jax.Array]  # the global batch on the mesh
    shardings: dict[str, NamedSharding]
    key: tuple  # batch shapes (the jit cache key)
    time_s: float
    logprob_mismatch: float = float("nan")  # max |recomputed - sampled| old log-prob (see Update)
    logprob_s: float = 0.0  # the reference's log-prob forward (KL on)


@dataclasses.dataclass
class Update:
    state: Any  # the new TrainState
    metrics: dict[str, float]  # train/* (loss, pg_loss, clip_frac, entropy, grad_norm, lr, n_tokens)
    time_s: float
    logprob_mismatch: float | None = None  # max |recomputed - sampled| old log-prob (update's forward)
    started: float = 0.0  # wall clock (time.time()) of the update's start and end (its metrics fetched)
    ended: float = 0.0


# ----------------------------------------------------------------------------------- helpers
def global_view(local: np.ndarray) -> np.ndarray:
    """All hosts' rows of a host-local array, host-major (one process: the array itself)."""
    if jax.process_count() == 1:
        return local
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(local, tiled=True))


def host_slice(global_arr: np.ndarray, n_local: int) -> np.ndarray:
    i = jax.process_index()
    return global_arr[i * n_local : (i + 1) * n_local]


def rollout_model(mdef, params, sampling_mesh=None, rules=None, *, own: bool = False):
    """The policy as a module for the rollout engine: the trainer's parameters placed for the host's
    sampling mesh (`rollout.placement.sampling_params`: replicated over this host's devices, or split
    over its `tensor` axis as the run's sharding `rules` ask, moved device to device; with several
    processes gathered over the global mesh first), in the model's compute dtype (float32 weights of
    a bfloat16 model as bfloat16: the same outputs, `placement.sampler_dtype`). Without a sampling
    mesh, the trainer's arrays themselves. `own`: no leaf shares a device buffer with `params` (those that would are copied
    device to device), so the update may donate `params` while this model samples (`async_rollout`)."""
    placed = params if sampling_mesh is None else sampling_params(params, sampling_mesh, rules,
                                                                  compute_dtype=mdef.cfg.compute_dtype)
    if own:
        placed = own_copy(placed, params)
    return mdef.model(placed)


def _buffers(x) -> set[int]:
    return {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}


def own_copy(placed, params):
    """`placed` with every leaf that aliases a buffer of `params` (a placement that kept the
    trainer's arrays, or adopted them on another mesh) copied on its devices: no host round trip,
    nothing compiled (`device_put(may_alias=False)`), ready when it returns."""
    trainer = set().union(*(_buffers(x) for x in jax.tree.leaves(params)))
    leaves, treedef = jax.tree.flatten(placed)
    with jax.transfer_guard_host_to_device("disallow"), jax.transfer_guard_device_to_host("disallow"):
        out = [jax.device_put(x, x.sharding, may_alias=False) if _buffers(x) & trainer else x for x in leaves]
    return jax.block_until_ready(jax.tree.unflatten(treedef, out))


# ----------------------------------------------------------------------------------- stages
def step_prompts(ctx: GRPOContext, step: int) -> StepPrompts:
    from data import rl_prompts

    g = ctx.group_size
    prompts = [rl_prompts.to_prompt(ctx.source[i]) for i in ctx.schedule.indices(step, ctx.host, ctx.hosts)]
    return StepPrompts(prompts, [p.answer for p in prompts for _ in range(g)],
                       [p.question for p in prompts for _ in range(g)], [p.meta for p in prompts for _ in range(g)])


def rollout(ctx: GRPOContext, run: setup.Run, sp: StepPrompts, step: int, policy_model=None,
            version: int | None = None) -> Rollouts:
    """group_size samples of each prompt with the current policy (or `policy_model`, which has had
    `version` updates: `runs/grpo_overlap.py`); sampling keys follow from the step."""
    started = time.time()
    if policy_model is None:
        policy_model = rollout_model(run.mdef, run.state.params, ctx.sampling_mesh, ctx.rules)
    ctx.engine.set_model(policy_model)
    fmt = ctx.config.rollout.turn_format
    ps = [rl_prompt(ctx.processor, f"{p.id}@{step}", p.question, p.images, fmt) for p in sp.prompts]
    t0 = time.perf_counter()
    trajs, stats = ctx.engine.rollout(ps, group_size=ctx.group_size, sandbox=ctx.pool,
                                      seed_offset=(step * ctx.hosts + ctx.host) * len(ps) * ctx.group_size)
    return Rollouts(trajs, stats, policy_model, time.perf_counter() - t0, step if version is None else version,
                    started, time.time())


def score(ctx: GRPOContext, sp: StepPrompts, ro: Rollouts) -> Scores:
    """Rewards and R_BAT advantages; the kernel sees the global batch, each host keeps its rows.
    Fills each trajectory's `answer`, `correct` and `rewards` (the parts and its A_seq)."""
    t0 = time.perf_counter()
    g = ctx.group_size
    sc = scoring.score(ro.trajectories, sp.golds, ctx.processor, max_turns=ctx.engine.cfg.max_turns, cfg=ctx.rbat,
                       turn_format=ctx.config.rollout.turn_format, questions=sp.questions)
    glob = [global_view(a) for a in (sc.acc, sc.fmt_ok, sc.turn_is_tool, sc.turn_failed)]
    extra = {}  # inputs only the switches read (off by default)
    if ctx.rbat.turn_stats == "all":
        extra["turn_valid"] = global_view(sc.turn_valid)
    if ctx.rbat.overlong_cache:
        extra["resp_len"] = global_view(sc.resp_len)
    a_seq, a_turn = (np.asarray(x) for x in rbat_advantages(*glob, group_size=g, cfg=ctx.rbat, **extra))
    parts = {k: np.asarray(v) for k, v in rbat_rewards(*glob, group_size=g, cfg=ctx.rbat,
                                                        resp_len=extra.get("resp_len")).items()}
    whole = {"acc": glob[0], "fmt_ok": glob[1], "a_seq": a_seq, "a_turn": a_turn}
    keep, counts = trained_rows(ctx.config, glob[0], parts["total"],
                                global_view(selection.truncated([t.finish_reason for t in ro.trajectories])), g)
    a_seq, a_turn = host_slice(a_seq, ctx.n_local), host_slice(a_turn, ctx.n_local)
    for i, t in enumerate(ro.trajectories):
        j = ctx.host * ctx.n_local + i
        t.rewards = {k: float(v[j]) for k, v in parts.items()}
        t.rewards.update(a_seq=float(a_seq[i]))
    return Scores(sc.acc, sc.fmt_ok, a_seq, a_turn, parts, time.perf_counter() - t0, whole,
                  None if keep is None else host_slice(keep, ctx.n_local), counts)


def trained_rows(config, acc: np.ndarray, total: np.ndarray, truncated: np.ndarray,
                 group_size: int) -> tuple[np.ndarray | None, dict[str, float]]:
    """Which trajectories of the global batch train (`config.filter`; `rl.selection`), and the
    `filter/*` counts. (None, {}) with both switches off: every trajectory trains.

    acc, total: [B] accuracy and sequence reward r(τ); truncated: bool[B] (budget hit, no answer)."""
    groups = config.get("filter", {}).get("groups", "off")
    mask_truncated = bool(config.get("filter", {}).get("mask_truncated", False))
    if groups == "off" and not mask_truncated:
        return None, {}
    keep = np.ones(len(acc), bool)
    counts = {}
    if groups != "off":
        flat = selection.no_signal_groups(acc if groups == "acc" else total, group_size)
        keep &= ~flat
        counts["filter/groups_dropped"] = float(flat.sum() // group_size)
    if mask_truncated:
        keep &= ~truncated
        counts["filter/truncated_masked"] = float(truncated.sum())
    counts["filter/trajectories_trained"] = float(keep.sum())
    return keep, counts


def pass_counts(ctx: GRPOContext, run: setup.Run, k: int) -> np.ndarray:
    """Correct answers in `k` sampled rollouts of every prompt of `ctx.source` with the run's current
    (initial) policy: int[N], for the difficulty filter (`config.data.filter_pass`). The rollout and
    the scoring are a GRPO step's (engine, sandbox pool, `rl.scoring`), `prompts_per_step` prompts at
    a time; each host rolls out its contiguous share of the prompts and the counts are allgathered."""
    from data import rl_prompts

    n = len(ctx.source)
    share = -(-n // ctx.hosts)
    mine = list(range(ctx.host * share, min(n, (ctx.host + 1) * share)))
    ctx.engine.set_model(rollout_model(run.mdef, run.state.params, ctx.sampling_mesh, ctx.rules))
    fmt = ctx.config.rollout.turn_format
    counts = np.zeros(share, np.int32)  # this host's share, padded to equal length for the allgather
    chunk = max(1, int(ctx.config.prompts_per_step) // ctx.hosts)
    for start in range(0, len(mine), chunk):
        prompts = [rl_prompts.to_prompt(ctx.source[i]) for i in mine[start : start + chunk]]
        ps = [rl_prompt(ctx.processor, f"{p.id}@filter", p.question, p.images, fmt) for p in prompts]
        # Sampling keys apart from the training steps' (which start at row 0).
        offset = (1 << 30) + (ctx.host * share + start) * k
        trajs, _ = ctx.engine.rollout(ps, group_size=k, sandbox=ctx.pool, seed_offset=offset)
        sc = scoring.score(trajs, [p.answer for p in prompts for _ in range(k)], ctx.processor,
                           max_turns=ctx.engine.cfg.max_turns, cfg=ctx.rbat, turn_format=fmt,
                           questions=[p.question for p in prompts for _ in range(k)])
        counts[start : start + len(prompts)] = (sc.acc > 0).reshape(len(prompts), k).sum(axis=1)
    return global_view(counts)[:n]


def untrained_rows(batch: dict[str, np.ndarray], keep: np.ndarray) -> dict[str, np.ndarray]:
    """The GRPO batch with the rows where `keep` is False training no token (turn ids −1): they add
    nothing to the loss nor to its sequence or token count (`train.grpo.global_denom`). The rows
    stay (one row per trajectory), so their forward is still computed."""
    keep = np.asarray(keep, bool)
    if keep.shape != (batch["turn_ids"].shape[0],):
        raise ValueError(f"keep has shape {keep.shape}; the batch has {batch['turn_ids'].shape[0]} rows")
    return {**batch, "turn_ids": np.where(keep[:, None], batch["turn_ids"], -1).astype(np.int32)}


def save_trajectories(ctx: GRPOContext, ro: Rollouts, step: int) -> None:
    """The step's trajectories (SPEC record) and the *sampling* policy they name, exported before
    the update donates its arrays."""
    pdir = os.path.join(ctx.workdir, "policies", f"step_{step}")
    for t in ro.trajectories:
        t.policy = pdir
    ctx.exporter.submit(ro.policy_model, pdir, ctx.processor)  # a host copy now (the update donates the arrays)
    name = "trajectories.jsonl" if ctx.host == 0 else f"trajectories.host{ctx.host}.jsonl"
    save_jsonl(ro.trajectories, ctx.workdir, name=name, append=True)


def batch(ctx: GRPOContext, ro: Rollouts, scores: Scores, step: int) -> GRPOBatch:
    """Trajectories -> the GRPO batch padded to the bucket all hosts agree on, on the mesh."""
    t0 = time.perf_counter()
    trajs = ro.trajectories
    exs = [rl_batch.trajectory_example(t, ctx.processor, ctx.cfg, ctx.buckets) for t in trajs]
    misfit = [e for e in exs if e.bucket is None]
    if misfit:
        raise ValueError(f"step {step}: trajectory {misfit[0].source} needs {tuple(misfit[0].needs)} (tokens, "
                         f"image tokens, windows), more than config.buckets={ctx.config.buckets}; raise the buckets "
                         f"to cover the rollout budgets (rollout.max_total_tokens, obs_max_pixels, max_turns)")
    bucket = ctx.buckets[max_bucket_across_hosts(max(e.bucket for e in exs))]
    whole = None if int(ctx.config.grad_accum) == 1 else False  # packed rows, shared images: no micro-batches
    kw = dict(bucket=bucket, examples=exs, row_multiple=ctx.mesh.shape["data"] * ctx.mesh.shape["fsdp"],
              **(ctx.layout.batch_kwargs() if ctx.layout else {}))
    local = rl_batch.grpo_batch(trajs, ctx.processor, ctx.cfg, ctx.buckets, scores.a_seq, scores.a_turn,
                                pack=whole, share_images=whole, **kw)
    if ctx.layout is not None and ("pack_src" in local) != ("feat_src" in local):
        # one of the planned layouts did not hold this step: the plan's other one (unpacked, per-row images)
        local = rl_batch.grpo_batch(trajs, ctx.processor, ctx.cfg, ctx.buckets, scores.a_seq, scores.a_turn,
                                    pack=False, share_images=False, **kw)
    if scores.keep is not None:
        local = untrained_rows(local, scores.keep)
    local = rl_batch.pad_rows(local, ctx.rows // ctx.hosts)
    local.pop("num_tokens", None)
    arrays, shardings = place_batch(ctx, local)
    return GRPOBatch(local, arrays, shardings, setup.batch_key(local), time.perf_counter() - t0)


def old_logprobs(ctx: GRPOContext, run: setup.Run, b: GRPOBatch) -> GRPOBatch:
    """The frozen reference's log-probs when the KL term is on. The old policy's are not recomputed
    here: with one update per batch they are the update's own forward (`grpo_train_step(
    old_from_forward=)`, when `recompute_old_logprobs`), which also reports `logprob_mismatch`, their
    max distance to the sampler's (verl's check)."""
    if ctx.ref_params is None:
        return b
    t0 = time.perf_counter()
    arrays, shardings = dict(b.arrays), dict(b.shardings)
    lp_fn = ctx.lp_fns.get(b.key, lambda: build_logprob(ctx, run, b.shardings))
    lp_in = {k: v for k, v in b.arrays.items() if k in sft.BATCH_FIELDS}
    arrays["ref_logprobs"] = jax.device_put(lp_fn(ctx.ref_params, lp_in), shardings["old_logprobs"])
    shardings["ref_logprobs"] = shardings["old_logprobs"]
    jax.block_until_ready(arrays["ref_logprobs"])
    return dataclasses.replace(b, arrays=arrays, shardings=shardings, logprob_s=time.perf_counter() - t0)


def update(ctx: GRPOContext, run: setup.Run, b: GRPOBatch, step: int) -> Update:
    """One GRPO update (jitted once per batch shape); the state's arrays are donated. With
    `old_from_forward(config)` the old log-probs come from the update's forward and `logprob_mismatch`
    from its metrics."""
    started, t0 = time.time(), time.perf_counter()
    step_fn = run.steps.get(update_key(ctx, b.key), lambda: build_update(ctx, run, b.shardings))
    # Placed replicated, as the plan's ahead-of-time compile took it (`runs/grpo_plan.py`).
    rng = setup.replicated_key(step, ctx.mesh)
    with jax.transfer_guard("disallow"):  # inputs are placed above: any other host<->device copy is a bug
        state, m = step_fn(run.state, b.arrays, rng)
    m = {k: float(v) for k, v in jax.device_get(m).items()}
    mismatch = m.pop("logprob_mismatch", None)
    return Update(state, m, time.perf_counter() - t0, logprob_mismatch=mismatch, started=started, ended=time.time())


def old_from_forward(config) -> bool:
    """The update takes the old log-probs from its own forward (`recompute_old_logprobs`), unless
    `async_rollout`: then the sampler's policy is one update behind the update's and only the
    trajectories' recorded log-probs are the sampling policy's (the ratio's denominator)."""
    return bool(config.recompute_old_logprobs) and not int(config.get("async_rollout", 0))


def update_key(ctx: GRPOContext, batch_key: tuple) -> tuple:
    """The update's StepCache key: the batch's shapes and the switches that change its program."""
    return batch_key + (("ref", ctx.ref_params is not None), ("old_from_forward", old_from_forward(ctx.config)))


def build_update(ctx: GRPOContext, run: setup.Run, shardings: dict):
    """jit(grpo_train_step) for a batch with these shardings (the state donated)."""
    return grpo.make_grpo_step(run.mdef, ctx.tx, ctx.sched, ctx.loss, run.state_sh, shardings, ctx.mesh,
                               accum_steps=ctx.config.grad_accum, temperature=ctx.config.rollout.temperature,
                               rules=ctx.rules, old_from_forward=old_from_forward(ctx.config))


def build_logprob(ctx: GRPOContext, run: setup.Run, shardings: dict):
    """jit: the frozen reference's log-probs of a batch with these shardings (KL on)."""
    lp_bsh = {k: v for k, v in shardings.items() if k in sft.BATCH_FIELDS}
    return grpo.make_logprob_fn(run.mdef, run.state_sh.params, lp_bsh, ctx.mesh,
                                temperature=ctx.config.rollout.temperature, accum_steps=ctx.config.grad_accum,
                                rules=ctx.rules)


def place_batch(ctx: GRPOContext, local: dict) -> tuple[dict, dict]:
    """(global arrays, shardings) of a host's batch fields, on the mesh."""
    shardings = sft.batch_shardings(local, ctx.mesh, ctx.rules)
    return {k: jax.make_array_from_process_local_data(shardings[k], v) for k, v in local.items()}, shardings


def checkpoint(ctx: GRPOContext, run: setup.Run, step: int, stop: bool) -> float:
    """Save after `step` (the step number is the whole data state: prompts and keys follow from
    it), forced when `stop` (preempted) or at the last step; returns the seconds it took."""
    t0 = time.perf_counter()
    run.ckpt.save(step + 1, run.state, {"kind": "json", "value": {"step": step + 1}},
                  force=stop or step + 1 == ctx.config.total_steps)
    return time.perf_counter() - t0

