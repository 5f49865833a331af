"""One row of a rollout batch: its trajectory so far, its phase, and the turn it is writing.

A row is in exactly one `Phase`; the engine's loop moves it DECODE -> (QUEUED ->) EXEC -> READY ->
DECODE for a turn with code, and to DONE when its trajectory ends. PAD rows fill the static batch
up to its row multiple and never take part.
"""

from __future__ import annotations

import dataclasses
import enum
import traceback
from typing import Any

from codedance_jax.rollout.record import Trajectory


class Phase(enum.Enum):
    DECODE = "decode"  # sampling its current turn
    QUEUED = "queued"  # its code waits to be submitted (sequential mode: until no row decodes)
    EXEC = "exec"  # its code runs in its sandbox session
    READY = "ready"  # its observation is tokenized and waits to be appended
    DONE = "done"  # its trajectory has ended (`finish_reason` set)
    PAD = "pad"  # padding of the static batch: no trajectory


@dataclasses.dataclass
class Row:
    traj: Trajectory
    uid: int  # its sampling key stream
    index: int  # its row in the batch
    prompt: int = -1  # the index of its prompt (-1 for padding)
    session: Any = None
    session_future: Any = None  # the session being opened in the background (`SandboxTurns.want_session`)
    session_error: str | None = None
    phase: Phase = Phase.DECODE
    turn: int = 0
    next_pos: int = 0  # M-RoPE position of its next token
    sampled: int = 0  # tokens sampled over all its turns
    turn_ids: list = dataclasses.field(default_factory=list)  # the current turn's sampled ids ...
    turn_lps: list = dataclasses.field(default_factory=list)  # ... their log-probs
    turn_slots: list = dataclasses.field(default_factory=list)  # ... and cache slots (reset by a compaction)
    forced: list = dataclasses.field(default_factory=list)  # scripted ids still to be forced this turn
    code: str | None = None  # the code of the turn, until it is submitted
    future: Any = None  # its running cell: Future[ExecResult]
    submitted_at: float = 0.0
    obs: Any = None  # its observation waiting to be appended (`turns.Observation`)
    last_turn: bool = False  # its current turn is the last one allowed
    slots_held: bool = True  # it still holds cache slots (False once a compaction dropped them)

    def finish(self, reason: str) -> None:
        self.phase = Phase.DONE
        self.traj.finish_reason = reason

    def fail(self, e: BaseException) -> None:
        """End the row on a host error (the batch goes on): `finish_reason="error"`, message in `error`."""
        self.traj.error = "".join(traceback.format_exception_only(type(e), e)).strip()
        if self.future is not None:
            self.future.cancel()
            self.future = None
        self.finish("error")


def pad_row(index: int) -> Row:
    """A padding row: no trajectory to speak of, never takes part."""
    traj = Trajectory(
        id="",
        prompt_id="",
        group=0,
        prompt_len=0,
        tokens=[],
        loss_mask=[],
        turn_ids=[],
        logprobs=[],
        temperature=0.0,
        images=[],
        image_grid_thw=[],
        turn_status=[],
        turns=[],
    )
    return Row(traj=traj, uid=0, index=index, phase=Phase.PAD)


def trajectory_rows(prompts, group_size: int, seed_offset: int, temperature: float, policy: str | None) -> list[Row]:
    """Rows 0 .. P*G-1: prompt-major, the G members of a group contiguous; row k samples from key
    stream seed_offset + k. Their trajectories are empty until the prompt is prefilled."""
    rows = []
    for p_i, p in enumerate(prompts):
        for g in range(group_size):
            k = len(rows)
            traj = Trajectory(
                id=f"{p.id}-{g}",
                prompt_id=p.id,
                group=g,
                prompt_len=0,
                tokens=[],
                loss_mask=[],
                turn_ids=[],
                logprobs=[],
                temperature=temperature,
                images=list(p.images),
                image_grid_thw=[],
                turn_status=[],
                turns=[],
                policy=policy,
            )
            rows.append(Row(traj=traj, uid=seed_offset + k, index=k, prompt=p_i))
    return rows
