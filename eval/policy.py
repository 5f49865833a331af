"""The policy interface the evaluation runner drives, and its adapter to the rollout engine.

    policy(prompts: list[EvalPrompt]) -> list[Trajectory]     # one trajectory per prompt, same order

A `Trajectory` is `codedance_jax.rollout.Trajectory`, the SPEC section 2 record (tokens, loss_mask,
turn_ids, logprobs, images, turn_status, turns, answer, ...). A policy also carries the
`processor` that decodes its tokens (the report shows each turn's text).

`RolloutPolicy` runs greedy multi-turn rollouts with `RolloutEngine` (SamplingConfig(greedy=True)),
the paper's RL prompt (SPEC section 2) and a sandbox pool. `max_turns=0` asks for a text-only answer:
the prompt leaves out the code instructions, the engine gets one turn and no sandbox (a code block
written anyway gets a "sandbox unavailable" observation and ends the trajectory).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from codedance_jax.rollout import RolloutConfig, RolloutEngine, SamplingConfig, Trajectory


@dataclasses.dataclass
class EvalPrompt:
    id: str  # the benchmark item's index
    question: str
    images: list[Any]  # PIL images


class Policy(Protocol):
    processor: Any

    def __call__(self, prompts: Sequence[EvalPrompt]) -> list[Trajectory]: ...


class RolloutPolicy:
    """Greedy rollouts of `model` through `RolloutEngine` (see the module docstring).

    `rollout`: RolloutConfig fields (token budgets, buckets, observation limits); `sandbox`: a
    `SandboxPool` (or anything with its `new_session` interface), None for no code execution;
    `script(row, turn)`: forced text per turn (scripted policies in tests). `mesh`: the sampling mesh
    the model's parameters are placed for (`placement.sampling_mesh` / `sampling_params`); with a
    `data` axis over several devices each batch's rows are split over it (`RolloutEngine(mesh=)`).
    `rollout`'s `mesh_data` / `mesh_tensor` (a run config's block) name that mesh, not the engine's
    config: they are left out here.
    """

    def __init__(
        self,
        model,
        processor,
        *,
        max_turns: int = 10,
        sandbox=None,
        policy_path: str | None = None,
        turn_format: str = "code",
        rollout: dict | None = None,
        script: Callable[[int, int], str | None] | None = None,
        mesh=None,
    ):
        self.processor, self.sandbox, self.script = processor, sandbox, script
        self.max_turns, self.turn_format = max_turns, turn_format
        fields = {k: v for k, v in (rollout or {}).items() if k not in ("mesh_data", "mesh_tensor")}
        cfg = RolloutConfig.eval(
            **{**fields, "max_turns": max(1, max_turns), "turn_format": turn_format, "policy": policy_path}
        )
        self.engine = RolloutEngine(model, processor, cfg, SamplingConfig(greedy=True), mesh=mesh)
        self.stats: list[dict] = []

    def __call__(self, prompts: Sequence[EvalPrompt]) -> list[Trajectory]:
        from eval.rollouts import evaluate

        text_only = self.max_turns == 0
        res = evaluate(self.engine, prompts, None if text_only else self.sandbox, text_only=text_only,
                       script=self.script)
        self.stats += res.stats
        return res.trajectories
