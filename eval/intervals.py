"""95% confidence intervals for the evaluation's rates: Wilson score intervals, on an effective
sample size where outcomes come in clusters.

    wilson(k, n)                          -> (lo, hi)    k successes in n independent trials
    clustered_wilson(successes, trials)   -> (lo, hi, n_eff)   one entry per cluster
    difference(p_a, ci_a, p_b, ci_b)      -> (lo, hi)    of p_b - p_a (Newcombe's hybrid score)
    rate_intervals(records, keys)         -> {"accuracy_ci95": [lo, hi], "family=count/tool_rate_ci95": ...}

Why Wilson: the held-out groups are small (20 items per family x difficulty in the demo) and
their rates sit near 0 or 1 (hard items' tool use, easy items' accuracy), where the normal
(Wald) interval collapses to zero width at 0/n or n/n and undercovers near the edges; Wilson's
interval stays inside [0, 1], is never empty, and keeps close to its nominal coverage at small n
(Brown, Cai & DasGupta 2001, "Interval estimation for a binomial proportion").

Why an effective sample size: the trials behind a rate are not always independent. A sampled
evaluation draws k trajectories per item, and the k draws of one item agree far more often than
draws of two items do; execution success counts executions, and one trajectory's executions
share their code. Both are clusters (the item; the trajectory). The rate is a ratio estimator
p = sum(y_i) / sum(m_i) over clusters i with y_i successes in m_i trials; its variance,
sum((y_i - p m_i)^2) / (sum m_i)^2, divided by the binomial p(1 - p) / sum(m_i), is the design
effect (Kish), clipped to [1, max m_i] (no narrower than independent trials, no wider than one
trial per cluster). The interval is Wilson's at p with n_eff = sum(m_i) / deff. With one trial
per cluster (greedy accuracy and tool-call rate) deff is exactly 1 and this is the plain Wilson
interval of k in n. At p = 0 or 1 the effect cannot be estimated (no variance) and n_eff is the
number of clusters: 0 of 4 draws on each of 20 items is reported as 0/20 is, not as 0/80.

Rates of the same items before and after a change (SFT vs GRPO) are compared with Newcombe's
hybrid score interval of the difference, built from the two Wilson intervals. It treats the two
evaluations as independent; on the same items they are positively correlated, which makes the
interval conservative (wider than it needs to be), so a difference whose interval excludes 0 is one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile
EXECUTED = ("ok", "error", "timeout", "crashed")  # as codedance_jax.rl.scoring counts executions
RATES = ("accuracy", "tool_rate", "exec_success")
NAN2 = (float("nan"), float("nan"))


def wilson(successes: float, n: float, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of `successes` in `n` trials (n may be an effective, non-integer size);
    (nan, nan) when n is 0."""
    if n <= 0:
        return NAN2
    p = min(max(successes / n, 0.0), 1.0)
    z2 = z * z
    denom = 1.0 + z2 / n
    centre = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denom
    # At 0/n and n/n the bound is exactly 0 (1); rounding would leave 1e-17 (1 - 1e-16).
    return (0.0 if p == 0 else max(0.0, centre - half)), (1.0 if p == 1 else min(1.0, centre + half))


def design_effect(successes: Sequence[float], trials: Sequence[float]) -> float:
    """Kish's design effect of the ratio estimator sum(y) / sum(m), clipped to [1, max m]. At a rate
    of 0 or 1 there is no variance to estimate it from; every cluster agreeing is what clusters
    that decide their trials would give, so the effect is then the mean cluster size (n_eff = the
    number of clusters; 1 with one trial per cluster)."""
    y, m = np.asarray(successes, np.float64), np.asarray(trials, np.float64)
    keep = m > 0
    y, m = y[keep], m[keep]
    total = m.sum()
    if total <= 0:
        return 1.0
    p = y.sum() / total
    binom = p * (1 - p) / total
    if binom <= 0:
        return float(total / len(m))
    ratio = float(np.sum((y - p * m) ** 2)) / total**2
    return float(np.clip(ratio / binom, 1.0, max(1.0, float(m.max()))))


def clustered_wilson(successes: Sequence[float], trials: Sequence[float], z: float = Z95) -> tuple[float, float, float]:
    """Wilson interval of sum(successes) / sum(trials) on the effective sample size (module doc);
    returns (lo, hi, n_eff). Clusters with no trials are ignored."""
    y, m = np.asarray(successes, np.float64), np.asarray(trials, np.float64)
    keep = m > 0
    y, m = y[keep], m[keep]
    total = float(m.sum())
    if total <= 0:
        return (*NAN2, 0.0)
    n_eff = total / design_effect(y, m)
    lo, hi = wilson(float(y.sum()) / total * n_eff, n_eff, z)
    return lo, hi, n_eff


def difference(p_a: float, ci_a: Sequence[float], p_b: float, ci_b: Sequence[float]) -> tuple[float, float]:
    """Newcombe's hybrid score interval of p_b - p_a from each rate's interval (nan when either is)."""
    vals = [p_a, *ci_a, p_b, *ci_b]
    if any(v is None or not math.isfinite(float(v)) for v in vals):
        return NAN2
    (la, ua), (lb, ub) = ci_a, ci_b
    d = p_b - p_a
    # The lower bound pairs p_b's lower error with p_a's upper one (Newcombe 1998, method 10).
    return d - math.sqrt((p_b - lb) ** 2 + (ua - p_a) ** 2), d + math.sqrt((ub - p_b) ** 2 + (p_a - la) ** 2)


def _get(rec, name, default=None):
    return rec.get(name, default) if isinstance(rec, Mapping) else getattr(rec, name, default)


def _outcomes(rec) -> tuple[float, float, float, float]:
    """(correct, called a tool, successful executions, executions) of one trajectory (record or object)."""
    statuses = list(_get(rec, "turn_status") or [])
    executed = [s for s in statuses if s in EXECUTED]
    return (float(bool(_get(rec, "correct"))), float(bool(executed)),
            float(sum(s == "ok" for s in executed)), float(len(executed)))


def _group_intervals(recs: Sequence, z: float) -> dict[str, list[float]]:
    """Intervals of one group's rates, clustered by item (accuracy, tool rate) and by trajectory
    (execution success). `n_items`: the number of distinct items."""
    by_item: dict[str, list[float]] = {}
    rows = []
    for r in recs:
        o = _outcomes(r)
        rows.append(o)
        acc = by_item.setdefault(str(_get(r, "prompt_id", _get(r, "id"))), [0.0, 0.0, 0.0])
        acc[0] += o[0]
        acc[1] += o[1]
        acc[2] += 1
    items = np.asarray(list(by_item.values()), np.float64).reshape(-1, 3)
    ex = np.asarray(rows, np.float64).reshape(-1, 4)
    out = {
        "accuracy_ci95": list(clustered_wilson(items[:, 0], items[:, 2], z)[:2]),
        "tool_rate_ci95": list(clustered_wilson(items[:, 1], items[:, 2], z)[:2]),
        "exec_success_ci95": list(clustered_wilson(ex[:, 2], ex[:, 3], z)[:2]),
        "n_items": len(by_item),
    }
    return out


def rate_intervals(records: Sequence, metas: Sequence[Mapping] | None = None, keys: Sequence[str] = (),
                   z: float = Z95) -> dict:
    """`{metric}_ci95` = [lo, hi] for accuracy, tool_rate and exec_success, overall and per group,
    under `rl.scoring.summarize`'s key names (`difficulty=hard/tool_rate_ci95`,
    `family=count,difficulty=hard/accuracy_ci95`), plus `n_items` per group.

    `records`: trajectories or their `trajectories.jsonl` dicts (`correct`, `turn_status`,
    `prompt_id`); the k samples of an item share its `prompt_id`. `metas`: each record's metadata
    (default: the record's own `meta`)."""
    recs = list(records)
    if metas is None:
        metas = [dict(_get(r, "meta") or {}) for r in recs]
    from codedance_jax.rl.scoring import metadata_groups  # here: scoring imports JAX (rbat)

    out = dict(_group_intervals(recs, z)) if recs else {}
    for g, idx in sorted(metadata_groups(metas, keys).items()):
        for name, v in _group_intervals([recs[i] for i in idx], z).items():
            out[f"{g}/{name}"] = v
    return out
