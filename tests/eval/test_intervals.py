"""Wilson intervals (against published values and the formula), the clustered version, Newcombe's
difference, and the per-group intervals of evaluation records."""

import math

import numpy as np
import pytest

from eval.intervals import Z95, clustered_wilson, design_effect, difference, rate_intervals, wilson


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
