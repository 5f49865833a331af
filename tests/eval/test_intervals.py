"""Wilson intervals (against published values and the formula), the clustered version, Newcombe's
difference, the per-group intervals of evaluation records, and the paired comparisons: McNemar's
exact test (against brute-force enumeration), Tango's score interval (published values and its
definition solved numerically), the bootstrap over items (against a plain loop with the same seed)."""

import itertools
import math

import numpy as np
import pytest

from eval.intervals import (
    Z95,
    bootstrap_difference,
    clustered_wilson,
    design_effect,
    difference,
    mcnemar_exact,
    paired_accuracy,
    rate_intervals,
    tango_interval,
    wilson,
)


def _formula(k, n, z=Z95):
    p = k / n
    c = (2 * n * p + z * z) / (2 * (n + z * z))
    h = z * math.sqrt(z * z + 4 * n * p * (1 - p)) / (2 * (n + z * z))
    return c - h, c + h


@pytest.mark.parametrize(("k", "n", "lo", "hi"), [  # Newcombe (1998), Stat. Med. 17:857, method 3
    (81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718),
])
def test_wilson_published_values(k, n, lo, hi):
    got = wilson(k, n)
    assert got == pytest.approx((lo, hi), abs=6e-5)


def test_wilson_formula_and_edges():
    rng = np.random.default_rng()
    for _ in range(20):
        n = int(rng.integers(1, 500))
        k = int(rng.integers(0, n + 1))
        lo, hi = wilson(k, n)
        flo, fhi = _formula(k, n)
        assert lo == pytest.approx(max(0.0, flo), abs=1e-12) and hi == pytest.approx(min(1.0, fhi), abs=1e-12)
        assert 0.0 <= lo <= k / n <= hi <= 1.0
    assert wilson(10, 10)[1] == 1.0 and wilson(10, 10)[0] < 1.0  # never empty at n/n
    assert all(math.isnan(v) for v in wilson(0, 0))


def test_newcombe_difference_published():
    # Newcombe (1998), "Interval estimation for the difference between independent proportions",
    # example (a): 56/70 - 48/80, method 10: [0.0524, 0.3339].
    lo, hi = difference(48 / 80, wilson(48, 80), 56 / 70, wilson(56, 70))
    assert (lo, hi) == pytest.approx((0.0524, 0.3339), abs=6e-5)
    lo2, hi2 = difference(56 / 70, wilson(56, 70), 48 / 80, wilson(48, 80))  # the other way round
    assert (lo2, hi2) == pytest.approx((-hi, -lo), abs=1e-12)
    assert all(math.isnan(v) for v in difference(0.5, (float("nan"), 0.6), 0.4, (0.3, 0.5)))


def test_clustered_wilson():
    rng = np.random.default_rng()
    n, k = int(rng.integers(20, 60)), int(rng.integers(2, 6))
    # One trial per cluster: the plain Wilson interval.
    y = (rng.random(n) < 0.4).astype(float)
    lo, hi, n_eff = clustered_wilson(y, np.ones(n))
    assert n_eff == pytest.approx(n) and (lo, hi) == pytest.approx(wilson(y.sum(), n))
    # Items that decide every draw (all k right or all k wrong): as many trials as items.
    item = (rng.random(n) < 0.5).astype(float)
    item[:2] = [0, 1]
    lo, hi, n_eff = clustered_wilson(item * k, np.full(n, k))
    assert design_effect(item * k, np.full(n, k)) == pytest.approx(k)
    assert n_eff == pytest.approx(n) and (lo, hi) == pytest.approx(wilson(item.sum(), n))
    # Independent draws: deff near 1 and the interval no narrower than Wilson on all n * k draws.
    draws = rng.random((n, k)) < 0.5
    lo, hi, n_eff = clustered_wilson(draws.sum(1), np.full(n, k))
    wl, wh = wilson(draws.sum(), n * k)
    assert n <= n_eff <= n * k and lo <= wl + 1e-12 and hi >= wh - 1e-12
    # A rate of 0 or 1: no variance to estimate deff from; as many trials as clusters.
    assert clustered_wilson(np.zeros(n), np.full(n, k))[:2] == pytest.approx(wilson(0, n))
    assert clustered_wilson(np.full(n, k), np.full(n, k))[2] == pytest.approx(n)
    assert clustered_wilson(np.ones(n), np.ones(n))[:2] == pytest.approx(wilson(n, n))
    # Clusters with no trials (trajectories without executions) are left out.
    assert clustered_wilson([1, 0, 0], [1, 0, 0])[:2] == pytest.approx(wilson(1, 1))


def test_rate_intervals_per_group():
    rng = np.random.default_rng()
    recs = []
    for i in range(12):
        diff = "easy" if i % 2 else "hard"
        for _ in range(3):
            status = [str(s) for s in rng.choice(["ok", "error", "no_code"], size=int(rng.integers(1, 4)))]
            recs.append({"prompt_id": f"q{i}", "correct": bool(rng.random() < 0.6), "turn_status": status,
                         "meta": {"difficulty": diff, "family": "count"}})
    out = rate_intervals(recs, keys=("difficulty",))
    hard = [r for r in recs if r["meta"]["difficulty"] == "hard"]
    assert out["difficulty=hard/n_items"] == 6 and out["n_items"] == 12
    per_item = {}
    for r in hard:
        a = per_item.setdefault(r["prompt_id"], [0, 0])
        a[0] += r["correct"]
        a[1] += 1
    y, m = np.array(list(per_item.values())).T
    assert out["difficulty=hard/accuracy_ci95"] == pytest.approx(list(clustered_wilson(y, m)[:2]))
    ok = [sum(s == "ok" for s in r["turn_status"]) for r in hard]
    ex = [sum(s in ("ok", "error") for s in r["turn_status"]) for r in hard]
    assert out["difficulty=hard/exec_success_ci95"] == pytest.approx(list(clustered_wilson(ok, ex)[:2]))
    for key in ("accuracy_ci95", "tool_rate_ci95", "exec_success_ci95", "difficulty=easy/tool_rate_ci95"):
        lo, hi = out[key]
        assert 0 <= lo <= hi <= 1
    assert "family=count,difficulty=easy/accuracy_ci95" not in out  # one key: no combinations
    two = rate_intervals(recs, keys=("family", "difficulty"))
    assert two["family=count,difficulty=easy/accuracy_ci95"] == out["difficulty=easy/accuracy_ci95"]


def _mcnemar_brute(b, c):
    """P(an outcome at least as far from (b + c) / 2 as b) over every equally likely assignment of
    the b + c discordant items to 'right after' or 'right before'."""
    m = b + c
    far = sum(abs(sum(seq) - m / 2) >= abs(b - m / 2) for seq in itertools.product((0, 1), repeat=m))
    return far / 2**m


def test_mcnemar_exact_brute_force_and_published():
    rng = np.random.default_rng()
    cases = [(0, 0), (0, 1), (1, 0), (5, 5), (0, 12), (2, 9)]
    cases += [tuple(int(v) for v in rng.integers(0, 8, 2)) for _ in range(8)]
    for b, c in cases:
        assert mcnemar_exact(b, c) == pytest.approx(_mcnemar_brute(b, c), abs=1e-15), (b, c)
        assert mcnemar_exact(b, c) == mcnemar_exact(c, b)
    # Fagerland, Lydersen & Laake (2017), Cavo et al. (2012): 6 and 16 discordant of 161 pairs, exact
    # conditional McNemar P = 0.052479 (the contingencytables R package's test suite).
    assert mcnemar_exact(6, 16) == pytest.approx(0.052479, abs=5e-7)
    with pytest.raises(ValueError, match="b=-1"):
        mcnemar_exact(-1, 3)


@pytest.mark.parametrize(("b", "c", "n", "lo", "hi"), [
    # Fagerland, Lydersen & Laake (2017), ch. 8, as the contingencytables R package checks them.
    (6, 16, 161, -0.1240, -0.0054), (3, 0, 3, -0.1230, 1.0), (0, 3, 3, -1.0, 0.1230),
])
def test_tango_interval_published(b, c, n, lo, hi):
    assert tango_interval(b, c, n) == pytest.approx((lo, hi), abs=6e-5)


def _tango_brute(b, c, n, d, iters=200):
    """Tango's statistic at each difference in `d`, from its definition: the restricted MLE of q21
    (the probability of a `c` item) under q12 = q21 + d, found by ternary search on the multinomial
    log-likelihood (concave in q21), then (b - c - n d) / sqrt(n ((q12 + q21) - d^2))."""
    d = np.asarray(d, np.float64)
    lo, hi = np.maximum(0.0, -d), (1.0 - d) / 2

    def loglik(q):
        terms = [(b, q + d), (c, q), (n - b - c, 1.0 - 2 * q - d)]
        return sum(np.where(k > 0, k * np.log(np.maximum(p, 1e-300)), 0.0) for k, p in terms)

    for _ in range(iters):
        m1, m2 = lo + (hi - lo) / 3, hi - (hi - lo) / 3
        left = loglik(m1) < loglik(m2)
        lo, hi = np.where(left, m1, lo), np.where(left, hi, m2)
    q21 = (lo + hi) / 2
    var = n * ((2 * q21 + d) - d * d)
    num = b - c - n * d
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(var > 0, num / np.sqrt(np.maximum(var, 0)), np.sign(num) * np.inf)


def test_tango_interval_is_its_definition():
    """The bounds are where the score statistic (restricted MLE solved numerically) crosses -+z, and
    the interval is the set of differences the score test does not reject (a 1e-3 grid)."""
    rng = np.random.default_rng()
    grid = np.linspace(-1, 1, 2001)
    cases = [(0, 0, 25), (7, 1, 120), (8, 2, 120)]
    for _ in range(3):
        n = int(rng.integers(10, 80))
        b = int(rng.integers(0, n // 2 + 1))
        cases.append((b, int(rng.integers(0, n - b + 1)), n))
    for b, c, n in cases:
        lo, hi = tango_interval(b, c, n)
        kept = grid[np.abs(_tango_brute(b, c, n, grid)) <= Z95]
        assert kept.min() == pytest.approx(lo, abs=1.01e-3) and kept.max() == pytest.approx(hi, abs=1.01e-3)
        for bound, sign in ((lo, 1), (hi, -1)):
            if abs(bound) < 1:
                assert _tango_brute(b, c, n, [bound])[0] == pytest.approx(sign * Z95, abs=1e-6), (b, c, n)
        assert lo <= (b - c) / n <= hi
        # At d = 0 it is McNemar's asymptotic test: the interval excludes 0 iff |b - c| / sqrt(b + c) > z.
        assert (lo > 0 or hi < 0) == (b + c > 0 and abs(b - c) / math.sqrt(b + c) > Z95)
    # What the module doc promises on 120 items: +5 points (6 items) when 8 change, not when 10 do.
    assert tango_interval(7, 1, 120)[0] > 0 and tango_interval(8, 2, 120)[0] < 0
    assert all(math.isnan(v) for v in tango_interval(0, 0, 0))


def test_bootstrap_difference_matches_a_plain_loop():
    rng = np.random.default_rng()
    n, k = int(rng.integers(15, 40)), 4
    before = rng.binomial(k, 0.5, n) / k
    after = np.clip(before + rng.choice([-0.25, 0, 0.25, 0.5], n), 0, 1)
    seed = int(rng.integers(0, 2**31))
    lo, hi = bootstrap_difference(before, after, n_boot=2000, seed=seed)

    r = np.random.default_rng(seed)
    stats = []
    for _ in range(2000):
        total = 0.0
        for _ in range(n):
            i = int(r.integers(0, n))  # one item drawn, its pair of outcomes kept together
            total += after[i] - before[i]
        stats.append(total / n)
    stats.sort()

    def percentile(q):  # linear interpolation between order statistics, as numpy's default
        pos = q * (len(stats) - 1)
        j = int(math.floor(pos))
        return stats[j] + (pos - j) * (stats[min(j + 1, len(stats) - 1)] - stats[j])

    assert lo == pytest.approx(percentile(0.025), abs=1e-12) and hi == pytest.approx(percentile(0.975), abs=1e-12)
    assert bootstrap_difference(before, after, seed=seed) == (lo, hi)  # reproducible, B = 2000 by default
    assert all(math.isnan(v) for v in bootstrap_difference([], []))


def _records(rng, ids, p, draws=1):
    return [{"prompt_id": i, "correct": bool(rng.random() < p), "turn_status": [],
             "meta": {"family": "count" if j % 2 else "bars", "difficulty": "easy" if j % 3 else "hard"}}
            for j, i in enumerate(ids) for _ in range(draws)]


def test_paired_accuracy_greedy_and_sampled():
    rng = np.random.default_rng()
    ids = [f"q{j}" for j in range(36)]
    before = _records(rng, ids, 0.5)
    after = _records(rng, ids, 0.7)[2:] + _records(rng, ["extra"], 0.5)  # q0, q1 missing; one new item
    out = paired_accuracy(before, after, ("family", "difficulty"), sampled=False)
    assert out["n_items"] == 34 and out["before_only"] == 2 and out["after_only"] == 1
    rb = {r["prompt_id"]: r for r in before}
    ra = {r["prompt_id"]: r for r in after}
    for g, want_ids in (("all", ids[2:]),
                        ("family=count,difficulty=hard", [i for j, i in enumerate(ids) if j >= 2 and j % 2
                                                          and not j % 3])):
        cell = out["groups"][g]
        b = sum(ra[i]["correct"] and not rb[i]["correct"] for i in want_ids)
        c = sum(rb[i]["correct"] and not ra[i]["correct"] for i in want_ids)
        n = len(want_ids)
        kb, ka = sum(rb[i]["correct"] for i in want_ids), sum(ra[i]["correct"] for i in want_ids)
        assert (cell["n_items"], cell["b"], cell["c"]) == (n, b, c)
        assert cell["diff"] == pytest.approx((ka - kb) / n) == pytest.approx((b - c) / n)
        assert cell["mcnemar_p"] == mcnemar_exact(b, c)
        assert cell["paired_ci95"] == pytest.approx(list(tango_interval(b, c, n)))
        assert cell["newcombe_ci95"] == pytest.approx(list(difference(kb / n, wilson(kb, n), ka / n, wilson(ka, n))))
    assert "difficulty=hard" in out["groups"] and "family=bars" in out["groups"]
    with pytest.raises(ValueError, match="one record per item"):
        paired_accuracy(_records(rng, ids, 0.5, draws=2), after, sampled=False)

    sb, sa = _records(rng, ids, 0.5, draws=4), _records(rng, ids, 0.6, draws=4)
    out = paired_accuracy(sb, sa, ("difficulty",), sampled=True, seed=3)
    acc_b = np.array([np.mean([r["correct"] for r in sb if r["prompt_id"] == i]) for i in ids])
    acc_a = np.array([np.mean([r["correct"] for r in sa if r["prompt_id"] == i]) for i in ids])
    cell = out["groups"]["all"]
    assert "mcnemar_p" not in cell and cell["diff"] == pytest.approx(float((acc_a - acc_b).mean()))
    assert cell["paired_ci95"] == pytest.approx(list(bootstrap_difference(acc_b, acc_a, 2000, 3)))
    hard = [j for j in range(36) if not j % 3]
    assert out["groups"]["difficulty=hard"]["paired_ci95"] == pytest.approx(
        list(bootstrap_difference(acc_b[hard], acc_a[hard], 2000, 3)))
    yb, ya = acc_b * 4, acc_a * 4
    m = np.full(36, 4.0)
    assert cell["newcombe_ci95"] == pytest.approx(list(difference(
        yb.sum() / 144, clustered_wilson(yb, m)[:2], ya.sum() / 144, clustered_wilson(ya, m)[:2])))
