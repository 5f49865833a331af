"""Evaluation rollouts: the one `evaluate(engine, prompts, pool)` of the project.

GRPO's periodic evaluation, the demo's evaluations before and after GRPO, and `launch.eval`
(through `eval.policy.RolloutPolicy` and `eval.runner.run_eval`) all roll out here: prompts
(anything with `id`, `question` and PIL `images`) in batches of `batch`, the paper's RL prompt
in the engine's turn format (or the text-only prompt), `samples` trajectories per prompt (1 for a
greedy engine; k for a sampled evaluation, each draw keyed by its row so that a fixed seed gives
the same k draws whatever the batch size), with the engine's sampling and the given sandbox pool.

Prompts that carry a reference `answer` (RL prompts, the toy world) are scored here with the RL
reward's R_acc and format check (`rl.scoring.score`) and summarized (accuracy, average turns,
execution success, tool calls and tool rate, per value of each metadata key in `keys`); with
`intervals=True` the summary also holds each rate's 95% interval (`eval.intervals.rate_intervals`:
`accuracy_ci95`, `difficulty=hard/tool_rate_ci95`, ...; the k samples of an item are one cluster).
Benchmark items carry no `answer` field; `eval.runner` scores them with VLMEvalKit's rules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from codedance_jax.rl import scoring
from codedance_jax.rollout import RolloutEngine, Trajectory, rl_prompt, text_only_prompt
from eval.intervals import rate_intervals


@dataclasses.dataclass
class Evaluation:
    trajectories: list[Trajectory]  # `samples` per prompt, prompt-major (an item's samples contiguous)
    summary: dict  # rl.scoring.summarize; {} when the prompts carry no reference answers
    stats: list[dict]  # RolloutStats.as_dict() of each batch


def evaluate(
    engine: RolloutEngine,
    prompts: Sequence[Any],
    pool,
    *,
    batch: int | None = None,
    keys: Sequence[str] = (),
    seed_offset: int = 0,
    text_only: bool = False,
    script: Callable[[int, int], str | None] | None = None,
    samples: int = 1,
    intervals: bool = False,
    warm_up: bool = False,
) -> Evaluation:
    """Roll out `prompts` (batches of `batch`, default all at once) and score those with answers.

    `pool`: a `SandboxPool` (None: code turns get an error observation); `text_only`: the prompt
    without code instructions; `script(row, turn)`: forced text (scripted policies in tests);
    `samples`: trajectories per prompt (a sampling engine); `intervals`: add the 95% intervals;
    `warm_up`: compile the engine's shape plan for these batches first (`RolloutEngine.warm_up`), unless
    a plan it already has holds them, so no batch compiles anything.
    """
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    cfg = engine.cfg
    batch = batch or max(1, len(prompts))
    if warm_up and prompts and not engine.plan_holds(min(batch, len(prompts)), samples):
        engine.warm_up(min(batch, len(prompts)), samples)
    trajs, stats = [], []
    for s in range(0, len(prompts), batch):
        chunk = prompts[s : s + batch]
        if text_only:
            ps = [text_only_prompt(engine.processor, p.id, p.question, p.images) for p in chunk]
        else:
            ps = [rl_prompt(engine.processor, p.id, p.question, p.images, cfg.turn_format) for p in chunk]
        # Row uids (the sampling keys) run on across batches: batch s starts at row s * samples.
        out, st = engine.rollout(ps, group_size=samples, sandbox=pool, script=script,
                                 seed_offset=seed_offset + s * samples)
        trajs += out
        stats.append(st.as_dict())
    summary = {}
    if prompts and all(getattr(p, "answer", None) is not None for p in prompts):
        rep = [p for p in prompts for _ in range(samples)]  # the prompt of each trajectory
        sc = scoring.score(trajs, [p.answer for p in rep], engine.processor, max_turns=cfg.max_turns,
                           turn_format=cfg.turn_format, questions=[p.question for p in rep])
        metas = [getattr(p, "meta", {}) for p in rep]
        summary = scoring.summarize(trajs, sc.acc, metas, keys)
        if intervals:
            summary.update(rate_intervals(trajs, metas, keys))
            summary["samples_per_item"] = samples
    return Evaluation(trajs, summary, stats)
