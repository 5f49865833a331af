"""Which prompts and trajectories enter the GRPO update: pure functions of host arrays.

All three are off by default (the paper trains on every trajectory of every prompt):

- `no_signal_groups` — DAPO's dynamic sampling (Yu et al. 2025, "DAPO", eq. 11: keep a group only
  when 0 < |{o_i correct}| < G). Groups whose values (accuracy, or the whole sequence reward) are
  all equal carry no contrast. Here they are *dropped* from the loss (their rows train no token)
  and counted; DAPO instead keeps sampling prompts until the batch is full, which this does not do,
  so a step trains on fewer groups. They are dropped after the advantages: A_seq is per group (0
  for such a group anyway) but R_turn's batch statistics still include their turns.
- `truncated` — Mini-o3's over-turn masking (Lai et al. 2025): a trajectory that ran out of the
  turn or token budget without answering (`TRUNCATED_REASONS`) contributes no loss, so the policy
  is not pushed away from long explorations merely because the budget cut them. Its reward still
  enters its group's statistics (as in Mini-o3, only the loss is masked).
- `keep_by_pass_rate` — the release's difficulty-filtered RL data: keep the prompts that the initial
  policy answers correctly in some but not all of k samples.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# rollout.record.FINISH_REASONS that end a trajectory by a budget rather than by an answer or a stop.
TRUNCATED_REASONS = ("max_turns", "turn_tokens", "new_tokens", "length")
GROUP_FILTERS = ("off", "acc", "reward")


def no_signal_groups(values: np.ndarray, group_size: int, *, atol: float = 1e-6) -> np.ndarray:
    """bool[B]: True on every row of a group whose `values` are all equal (within atol).

    values: [B], B = P·G with a prompt's G trajectories contiguous (the R_BAT kernel's layout).
    """
    v = np.asarray(values, np.float64)
    if v.ndim != 1 or v.shape[0] % group_size:
        raise ValueError(f"values of shape {v.shape} are not whole groups of {group_size}")
    grp = v.reshape(-1, group_size)  # [P, G]
    flat = (grp.max(axis=1) - grp.min(axis=1)) <= atol  # [P]
    return np.repeat(flat, group_size)


def truncated(finish_reasons: Sequence[str]) -> np.ndarray:
    """bool[B]: the trajectory hit the turn or token budget without an answer."""
    return np.array([r in TRUNCATED_REASONS for r in finish_reasons], bool)


def keep_by_pass_rate(passes: np.ndarray, k: int, lo: float, hi: float) -> np.ndarray:
    """bool[P]: keep prompt p when lo < passes[p] / k < hi (strict on both sides).

    passes: int[P], correct answers in k samples of the initial policy. (0, 1) keeps the prompts it
    sometimes gets right: 0 < passes < k; a bound outside [0, 1] leaves that side open, e.g.
    (−1, 0.5) keeps the never-solved prompts too.
    """
    p = np.asarray(passes)
    if k < 1:
        raise ValueError(f"k={k}: need at least one sample per prompt")
    if np.any((p < 0) | (p > k)):
        raise ValueError(f"pass counts must lie in [0, k={k}], got {p.min()}..{p.max()}")
    if not lo < hi:
        raise ValueError(f"pass-rate bounds (lo={lo}, hi={hi}): need lo < hi")
    rate = p / k
    return (rate > lo) & (rate < hi)
