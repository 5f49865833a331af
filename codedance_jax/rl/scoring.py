"""Score finished rollouts: R_acc, format, per-turn execution arrays, and the summary metrics.

Host side, per trajectory: the assistant turns are the texts the rollout engine recorded
(`turns[m]["text"]`, the decode of exactly what was sampled; records without them, e.g. older
JSONL files, are decoded here from `tokens` where `turn_ids == m`); R_acc verifies the answer the
engine recorded (`Trajectory.answer`, read by `protocol.extract_answer`; `answers.answer_reward`);
the format check reads the list of turns; `turn_arrays` packs turn statuses for the R_BAT kernel.
The result also fills the trajectory record's `answer` (for records without turn texts),
`correct` and `rewards`.

Metrics (SPEC section 2): accuracy, average turns per trajectory, execution success rate =
successful executions / executions; plus tool calls per trajectory and the tool-call rate (share
of trajectories with at least one executed call), optionally per metadata value (e.g. per
difficulty), which is how adaptive tool use shows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from codedance_jax.rl.answers import answer_reward, extract_answer
from codedance_jax.rl.format import check_format
from codedance_jax.rl.rbat import RBATConfig, turn_arrays

EXECUTED = ("ok", "error", "timeout", "crashed")


@dataclasses.dataclass
class Scored:
    acc: np.ndarray  # float32[B]
    fmt_ok: np.ndarray  # bool[B]
    turn_is_tool: np.ndarray  # bool[B, M]
    turn_failed: np.ndarray  # bool[B, M]
    turn_valid: np.ndarray | None = None  # bool[B, M]: the turns each trajectory took (R_turn over all turns)
    resp_len: np.ndarray | None = None  # float32[B]: sampled tokens (DAPO's overlong shaping)


def recorded_turns(traj) -> list[str] | None:
    """The engine's text of each assistant turn, or None when the record does not carry them all."""
    tid = np.asarray(traj.turn_ids)
    n = int(tid.max()) + 1 if len(tid) and tid.max() >= 0 else 0
    texts = [t.get("text") for t in traj.turns]
    return texts if len(texts) == n and all(isinstance(x, str) for x in texts) else None


def assistant_turns(traj, processor) -> list[str]:
    """The text of each assistant turn: as the engine recorded it, else decoded from the tokens."""
    texts = recorded_turns(traj)
    if texts is not None:
        return texts
    ids = np.asarray(traj.tokens)
    tid = np.asarray(traj.turn_ids)
    n = int(tid.max()) + 1 if len(tid) and tid.max() >= 0 else 0
    return [processor.decode(ids[tid == m].tolist()) for m in range(n)]


def _clean_turns(turns: Sequence[dict]) -> list[dict]:
    """A row the host gave up on can end with a turn that has no status: count it as crashed code
    (or a plain final turn when it wrote no code)."""
    out = []
    for m, t in enumerate(turns):
        st = t.get("status")
        if st is None:
            st = "crashed" if t.get("code") is not None or m < len(turns) - 1 else "no_code"
        out.append({**t, "status": st})
    return out


def score(trajs, golds: Sequence[str], processor, *, max_turns: int, cfg: RBATConfig | None = None,
          turn_format: str = "code", questions: Sequence[str] | None = None) -> Scored:
    """Score `trajs` against `golds` (same order); fills `answer`, `correct` and `rewards` of each."""
    cfg = cfg or RBATConfig.paper()
    acc = np.zeros(len(trajs), np.float32)
    fmt_ok = np.zeros(len(trajs), bool)
    for i, (t, gold) in enumerate(zip(trajs, golds, strict=True)):
        turns = assistant_turns(t, processor)
        if recorded_turns(t) is None:  # not from the engine of this version: read the answer here
            t.answer = extract_answer(turns[-1]) if turns else None
        acc[i] = answer_reward(t.answer, gold, question=questions[i] if questions else "")
        fmt_ok[i] = bool(turns) and check_format(turns, turn_format).ok
        t.correct = bool(acc[i] > 0)
    is_tool, failed = turn_arrays([_clean_turns(t.turns) for t in trajs], max_turns=max_turns, cfg=cfg)
    n_turns = np.array([len(t.turns) for t in trajs], np.int64)
    valid = np.arange(max_turns)[None, :] < n_turns[:, None]  # [B, M]
    resp_len = np.array([float(np.sum(t.loss_mask)) for t in trajs], np.float32)
    return Scored(acc, fmt_ok, is_tool, failed, valid, resp_len)


def _summary(trajs, acc) -> dict:
    n = len(trajs)
    if n == 0:
        return {}
    statuses = [s for t in trajs for s in t.turn_status]
    executed = [s for s in statuses if s in EXECUTED]
    calls = np.array([sum(s in EXECUTED for s in t.turn_status) for t in trajs], np.float32)
    return {
        "accuracy": float(np.mean(acc)),
        "avg_turns": float(np.mean([t.num_turns for t in trajs])),
        "exec_success": float(np.mean([s == "ok" for s in executed])) if executed else float("nan"),
        "tool_calls": float(calls.mean()),
        "tool_rate": float((calls > 0).mean()),
        "n": n,
    }


def metadata_groups(metas: Sequence[dict], keys: Sequence[str]) -> dict[str, list[int]]:
    """Row indices per `{key}={value}`, and per combination `a=x,b=y` when there are two or more
    keys: the groups (and key names) of `summarize` and of `eval.intervals`."""
    groups: dict[str, list[int]] = {}
    for i, m in enumerate(metas):
        for k in keys:
            groups.setdefault(f"{k}={m.get(k)}", []).append(i)
        if len(keys) > 1:
            groups.setdefault(",".join(f"{k}={m.get(k)}" for k in keys), []).append(i)
    return groups


def summarize(trajs, acc, metas: Sequence[dict] | None = None, keys: Sequence[str] = ()) -> dict:
    """Overall metrics, and per value of each metadata key (`{key}={value}/{metric}`), and per
    combination of the keys when there are two or more (`a=x,b=y/{metric}`)."""
    acc = np.asarray(acc, np.float32)
    out = _summary(trajs, acc)
    if not metas or not keys:
        return out
    for g, idx in sorted(metadata_groups(metas, keys).items()):
        for name, v in _summary([trajs[i] for i in idx], acc[idx]).items():
            out[f"{g}/{name}"] = v
    return out
