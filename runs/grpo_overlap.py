"""`config.async_rollout=1`: step k+1's rollouts sampled with step k's pre-update weights while step
k's update runs (one step off-policy, as verl's and AReaL's asynchronous modes with staleness 1).

    step k:  [take rollouts k] score, batch, ref log-probs | start(k+1) | update k | row k
    thread:                                                 [rollout k+1 ..........................]

Before the update donates the train state, `start` places a sampler copy of the parameters on the
sampling mesh that shares no device buffer with them (`grpo_stages.rollout_model(own=True)`: the
placement, then a device-to-device copy of any leaf it would alias; ready before the update is
dispatched), so the rollout thread never reads a donated array. The rollout (engine calls, sandbox
work, host-side turn handling) then runs in one background thread; JAX dispatch is thread-safe and
the sampling mesh is this process's own devices, so the thread issues no cross-process collective
(the placement's gather over the global mesh runs in `start`, on the loop's thread, in step with
the other processes).

Correctness one step off-policy: the importance ratio's denominator is the sampling policy's own
log-probs, recorded on each trajectory (`Trajectory.logprobs` -> the batch's `old_logprobs`); the
update's forward runs under the newer weights, so `grpo_stages.old_from_forward` turns
`recompute_old_logprobs` off whatever it says. Each row records `staleness` (updates between the
sampling policy and the update's: 0 or 1) and wall-clock `time/rollout_start`, `time/rollout_end`,
`time/update_start`, `time/update_end`.

What it does not do: the first step, and the first step after a resume, roll out synchronously
(staleness 0; an in-flight rollout lost to a crash is simply redone from the checkpoint, with the
checkpoint's weights); the loop waits for an in-flight rollout before an evaluation (which shares
the sandbox pool and the devices) and before it exits. On one CPU this cannot be faster.
"""

from __future__ import annotations

import concurrent.futures

from codedance_jax.errors import ConfigError
from runs import grpo_stages as stages
from runs import setup


def enabled(config) -> bool:
    """config.async_rollout, checked: 0 (rollout, then update) or 1 (overlapped, staleness 1)."""
    v = config.get("async_rollout", 0)
    if v not in (0, 1, False, True):
        raise ConfigError(f"config.async_rollout={v!r}: choose 0 (each step's rollouts sampled by its own policy) "
                          "or 1 (sampled by the previous step's while its update runs)")
    return bool(v)


class RolloutAhead:
    """At most one rollout in flight, for the step after the one being updated."""

    def __init__(self, ctx: stages.GRPOContext, run: setup.Run):
        self.ctx, self.run = ctx, run
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout-ahead")
        self._pending: tuple[int, concurrent.futures.Future] | None = None

    def start(self, step: int) -> None:
        """Roll out `step` in the background with the current (not yet updated) parameters: call it
        after step - 1's batch is built and before its update."""
        self.wait()
        run, ctx = self.run, self.ctx
        model = stages.rollout_model(run.mdef, run.state.params, ctx.sampling_mesh, ctx.rules, own=True)
        version = int(run.state.step)  # the updates these weights have had (the row's staleness: step - version)
        prompts = stages.step_prompts(ctx, step)
        fut = self._pool.submit(lambda: (prompts, stages.rollout(ctx, run, prompts, step, model, version=version)))
        self._pending = (step, fut)

    def take(self, step: int) -> tuple[stages.StepPrompts, stages.Rollouts] | None:
        """`step`'s (prompts, rollouts) when they were started ahead (the rollout's error re-raised
        here), else None: the caller rolls out synchronously."""
        if self._pending is None or self._pending[0] != step:
            self.wait()  # (a rollout of another step: not this one's, dropped)
            self._pending = None
            return None
        _, fut = self._pending
        self._pending = None
        return fut.result()

    def wait(self) -> None:
        """Block until no rollout is in flight (its result kept for `take`)."""
        if self._pending is not None:
            concurrent.futures.wait([self._pending[1]])

    def close(self) -> None:
        """Wait for an in-flight rollout (it uses the sandbox pool, closed after this) and stop the thread."""
        self.wait()
        self._pending = None
        self._pool.shutdown(wait=True)
