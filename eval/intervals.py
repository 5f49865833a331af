"""95% confidence intervals for the evaluation's rates: Wilson score intervals, on an effective
sample size where outcomes come in clusters.

    wilson(k, n)                          -> (lo, hi)    k successes in n independent trials
    clustered_wilson(successes, trials)   -> (lo, hi, n_eff)   one entry per cluster
    difference(p_a, ci_a, p_b, ci_b)      -> (lo, hi)    of p_b - p_a (Newcombe's hybrid score)
    rate_intervals(records, keys)         -> {"accuracy_ci95": [lo, hi], "family=count/tool_rate_ci95": ...}
    mcnemar_exact(b, c)                   -> p           paired greedy outcomes: exact McNemar test
    tango_interval(b, c, n)               -> (lo, hi)    of (b - c) / n, paired (Tango's score interval)
    bootstrap_difference(before, after)   -> (lo, hi)    of mean(after - before) over items (bootstrap)
    paired_accuracy(before_recs, after_recs, keys, sampled=...) -> {"groups": {"all": {...}, ...}, ...}

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
It is the one to use when only the two summaries are at hand (rates, no per-item outcomes), and
for rates that are not one outcome per item (tool-call rate of sampled draws, execution success).

When both evaluations' per-item records are at hand, accuracy is compared item by item
(`paired_accuracy`, items matched by `prompt_id`), which removes the between-item variance that
makes Newcombe's interval wide. On 120 items Newcombe's interval excludes 0 from +10 points (near
80-95% accuracy) to +13 points (near 50%), whatever the pairing; the paired one needs b - c of about
2 sqrt(b + c) items: +5 points (6 items) when at most 8 items change, +8 points when 18 change.

- Greedy (one outcome per item and policy): only the discordant items carry information,
  b = right after and wrong before, c = the reverse. The test of "no change" is McNemar's exact
  (conditional) test: under H0 each discordant item is b or c with probability 1/2, so
  p = min(1, 2 P(X <= min(b, c))) with X ~ Binomial(b + c, 1/2) (two-sided by doubling, which is
  the same as summing the outcomes no more likely than the one seen, the binomial being symmetric).
  The interval of the paired difference (b - c) / n is Tango's score interval (Tango 1998,
  "Equivalence test and confidence interval for the difference in proportions for the
  paired-sample design", Stat. Med. 17:891-908): the differences d not rejected by the score
  test whose variance uses the multinomial MLE restricted to d. It has near-nominal coverage down
  to small n and discordant counts of 0 (Fagerland, Lydersen & Laake 2014, "Recommended tests and
  confidence intervals for paired binomial proportions", Stat. Med. 33:2850; they recommend it
  for the paired difference), stays inside [-1, 1] and is never empty. It is asymptotic, not
  exact: at d = 0 its statistic is McNemar's asymptotic one, (b - c) / sqrt(b + c), so where the
  exact p sits just above 0.05 the interval can still just exclude 0 (b = 6, c = 16 of 161: exact
  p = 0.052, interval [-12.4, -0.5] points). The report shows both.
- Sampled (k draws per item and policy): each item's outcome is its share of correct draws; the
  items are the independent units, so the interval of the mean per-item difference comes from a
  bootstrap over items (resample the items with replacement, the same resample for both
  policies; B = 2000, a fixed seed, so the report is reproducible; 2.5 and 97.5 percentiles).
  No test p-value is given for it: the interval is the statement.
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


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided p-value of McNemar's exact (conditional binomial) test: 2 P(X <= min(b, c)) for
    X ~ Binomial(b + c, 1/2), at most 1; 1 when no item changed (b = c = 0). `b`, `c`: the
    discordant counts (right after only, right before only). Exact in integers, then divided."""
    b, c = int(b), int(c)
    if b < 0 or c < 0:
        raise ValueError(f"mcnemar_exact: discordant counts must be >= 0, got b={b}, c={c}")
    m = b + c
    tail = sum(math.comb(m, i) for i in range(min(b, c) + 1))
    return min(1.0, 2 * tail / 2**m)


def _tango_z(d: float, b: int, c: int, n: int) -> float:
    """Tango's score statistic at difference d: (b - c - n d) / sqrt(n (2 q21 + d (1 - d))), with
    q21 (the probability of a `c` item) the multinomial MLE restricted to q12 - q21 = d (the larger
    root of 2n q^2 + B q + C = 0)."""
    big_a = 2.0 * n
    big_b = -b - c + (2.0 * n - b + c) * d
    big_c = -c * d * (1.0 - d)
    q21 = (math.sqrt(max(0.0, big_b * big_b - 4.0 * big_a * big_c)) - big_b) / (2.0 * big_a)
    num = b - c - n * d
    var = n * (2.0 * q21 + d * (1.0 - d))
    if var <= 0:  # at d = +-1 with nothing against it
        return 0.0 if num == 0 else math.copysign(math.inf, num)
    return num / math.sqrt(var)


def tango_interval(b: int, c: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Tango's (1998) score interval of the paired difference (b - c) / n (module doc): the d in
    [-1, 1] with |Z(d)| <= z. Z decreases in d and is 0 at (b - c) / n, so each bound is found by
    bisection to 1e-12. (nan, nan) when n is 0."""
    b, c, n = int(b), int(c), int(n)
    if n <= 0:
        return NAN2
    if b < 0 or c < 0 or b + c > n:
        raise ValueError(f"tango_interval: need 0 <= b, c and b + c <= n, got b={b}, c={c}, n={n}")
    est = (b - c) / n

    def root(lo: float, hi: float, target: float) -> float:
        # Z(lo) - target and Z(hi) - target have opposite signs; Z decreasing.
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            if _tango_z(mid, b, c, n) > target:
                lo = mid
            else:
                hi = mid
            if hi - lo < 1e-12:
                break
        return 0.5 * (lo + hi)

    lower = -1.0 if _tango_z(-1.0, b, c, n) <= z else root(-1.0, est, z)
    upper = 1.0 if _tango_z(1.0, b, c, n) >= -z else root(est, 1.0, -z)
    return lower, upper


def bootstrap_difference(before: Sequence[float], after: Sequence[float], n_boot: int = 2000, seed: int = 0,
                         level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of mean(after - before) over paired items: `n_boot` resamples
    of the items with replacement (one index draw per item, shared by both policies), from
    `np.random.default_rng(seed)`; the (1 - level) / 2 and (1 + level) / 2 percentiles (numpy's
    linear interpolation). (nan, nan) for no items."""
    d = np.asarray(after, np.float64) - np.asarray(before, np.float64)  # [items]
    n = len(d)
    if n == 0:
        return NAN2
    idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))  # [B, items]
    stats = d[idx].mean(axis=1)  # [B]
    lo, hi = np.percentile(stats, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


def item_outcomes(records: Sequence) -> dict[str, tuple[float, int, dict]]:
    """{item id: (correct draws, draws, meta)} of an evaluation's records (trajectories or their
    `trajectories.jsonl` dicts); the item is `prompt_id` (else `id`), meta the first record's."""
    out: dict[str, list] = {}
    for r in records:
        key = str(_get(r, "prompt_id", _get(r, "id")))
        acc = out.setdefault(key, [0.0, 0, dict(_get(r, "meta") or {})])
        acc[0] += float(bool(_get(r, "correct")))
        acc[1] += 1
    return {k: (v[0], v[1], v[2]) for k, v in out.items()}


def _paired_group(y_b: np.ndarray, y_a: np.ndarray, m_b: np.ndarray, m_a: np.ndarray, sampled: bool,
                  n_boot: int, seed: int, z: float) -> dict:
    """One group's comparison; y: correct draws per item, m: draws per item ([items] each)."""
    acc_b, acc_a = y_b / m_b, y_a / m_a  # [items] per-item accuracy
    n = len(acc_b)
    pb, pa = float(y_b.sum() / m_b.sum()), float(y_a.sum() / m_a.sum())
    newcombe = difference(pb, clustered_wilson(y_b, m_b, z)[:2], pa, clustered_wilson(y_a, m_a, z)[:2])
    out = {"n_items": n, "before": float(acc_b.mean()), "after": float(acc_a.mean()),
           "diff": float((acc_a - acc_b).mean())}
    if sampled:
        ci = bootstrap_difference(acc_b, acc_a, n_boot, seed)
    else:
        b, c = int(np.sum((acc_a == 1) & (acc_b == 0))), int(np.sum((acc_a == 0) & (acc_b == 1)))
        ci = tango_interval(b, c, n, z)
        out.update(b=b, c=c, mcnemar_p=mcnemar_exact(b, c))
    out["paired_ci95"] = list(ci)
    out["paired_excludes_0"] = bool(ci[0] > 0 or ci[1] < 0)
    out["newcombe_ci95"] = list(newcombe)
    out["newcombe_excludes_0"] = bool(newcombe[0] > 0 or newcombe[1] < 0)
    return out


def paired_accuracy(before: Sequence, after: Sequence, keys: Sequence[str] = (), *, sampled: bool,
                    n_boot: int = 2000, seed: int = 0, z: float = Z95) -> dict:
    """Accuracy of `after` minus `before` on the items both evaluated (matched by `prompt_id`),
    overall (`"all"`) and per group of `keys` under `rl.scoring`'s group names (`difficulty=hard`,
    `family=count,difficulty=hard`; from the before-record's `meta`).

    Greedy (`sampled=False`, one record per item on each side, else ValueError): per group `b`,
    `c`, `mcnemar_p` (`mcnemar_exact`) and `paired_ci95` (`tango_interval`). Sampled: `paired_ci95`
    from `bootstrap_difference` on per-item accuracies (`n_boot`, `seed`; the same seed per group).
    Every group also has `n_items`, `before`, `after` (mean per-item accuracy), `diff` (after -
    before), `paired_excludes_0`, and Newcombe's interval from the two (clustered) Wilson intervals
    (`newcombe_ci95`, `newcombe_excludes_0`) for comparison. Returns {"sampled", "method", "n_items",
    "before_only", "after_only" (items in one evaluation only: counted, left out), "groups"}."""
    ob, oa = item_outcomes(before), item_outcomes(after)
    ids = [k for k in ob if k in oa]
    if not sampled:
        for name, o in (("before", ob), ("after", oa)):
            many = [k for k in ids if o[k][1] != 1]
            if many:
                raise ValueError(f"paired_accuracy: a greedy comparison needs one record per item, but the "
                                 f"{name} evaluation has {o[many[0]][1]} for item {many[0]!r} ({len(many)} such "
                                 f"items); compare sampled evaluations with sampled=True")
    method = (f"bootstrap over items: {n_boot} resamples, seed {seed}, percentile interval" if sampled
              else "McNemar's exact test, Tango's (1998) score interval")
    out = {"sampled": bool(sampled), "method": method, "n_items": len(ids), "before_only": sum(k not in oa for k in ob),
           "after_only": sum(k not in ob for k in oa), "groups": {}}
    if not ids:
        return out
    arr = np.asarray([(ob[k][0], ob[k][1], oa[k][0], oa[k][1]) for k in ids], np.float64)  # [items, 4]
    groups = {"all": list(range(len(ids)))}
    if keys:
        from codedance_jax.rl.scoring import metadata_groups  # here: scoring imports JAX (rbat)

        groups.update(sorted(metadata_groups([ob[k][2] or oa[k][2] for k in ids], keys).items()))
    for g, idx in groups.items():
        a = arr[idx]
        out["groups"][g] = _paired_group(a[:, 0], a[:, 2], a[:, 1], a[:, 3], sampled, n_boot, seed, z)
    return out
