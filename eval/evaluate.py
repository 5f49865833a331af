"""`evaluate(config, workdir)`: load the checkpoint and the benchmark, roll out, score, report.

What `python -m launch.eval` calls (configs/eval.py documents every field). The sandbox pool is
created here, in the calling (main, long-lived) thread, and closed at the end; `sandbox.kind="none"`
runs without code execution (code turns get an error observation: for machines without root).
"""

from __future__ import annotations

import contextlib
import json
import os

from absl import logging


def evaluate(config, workdir: str) -> dict:
    import codedance_jax
    from codedance_jax.sharding import make_mesh
    from eval.judge import Judge
    from eval.loaders import load_benchmark
    from eval.policy import RolloutPolicy
    from eval.report import write_report
    from eval.runner import run_eval

    if not config.checkpoint:
        raise ValueError("--config.checkpoint is empty: give a Hugging Face Qwen2.5-VL directory or a converted one")
    if not config.data_path:
        raise ValueError(
            f"--config.data_path is empty: give the {config.benchmark} file (VLMEvalKit TSV or the "
            f"release) or a directory holding it"
        )
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config.to_json(indent=2))
    items = load_benchmark(config.benchmark, config.data_path, limit=config.limit or None)
    mesh = make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
    model, processor = codedance_jax.from_pretrained(config.checkpoint, dtype=config.dtype, mesh=mesh,
                                                     sharding_tolerance=config.sharding_tolerance)
    judge = Judge(config.judge.url, config.judge.model, config.judge.api_key_env) if config.judge.enabled else None
    with contextlib.ExitStack() as stack:
        pool = None
        if config.max_turns > 0 and config.sandbox.kind == "pool":
            from sandbox import SandboxPool

            pool = stack.enter_context(
                SandboxPool(
                    num_workers=config.sandbox.num_workers,
                    timeout_s=config.sandbox.timeout_s,
                    memory_mb=config.sandbox.memory_mb,
                )
            )
        elif config.sandbox.kind not in ("pool", "none"):
            raise ValueError(f"sandbox.kind must be 'pool' or 'none', got {config.sandbox.kind!r}")
        policy = RolloutPolicy(
            model,
            processor,
            max_turns=config.max_turns,
            sandbox=pool,
            policy_path=os.path.abspath(config.checkpoint),
            turn_format=config.turn_format,
            rollout=dict(config.rollout),
        )
        summary = run_eval(
            config.benchmark, items, policy, workdir, batch_size=config.batch_size, judge=judge, log=logging.info
        )
    with open(os.path.join(workdir, "rollout_stats.jsonl"), "a") as f:
        for s in policy.stats:
            f.write(json.dumps(s) + "\n")
    write_report(workdir, summary)
    logging.info("summary: %s", json.dumps(summary))
    return summary
