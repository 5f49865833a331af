"""The GRPO run's shape plan: every program a step can run, known from the config and compiled
before step 1.

* Rollout: `RolloutEngine.warm_up` (the plan of `codedance_jax/rollout/shapes.py`) for the step's
  prompts x group size, and for the held-out evaluation's batch when evaluation is on.
* Update: per bucket of `config.buckets`, the batch layouts of `config.plan` (`UpdateLayout`): the
  packed rows with shared vision rows, and the unpacked rows with per-row images that a step falls
  back to when either does not hold it (one layout only with several processes or micro-batches).
  Each layout's update is compiled ahead of time (`jit.lower(...).compile()`, in a thread while the
  rollout warms up) and put in the run's step cache; the reference log-probs (KL on) run once on a
  zero batch of the layout.

`warm_up` returns the plan as rows ({"program", ...}) for the metrics and `launch.preflight`.
After it the loop opens `compile_watch.UnplannedCompiles`: a step that compiles anything logs the
program and its shapes as a warning, and its metrics row counts it (`compilations`).
"""

from __future__ import annotations

import concurrent.futures
import time

import jax
import numpy as np

from codedance_jax.rollout.buckets import CompileCounter
from codedance_jax.train.batching import VISION_KEYS, Bucket, empty_batch, max_bucket_across_hosts
from runs import grpo_stages as stages
from runs import setup


def layout(config, rows: int, row_multiple: int) -> stages.UpdateLayout:
    """config.plan -> the update's layouts; vision_rows -1: a quarter of the rows (at least row_multiple)."""
    p = config.plan
    vr = int(p.vision_rows)
    if vr < 0:
        vr = row_multiple
        while vr * 4 < rows:
            vr *= 2
    return stages.UpdateLayout(tuple(int(x) for x in p.pack_sixteenths), vr, bool(p.images))


def variants(ctx: stages.GRPOContext) -> list[tuple[Bucket, int | None, int | None]]:
    """(bucket, packed width K or None, shared vision rows or None) of every planned update batch."""
    whole = jax.process_count() == 1 and int(ctx.config.grad_accum) == 1
    out = []
    for b in ctx.buckets:
        if whole and ctx.layout is not None:
            out += [(b, b.tokens * n // 16, ctx.layout.vision_rows) for n in sorted(ctx.layout.pack_sixteenths)]
        out.append((b, None, None))
    return out


def planned_batch(ctx: stages.GRPOContext, bucket: Bucket, pack_k: int | None, vision_rows: int | None) -> dict:
    """A zero host batch with exactly the fields, shapes and dtypes `stages.batch` gives a step of
    this layout (checked by the GRPO loop's no-compilation test): the contract's empty batch
    (`batching.empty_batch`), its vision fields on `vision_rows` shared rows, and the GRPO fields."""
    n, t = ctx.rows // ctx.hosts, bucket.tokens
    out = empty_batch(n, bucket, pad_id=ctx.processor.pad_id, vision_cfg=ctx.cfg.vision)
    out.pop("num_tokens")
    if vision_rows is not None:  # `packing.share_images`' layout
        out.update({k: np.zeros((vision_rows, *out[k].shape[1:]), out[k].dtype) for k in VISION_KEYS})
        out["feat_src"] = np.zeros((n, bucket.image_tokens), np.int32)
    elif ctx.layout is not None and not ctx.layout.images:
        for k in VISION_KEYS:
            del out[k]
    out.update(old_logprobs=np.zeros((n, t), np.float32), turn_ids=np.full((n, t), -1, np.int32),
               a_seq=np.zeros((n,), np.float32), a_turn=np.zeros((n, int(ctx.engine.cfg.max_turns)), np.float32))
    if pack_k is not None:
        out["pack_src"] = np.full((n, pack_k), -1, np.int32)
    return out


def warm_rewards(ctx: stages.GRPOContext) -> None:
    """The R_BAT kernels (`stages.score`) once on zero inputs of the step's global shapes and dtypes,
    and with several processes the allgathers that feed them and pick the step's bucket."""
    from codedance_jax.rl import rbat_advantages, rbat_rewards

    n, m = ctx.n_local * ctx.hosts, int(ctx.engine.cfg.max_turns)
    glob = (np.zeros(n, np.float32), np.zeros(n, bool), np.zeros((n, m), bool), np.zeros((n, m), bool))
    extra = {}
    if ctx.rbat.turn_stats == "all":
        extra["turn_valid"] = np.zeros((n, m), bool)
    if ctx.rbat.overlong_cache:
        extra["resp_len"] = np.zeros(n, np.float32)
    jax.block_until_ready(rbat_advantages(*glob, group_size=ctx.group_size, cfg=ctx.rbat, **extra))
    jax.block_until_ready(rbat_rewards(*glob, group_size=ctx.group_size, cfg=ctx.rbat, resp_len=extra.get("resp_len")))
    if ctx.hosts > 1:  # the step's allgathers (`stages.score`, `stages.batch`): one program per shape
        b = ctx.n_local
        for x in (np.zeros(b, np.float32), np.zeros(b, bool), np.zeros((b, m), bool)):
            stages.global_view(x)
        max_bucket_across_hosts(0)


def warm_up(ctx: stages.GRPOContext, run: setup.Run, eval_engine=None, eval_prompts: int = 0) -> dict:
    """Compile the plan (see the module docstring). Returns {"programs": [...], "compilations",
    "seconds", "rollout_s", "update_s"}."""
    t0, c0 = time.perf_counter(), CompileCounter.total()
    rows, todo = [], []
    rng = setup.replicated_key(0, ctx.mesh)

    def compile_update(arrays, shardings, key):
        if ctx.ref_params is not None:  # the reference's log-probs enter as the old ones do: abstract here
            arrays = {**arrays, "ref_logprobs": jax.ShapeDtypeStruct(arrays["old_logprobs"].shape, np.float32,
                                                                     sharding=shardings["old_logprobs"])}
            shardings = {**shardings, "ref_logprobs": shardings["old_logprobs"]}
        fn = stages.build_update(ctx, run, shardings)
        return stages.update_key(ctx, key), fn.lower(run.state, arrays, rng).compile()

    # The update compiles (the plan's largest programs) start first, in two threads; the reference
    # log-probs, the R_BAT kernels and the rollout warm up meanwhile on this thread.
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = []
        for bucket, k, r in variants(ctx):
            local = planned_batch(ctx, bucket, k, r)
            arrays, shardings = stages.place_batch(ctx, local)
            b = stages.GRPOBatch(local, arrays, shardings, setup.batch_key(local), 0.0)
            futures.append(pool.submit(compile_update, b.arrays, b.shardings, b.key))
            todo.append(b)
            rows.append({"program": "update", "tokens": bucket.tokens, "rows": ctx.rows, "packed_width": k,
                         "vision_rows": r if r is not None else ctx.rows})
            if ctx.ref_params is not None:
                rows.append({**rows[-1], "program": "reference log-probs"})
        for b in todo:
            stages.old_logprobs(ctx, run, b)  # compiles (and runs) the reference's log-probs, KL on
        warm_rewards(ctx)
        rows.append({"program": "R_BAT advantages and rewards", "rows": ctx.n_local * ctx.hosts})
        tr = time.perf_counter()
        n_prompts = ctx.n_local // ctx.group_size
        rw = ctx.engine.warm_up(n_prompts, ctx.group_size)
        rows += [{"program": f"rollout {p['program']}", **{k: v for k, v in p.items() if k != "program"}}
                 for p in ctx.engine.plan.programs()]
        if eval_engine is not None and eval_prompts:
            eval_engine.warm_up(eval_prompts, 1)
            rows += [{"program": f"evaluation {p['program']}", **{k: v for k, v in p.items() if k != "program"}}
                     for p in eval_engine.plan.programs()]
        rollout_s = time.perf_counter() - tr
        for f in futures:
            key, compiled = f.result()
            run.steps.put(key, compiled)
    return {"programs": rows, "compilations": CompileCounter.total() - c0, "seconds": time.perf_counter() - t0,
            "rollout_s": rollout_s, "rollout_compilations": rw["compilations"]}
