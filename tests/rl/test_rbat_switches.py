"""The R_BAT switches beyond the two presets, against plain loops written from their formulas:

- `seq_norm="none"` (Dr. GRPO, Liu et al. 2025): A_seq = r − mean_G, no division by std_G;
- `overlong_cache` (DAPO, Yu et al. 2025, eq. 13): R_length added to r(τ);
- `turn_stats="all"`: μ_batch, σ_batch of A_turn^m = (R^m − μ)/(σ + ε) over every turn taken
  (the answer turn's r^m = 0 included), each such turn getting its A_turn;
- `turn_baseline="turn_loo"`: μ per turn index m over the *other* trajectories' turns m, σ over all
  the other trajectories' turns.
Each reference loops over trajectories and turns in float64.
"""

import dataclasses
import math

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from codedance_jax.rl import RBATConfig, rbat_advantages, rbat_rewards
from codedance_jax.rl.rbat import overlong_penalty


def random_batch(rng, P, G, M):
    """Trajectories of 1..M turns: tool turns first, then an answer turn unless the budget ended
    them (all M turns tools); turn_valid marks the turns taken."""
    B = P * G
    acc = (rng.random(B) < rng.random()).astype(np.float32)
    fmt_ok = rng.random(B) < 0.85
    n_tools = rng.integers(0, M + 1, size=B)
    n_turns = np.minimum(n_tools + 1, M)
    is_tool = np.arange(M)[None, :] < n_tools[:, None]
    valid = np.arange(M)[None, :] < n_turns[:, None]
    failed = is_tool & (rng.random((B, M)) < rng.random())
    resp_len = rng.integers(1, 120, size=B).astype(np.float32)
    return acc, fmt_ok, is_tool, failed, valid, resp_len


def paper_reward(acc, fmt_ok, is_tool, failed, G, gamma=4.0, delta=0.2, mastered="group"):
    """r(τ) = R_acc + R_format + R_seq, paper eq. 1/5 (SPEC §4), one trajectory at a time.
    `mastered="direct"`: d(μ) keeps its sign only in a group whose no-tool trajectories exist and are
    all correct; elsewhere max(d, 0)."""
    B, M = is_tool.shape
    r = np.zeros(B)
    for b in range(B):
        r[b] = acc[b] + (0.5 if fmt_ok[b] else 0.0)
        tools = [m for m in range(M) if is_tool[b, m]]
        if tools:
            grp = range(b // G * G, b // G * G + G)
            mu_acc = sum(acc[j] > 0 for j in grp) / G
            d = 1 / (1 + math.exp(-gamma * (0.5 - mu_acc))) - delta
            direct = [j for j in grp if not is_tool[j].any()]
            if mastered == "direct" and not (direct and all(acc[j] > 0 for j in direct)):
                d = max(d, 0.0)
            r[b] += (0.5 + 0.5 * (acc[b] > 0)) * d * sum(not failed[b, m] for m in tools) / len(tools)
    return r


def turn_returns(is_tool, failed, valid, beta=0.2):
    """R^m = r^m + β R^{m+1} over the turns taken, r^m = −0.5 on a failed execution, else 0."""
    B, M = is_tool.shape
    R = np.zeros((B, M))
    for b in range(B):
        nxt = 0.0
        for m in reversed(range(M)):
            if not valid[b, m]:
                continue
            R[b, m] = (-0.5 if is_tool[b, m] and failed[b, m] else 0.0) + beta * nxt
            nxt = R[b, m]
    return R


def _run(cfg, acc, fmt_ok, is_tool, failed, G, **kw):
    a_seq, a_turn = rbat_advantages(acc, fmt_ok, is_tool, failed, group_size=G, cfg=cfg, **kw)
    return np.asarray(a_seq), np.asarray(a_turn)


def test_dr_grpo_no_std_in_the_sequence_advantage():
    rng = np.random.default_rng(0)
    for P, G, M in [(4, 8, 3), (3, 5, 2)]:
        acc, fmt_ok, is_tool, failed, _, _ = random_batch(rng, P, G, M)
        r = paper_reward(acc, fmt_ok, is_tool, failed, G)
        want = np.array([r[b] - sum(r[b // G * G : b // G * G + G]) / G for b in range(P * G)])
        a_seq, _ = _run(RBATConfig.paper(seq_norm="none"), acc, fmt_ok, is_tool, failed, G)
        np.testing.assert_allclose(a_seq, want, rtol=1e-5, atol=1e-6)
        assert np.abs(a_seq).max() > 0.1  # something to compare
    # A group of one: 0 (paper); the release's verl rule keeps r (mean 0) and, without the std, r itself.
    acc, fmt_ok, is_tool, failed, _, _ = random_batch(rng, 4, 1, 2)
    assert np.all(_run(RBATConfig.paper(seq_norm="none"), acc, fmt_ok, is_tool, failed, 1)[0] == 0)
    want = acc - 0.2 * (~fmt_ok)
    got = _run(RBATConfig.release(seq_norm="none", mode="outcome"), acc, fmt_ok, is_tool, failed, 1)[0]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def dapo_length_penalty(n, l_max, l_cache):
    """DAPO eq. 13, case by case."""
    if n <= l_max - l_cache:
        return 0.0
    if n <= l_max:
        return ((l_max - l_cache) - n) / l_cache
    return -1.0


def test_dapo_overlong_shaping_is_added_to_the_sequence_reward():
    l_max, l_cache = 100, 30
    lengths = np.arange(0, 130, dtype=np.float32)
    got = np.asarray(overlong_penalty(lengths, l_max, l_cache))
    np.testing.assert_allclose(got, [dapo_length_penalty(n, l_max, l_cache) for n in lengths], atol=1e-6)
    rng = np.random.default_rng(1)
    P, G, M = 4, 6, 3
    acc, fmt_ok, is_tool, failed, _, resp_len = random_batch(rng, P, G, M)
    cfg = RBATConfig.paper(overlong_cache=l_cache, overlong_max=l_max)
    r = paper_reward(acc, fmt_ok, is_tool, failed, G) + [dapo_length_penalty(n, l_max, l_cache) for n in resp_len]
    want = np.zeros(P * G)
    for p in range(P):
        grp = r[p * G : (p + 1) * G]
        want[p * G : (p + 1) * G] = (grp - grp.mean()) / (grp.std() + 1e-6)
    a_seq, _ = _run(cfg, acc, fmt_ok, is_tool, failed, G, resp_len=resp_len)
    np.testing.assert_allclose(a_seq, want, rtol=1e-4, atol=1e-5)
    parts = rbat_rewards(acc, fmt_ok, is_tool, failed, group_size=G, cfg=cfg, resp_len=resp_len)
    assert float(np.min(parts["r_length"])) < 0  # the batch reaches the cache zone
    with pytest.raises(ValueError, match="resp_len"):
        _run(cfg, acc, fmt_ok, is_tool, failed, G)
    with pytest.raises(ValueError, match="overlong"):
        RBATConfig.paper(overlong_cache=30)  # no L_max


def reference_turn_all(is_tool, failed, valid, w_turn=1.0, eps=1e-6):
    """μ_batch, σ_batch over every turn taken; A_turn on each of them."""
    R = turn_returns(is_tool, failed, valid)
    B, M = is_tool.shape
    vals = [R[b, m] for b in range(B) for m in range(M) if valid[b, m]]
    mu = sum(vals) / len(vals)
    sd = math.sqrt(sum((v - mu) ** 2 for v in vals) / len(vals))
    out = np.zeros((B, M))
    for b in range(B):
        for m in range(M):
            if valid[b, m]:
                out[b, m] = w_turn * (R[b, m] - mu) / (sd + eps)
    return out


def test_turn_statistics_over_all_turns():
    rng = np.random.default_rng(2)
    for P, G, M in [(4, 8, 3), (2, 5, 4)]:
        acc, fmt_ok, is_tool, failed, valid, _ = random_batch(rng, P, G, M)
        _, a_turn = _run(RBATConfig.paper(turn_stats="all"), acc, fmt_ok, is_tool, failed, G, turn_valid=valid)
        np.testing.assert_allclose(a_turn, reference_turn_all(is_tool, failed, valid), rtol=1e-5, atol=1e-5)
        answer_turns = valid & ~is_tool
        assert np.abs(a_turn[answer_turns]).max() > 0  # answer turns now carry a turn advantage
        # The default leaves them at 0 and differs wherever any trajectory answered.
        _, default = _run(RBATConfig.paper(), acc, fmt_ok, is_tool, failed, G)
        assert np.all(default[answer_turns] == 0)
    with pytest.raises(ValueError, match="turn_valid"):
        _run(RBATConfig.paper(turn_stats="all"), acc, fmt_ok, is_tool, failed, G)


def reference_turn_loo(is_tool, failed, valid, *, select_all, w_turn=1.0, eps=1e-6, norm="eps", tol=5e-4):
    """Baseline: the mean of the other trajectories' R^m at turn index m; scale: the population std
    of the other trajectories' selected returns at every turn index."""
    R = turn_returns(is_tool, failed, valid)
    sel = valid if select_all else is_tool
    B, M = is_tool.shape
    out = np.zeros((B, M))
    for b in range(B):
        pool = [R[j, k] for j in range(B) if j != b for k in range(M) if sel[j, k]]
        mu = sum(pool) / len(pool) if pool else 0.0
        sd = math.sqrt(sum((x - mu) ** 2 for x in pool) / len(pool)) if pool else 0.0
        for m in range(M):
            if not sel[b, m]:
                continue
            others = [R[j, m] for j in range(B) if j != b and sel[j, m]]
            mean = sum(others) / len(others) if others else 0.0
            a = R[b, m] - mean
            if len(pool) >= 2 and sd > tol:
                a /= sd + (eps if norm == "eps" else 0.0)
            out[b, m] = w_turn * a
    return out


@pytest.mark.parametrize("preset", ["paper", "release"])
@pytest.mark.parametrize("stats", ["tool", "all"])
def test_leave_one_out_turn_baseline(preset, stats):
    rng = np.random.default_rng(3)
    factory = RBATConfig.paper if preset == "paper" else RBATConfig.release
    cfg = factory(turn_stats=stats, turn_baseline="turn_loo")
    w_turn, norm = (1.0, "eps") if preset == "paper" else (0.2, "raw")
    for trial in range(6):
        P, G, M = [(4, 8, 3), (3, 3, 2), (1, 3, 3)][trial % 3]  # (1, 3, 3): turn indices with < 3 trajectories
        acc, fmt_ok, is_tool, failed, valid, _ = random_batch(rng, P, G, M)
        _, a_turn = _run(cfg, acc, fmt_ok, is_tool, failed, G, turn_valid=valid)
        want = reference_turn_loo(is_tool, failed, valid, select_all=stats == "all", w_turn=w_turn, norm=norm)
        np.testing.assert_allclose(a_turn, want, rtol=1e-4, atol=1e-5, err_msg=f"trial {trial}")


def test_leave_one_out_of_identical_returns_is_exactly_zero():
    """Discounted returns (−0.1 = β·−0.5) that all agree give exact zeros, not float noise / tol."""
    is_tool = np.array([[1, 1, 0]] * 6, bool)
    failed = np.array([[0, 1, 0]] * 6, bool)
    valid = np.array([[1, 1, 1]] * 6, bool)
    acc, fmt_ok = np.ones(6, np.float32), np.ones(6, bool)
    _, a_turn = _run(RBATConfig.paper(turn_stats="all", turn_baseline="turn_loo"), acc, fmt_ok, is_tool, failed, 3,
                     turn_valid=valid)
    assert np.all(a_turn == 0)


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_switches_sharded_match_single_device(axis_type):
    devices = jax.devices()
    if len(devices) < 8:
        pytest.skip("needs 8 devices (tests/conftest.py sets an 8-device CPU platform)")
    kind = AxisType.Explicit if axis_type == "explicit" else AxisType.Auto
    mesh = Mesh(np.array(devices[:8]), ("data",), axis_types=(kind,))
    rng = np.random.default_rng(4)
    P, G, M = 4, 8, 4
    acc, fmt_ok, is_tool, failed, valid, resp_len = random_batch(rng, P, G, M)
    cfg = RBATConfig.paper(turn_stats="all", turn_baseline="turn_loo", seq_norm="none", overlong_cache=40,
                           overlong_max=100)
    single = _run(cfg, acc, fmt_ok, is_tool, failed, G, turn_valid=valid, resp_len=resp_len)
    put = lambda x: jax.device_put(x, NamedSharding(mesh, PartitionSpec("data", *([None] * (x.ndim - 1)))))  # noqa: E731
    with jax.sharding.set_mesh(mesh):
        args = [put(x) for x in (acc, fmt_ok, is_tool, failed, valid, resp_len)]
        a_seq, a_turn = rbat_advantages(*args[:4], group_size=G, cfg=cfg, turn_valid=args[4], resp_len=args[5])
    np.testing.assert_allclose(np.asarray(a_seq), single[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(a_turn), single[1], rtol=1e-5, atol=1e-6)


def test_defaults_are_the_paper_and_validation_names_the_field():
    assert RBATConfig.paper() == dataclasses.replace(RBATConfig(), seq_norm="std", turn_stats="tool",
                                                     turn_baseline="batch", overlong_cache=0)
    for field, bad in (("seq_norm", "mad"), ("turn_stats", "some"), ("turn_baseline", "critic")):
        with pytest.raises(ValueError, match=field):
            RBATConfig.paper(**{field: bad})


@pytest.mark.parametrize("seed", range(6))
def test_mastered_direct_matches_reference(seed):
    rng = np.random.default_rng(seed)
    P, G, M = 5, 4, 3
    acc, fmt_ok, is_tool, failed, _, _ = random_batch(rng, P, G, M)
    acc[:G] = 1.0  # a mastered group, whatever its tool use
    cfg = RBATConfig.paper(mastered="direct")
    parts = rbat_rewards(acc, fmt_ok, is_tool, failed, group_size=G, cfg=cfg)
    np.testing.assert_allclose(np.asarray(parts["total"]), paper_reward(acc, fmt_ok, is_tool, failed, G, mastered="direct"),
                               atol=1e-5)


def test_mastered_direct_spares_a_hard_group_solved_by_tools():
    """A group all right, every member with one successful tool call: the paper's d(1) < 0 penalises
    each call; "direct" has no direct answer to call the tools redundant, so R_seq = 0. A group where a
    direct answer is right and a tool call is right too: both penalise the call."""
    G = 4
    acc = np.ones(2 * G, np.float32)
    fmt_ok = np.ones(2 * G, bool)
    is_tool = np.zeros((2 * G, 2), bool)
    is_tool[:G, 0] = True  # group 0: all tools
    is_tool[G, 0] = True  # group 1: one tool, three direct answers
    failed = np.zeros_like(is_tool)
    paper = np.asarray(rbat_rewards(acc, fmt_ok, is_tool, failed, group_size=G, cfg=RBATConfig.paper())["r_seq"])
    direct = np.asarray(rbat_rewards(acc, fmt_ok, is_tool, failed, group_size=G,
                                     cfg=RBATConfig.paper(mastered="direct"))["r_seq"])
    assert (paper[:G] < 0).all() and (direct[:G] == 0).all()
    assert paper[G] < 0 and direct[G] == pytest.approx(paper[G])
    with pytest.raises(Exception, match="mastered"):
        RBATConfig.paper(mastered="never")
