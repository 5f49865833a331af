"""`evaluate(config, workdir)`: load the checkpoint and the benchmark, roll out, score, report.

What `python -m launch.eval` calls (configs/eval.py documents every field). The sandbox pool is
owned by a `sandbox.PoolThread` (the trainers' owner too) and closed at the end; rollouts go
through `eval.rollouts.evaluate` (via `RolloutPolicy`), the one evaluation rollout of the project;
`sandbox.kind="none"` runs without code execution (code turns get an error observation: for
machines without root).

Two layouts: `config.mesh` is how the checkpoint is loaded (its parameters read onto that mesh,
fsdp over all devices by default); sampling runs on the host's sampling mesh,
`config.rollout.mesh_data` x `mesh_tensor` of this process's own devices (every one by default),
where the parameters are then placed device to device (`codedance_jax.rollout.placement`) and the
loaded copy dropped, so one copy stays alive. Each batch's rows are split over its `data` axis.
"""

from __future__ import annotations

import contextlib
import json
import os

from absl import logging

from codedance_jax.errors import ConfigError


def evaluate(config, workdir: str) -> dict:
    import codedance_jax
    from codedance_jax.sharding import make_mesh
    from eval.judge import Judge
    from eval.loaders import load_benchmark
    from eval.policy import RolloutPolicy
    from eval.report import write_report
    from eval.runner import run_eval

    if not config.checkpoint:
        raise ConfigError("--config.checkpoint is empty: give a Hugging Face Qwen2.5-VL directory or a converted one")
    if not config.data_path:
        raise ConfigError(
            f"--config.data_path is empty: give the {config.benchmark} file (VLMEvalKit TSV or the "
            f"release) or a directory holding it"
        )
    if config.sandbox.kind not in ("pool", "none"):
        raise ConfigError(f"config.sandbox.kind={config.sandbox.kind!r}", "choose 'pool' or 'none'")
    # Inputs first: a bad path or file stops the run before anything is written to the workdir.
    items = load_benchmark(config.benchmark, config.data_path, limit=config.limit or None)
    import jax

    from eval import multihost

    n_proc, proc = jax.process_count(), jax.process_index()
    all_ids = [it.index for it in items]
    run_dir = workdir
    if n_proc > 1:  # each process evaluates every n-th item on its own devices (eval/multihost.py)
        items = multihost.share(items, proc, n_proc)
        run_dir = multihost.process_dir(workdir, proc)
        os.makedirs(run_dir, exist_ok=True)
    sm = sampling_mesh_of(config)  # checked before the checkpoint is read
    mesh = make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor,
                     devices=jax.local_devices() if n_proc > 1 else None)
    model, processor = codedance_jax.from_pretrained(config.checkpoint, dtype=config.dtype, mesh=mesh,
                                                     sharding_tolerance=config.sharding_tolerance)
    model = on_sampling_mesh(model, sm)  # rebinding `model` frees the loaded (fsdp) copy
    os.makedirs(workdir, exist_ok=True)  # inputs and checkpoint are good: the run starts writing
    if proc == 0:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json(indent=2))
    judge = (Judge(config.judge.url, config.judge.model, benchmark=config.benchmark,
                   api_key_env=config.judge.api_key_env, timeout_s=config.judge.get("timeout_s", 60.0),
                   retries=config.judge.get("retries", 2)) if config.judge.enabled else None)
    with contextlib.ExitStack() as stack:
        pool = None
        if config.max_turns > 0 and config.sandbox.kind == "pool":
            from sandbox import PoolThread

            pool = stack.enter_context(
                PoolThread(
                    num_workers=config.sandbox.num_workers,
                    timeout_s=config.sandbox.timeout_s,
                    memory_mb=config.sandbox.memory_mb,
                )
            )
        elif config.sandbox.kind not in ("pool", "none"):
            raise ConfigError(f"sandbox.kind must be 'pool' or 'none', got {config.sandbox.kind!r}")
        policy = RolloutPolicy(
            model,
            processor,
            max_turns=config.max_turns,
            sandbox=pool,
            policy_path=os.path.abspath(config.checkpoint),
            turn_format=config.turn_format,
            rollout=dict(config.rollout),
            mesh=sm,  # rows over its data axis; the parameters placed for it
        )
        summary = run_eval(
            config.benchmark, items, policy, run_dir, batch_size=config.batch_size, judge=judge, log=logging.info
        )
    with open(os.path.join(run_dir, "rollout_stats.jsonl"), "a") as f:
        for s in policy.stats:
            f.write(json.dumps(s) + "\n")
    if n_proc > 1:
        multihost.barrier("eval-done")
        if proc == 0:
            summary = multihost.merge(workdir, config.benchmark, all_ids, n_proc, judge_used=judge is not None)
        multihost.barrier("eval-merged")
        if proc != 0:
            with open(os.path.join(workdir, "summary.json")) as f:
                summary = json.load(f)
            return summary
    _write_tool_use(workdir)
    write_report(workdir, summary)
    logging.info("summary: %s", json.dumps(summary))
    return summary


def sampling_mesh_of(config):
    """The host's sampling mesh: `config.rollout.mesh_data` (-1: all that mesh_tensor leaves) x
    `mesh_tensor` of this process's devices, checked against `rollout.batch_multiple`
    (`placement.rollout_sampling_mesh`, as the GRPO loop builds its own)."""
    from codedance_jax.rollout.placement import rollout_sampling_mesh

    return rollout_sampling_mesh(config.rollout)


def on_sampling_mesh(model, mesh):
    """`model` with its parameters placed for the sampling mesh (`placement.sampling_model`; split over
    `tensor` by the logical axes of `sharding.DEFAULT_RULES`, the table the checkpoint was loaded
    with). The caller rebinds its name to the result, so the loaded copy is freed."""
    from codedance_jax.rollout.placement import sampling_model

    return sampling_model(model, mesh)


def _write_tool_use(workdir: str) -> None:
    """`tool_use.json`: the executed cells' libraries, calls and behaviours (`eval.tool_analytics`)."""
    from eval import tool_analytics
    from eval.runner import TRAJECTORIES, read_jsonl

    records = list({r["id"]: r for r in read_jsonl(os.path.join(workdir, TRAJECTORIES))[0]}.values())
    with open(os.path.join(workdir, "tool_use.json"), "w") as f:
        json.dump(tool_analytics.analyze(records, keys=()), f, indent=2)
