"""Greedy evaluation rollouts: the one `evaluate(engine, prompts, pool)` of the project.

GRPO's periodic evaluation, the demo's evaluations before and after GRPO, and `launch.eval`
(through `eval.policy.RolloutPolicy` and `eval.runner.run_eval`) all roll out here: prompts
(anything with `id`, `question` and PIL `images`) in batches of `batch`, the paper's RL prompt
in the engine's turn format (or the text-only prompt), one trajectory per prompt, with the
engine's sampling (greedy in evaluation) and the given sandbox pool.

Prompts that carry a reference `answer` (RL prompts, the toy world) are scored here with the RL
reward's R_acc and format check (`rl.scoring.score`) and summarized (accuracy, average turns,
execution success, tool calls and tool rate, per value of each metadata key in `keys`).
Benchmark items carry no `answer` field; `eval.runner` scores them with VLMEvalKit's rules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from codedance_jax.rl import scoring
from codedance_jax.rollout import RolloutEngine, Trajectory, rl_prompt, text_only_prompt


@dataclasses.dataclass
class Evaluation:
    trajectories: list[Trajectory]  # one per prompt, in prompt order
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
) -> Evaluation:
    """Roll out `prompts` (batches of `batch`, default all at once) and score those with answers.

    `pool`: a `SandboxPool` (None: code turns get an error observation); `text_only`: the prompt
    without code instructions; `script(row, turn)`: forced text (scripted policies in tests).
    """
    cfg = engine.cfg
    batch = batch or max(1, len(prompts))
    trajs, stats = [], []
    for s in range(0, len(prompts), batch):
        chunk = prompts[s : s + batch]
        if text_only:
            ps = [text_only_prompt(engine.processor, p.id, p.question, p.images) for p in chunk]
        else:
            ps = [rl_prompt(engine.processor, p.id, p.question, p.images, cfg.turn_format) for p in chunk]
        out, st = engine.rollout(ps, group_size=1, sandbox=pool, script=script, seed_offset=seed_offset + s)
        trajs += out
        stats.append(st.as_dict())
    summary = {}
    if prompts and all(getattr(p, "answer", None) is not None for p in prompts):
        sc = scoring.score(trajs, [p.answer for p in prompts], engine.processor, max_turns=cfg.max_turns,
                           turn_format=cfg.turn_format, questions=[p.question for p in prompts])
        summary = scoring.summarize(trajs, sc.acc, [getattr(p, "meta", {}) for p in prompts], keys)
    return Evaluation(trajs, summary, stats)
