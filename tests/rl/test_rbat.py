"""The R_BAT kernel against plain NumPy loops written from the SPEC's table and the release code.

The references loop over trajectories and turns one by one, the way the paper writes the equations
and the way the release's verl code computes them (per-trajectory lists, then batch statistics), so
a vectorization or sharding mistake in the kernel cannot be mirrored here.
"""

import dataclasses
import math

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from codedance_jax.rl import RBATConfig, rbat_advantages
from codedance_jax.rl.rbat import MODES, turn_arrays, turn_failed_from_execution
from codedance_jax.rl.registry import get_advantage


def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def reference_paper(acc, fmt_ok, is_tool, failed, G, mode="full", gamma=4.0, delta=0.2, beta=0.2, seq_eps=1e-6,
                    w_turn=1.0):
    """SPEC §4, `paper` column, one trajectory at a time."""
    B, M = is_tool.shape
    r = np.zeros(B)
    for b in range(B):
        r[b] = acc[b] + (0.5 if fmt_ok[b] else 0.0)
        tools = [m for m in range(M) if is_tool[b, m]]
        n_total = len(tools)
        n_succ = sum(1 for m in tools if not failed[b, m])
        if mode == "tool_bonus" and acc[b] > 0 and n_succ > 0:
            r[b] += 1.0
        if mode in ("no_turn", "full") and n_total > 0:
            group = range(b // G * G, b // G * G + G)
            mu_acc = sum(1.0 for j in group if acc[j] > 0) / G
            d = _sigmoid(gamma * (0.5 - mu_acc)) - delta
            r[b] += (0.5 + 0.5 * (acc[b] > 0)) * d * n_succ / n_total
    a_seq = np.zeros(B)
    for p in range(B // G):
        grp = r[p * G : (p + 1) * G]
        mean = sum(grp) / G
        std = math.sqrt(sum((x - mean) ** 2 for x in grp) / G)
        for i in range(G):
            a_seq[p * G + i] = (grp[i] - mean) / (std + seq_eps)
    a_turn = np.zeros((B, M))
    if mode != "full":
        return a_seq, a_turn
    returns = np.zeros((B, M))
    for b in range(B):
        nxt = 0.0
        for m in reversed(range(M)):
            rm = -0.5 if (is_tool[b, m] and failed[b, m]) else 0.0
            returns[b, m] = rm + beta * nxt
            nxt = returns[b, m]
    vals = [returns[b, m] for b in range(B) for m in range(M) if is_tool[b, m]]
    if vals:
        mu = sum(vals) / len(vals)
        sd = math.sqrt(sum((v - mu) ** 2 for v in vals) / len(vals))
        for b in range(B):
            for m in range(M):
                if is_tool[b, m]:
                    a_turn[b, m] = w_turn * (returns[b, m] - mu) / (sd + 1e-6)
    return a_seq, a_turn


def reference_release(acc, fmt_ok, is_tool, failed, G, mode="full", gamma=4.0):
    """The release's code path: `compute_score_default`, `tool_reward_step`, `compute_tool_decay`,
    verl's `compute_grpo_outcome_advantage`, `BatchRewardManager` and `compute_advantage`."""
    B, M = is_tool.shape
    score = np.zeros(B)
    tool_component = np.zeros(B)
    tool_steps = []
    for b in range(B):
        score[b] = acc[b] * 1.0 + 0.2 * (-1.0 if not fmt_ok[b] else 0.0)
        steps = [-0.5 if failed[b, m] else 0.0 for m in range(M) if is_tool[b, m]] + [0]
        cum = [0.0] * len(steps)
        cum[-1] = steps[-1]
        for i in range(len(steps) - 2, -1, -1):
            cum[i] = steps[i] + 0.2 * cum[i + 1]
        tool_steps.append(cum)
        n = len(steps) - 1
        if n > 0:
            rate = sum(1 for s in steps[:-1] if s == 0.0) / n
            tool_component[b] = (1.5 if acc[b] > 0.5 else 0.5) * rate
    r = score.copy()
    if mode == "tool_bonus":
        r += np.array(
            [
                1.0 if acc[b] > 0 and sum(1 for m in range(M) if is_tool[b, m] and not failed[b, m]) else 0.0
                for b in range(B)
            ]
        )
    if mode in ("no_turn", "full"):
        for b in range(B):
            mean_acc = np.mean(score[b // G * G : b // G * G + G])
            decay = (1 + np.tanh(gamma * (0.5 - mean_acc))) / 2 - 0.2
            r[b] += tool_component[b] * decay
    a_seq = np.zeros(B)
    for p in range(B // G):
        grp = r[p * G : (p + 1) * G]
        if G == 1:
            mean, std = 0.0, 1.0
        else:
            mean, std = float(np.mean(grp)), float(np.std(grp, ddof=1))
        a_seq[p * G : (p + 1) * G] = (grp - mean) / (std + 1e-6)
    a_turn = np.zeros((B, M))
    if mode != "full":
        return a_seq, a_turn
    multi = [x for ts in tool_steps if len(ts) > 1 for x in ts[:-1]]
    mean_val = std_val = 0.0
    if multi:
        mean_val = sum(multi) / len(multi)
        std_val = (sum((x - mean_val) ** 2 for x in multi) / len(multi)) ** 0.5
    for b, ts in enumerate(tool_steps):
        if len(ts) > 1 and std_val > 1e-8:
            norm = [(x - mean_val) / std_val for x in ts[:-1]] + [0.0]
        else:
            norm = [*ts[:-1], 0.0]
        # segment k of the response carries step k: the tool turns come first, in order
        for k, m in enumerate(m for m in range(M) if is_tool[b, m]):
            a_turn[b, m] = 0.2 * norm[k]
    return a_seq, a_turn


def random_batch(rng, P, G, M):
    B = P * G
    acc = (rng.random(B) < rng.random()).astype(np.float32)
    fmt_ok = rng.random(B) < 0.85
    n_tools = rng.integers(0, M + 1, size=B)  # 0..M tool turns, then maybe an answer turn
    is_tool = np.arange(M)[None, :] < n_tools[:, None]
    failed = is_tool & (rng.random((B, M)) < rng.random())
    # Junk on non-tool turns must be ignored by the kernel.
    failed |= (~is_tool) & (rng.random((B, M)) < 0.1)
    return acc, fmt_ok, is_tool, failed


# (prompts P, group size G, turns M), including one-trajectory groups and a single turn.
SHAPES = [(4, 8, 6), (3, 5, 3), (5, 1, 2), (2, 3, 1)]


def _run(cfg, acc, fmt_ok, is_tool, failed, G):
    a_seq, a_turn = rbat_advantages(acc, fmt_ok, is_tool, failed, group_size=G, cfg=cfg)
    assert a_seq.dtype == np.float32 and a_turn.dtype == np.float32
    return np.asarray(a_seq), np.asarray(a_turn)


def _clean(failed, is_tool):
    return failed & is_tool  # what the references see: failures exist only on executed turns


@pytest.mark.parametrize("mode", MODES)
def test_paper_preset_matches_reference(mode):
    cfg = RBATConfig.paper(mode=mode)
    rng = np.random.default_rng(0)
    for trial in range(32):
        # A few shapes (one compile each), many random batches per shape.
        P, G, M = SHAPES[trial % len(SHAPES)]
        acc, fmt_ok, is_tool, failed = random_batch(rng, P, G, M)
        got = _run(cfg, acc, fmt_ok, is_tool, failed, G)
        want = reference_paper(acc, fmt_ok, is_tool, _clean(failed, is_tool), G, mode=mode)
        np.testing.assert_allclose(got[0], want[0], rtol=2e-5, atol=2e-5, err_msg=f"a_seq trial {trial}")
        np.testing.assert_allclose(got[1], want[1], rtol=2e-5, atol=2e-5, err_msg=f"a_turn trial {trial}")


@pytest.mark.parametrize("mode", MODES)
def test_release_preset_matches_reference(mode):
    cfg = RBATConfig.release(mode=mode)
    rng = np.random.default_rng(1)
    for trial in range(32):
        # A few shapes (one compile each), many random batches per shape.
        P, G, M = SHAPES[trial % len(SHAPES)]
        acc, fmt_ok, is_tool, failed = random_batch(rng, P, G, M)
        got = _run(cfg, acc, fmt_ok, is_tool, failed, G)
        want = reference_release(acc, fmt_ok, is_tool, _clean(failed, is_tool), G, mode=mode)
        np.testing.assert_allclose(got[0], want[0], rtol=2e-5, atol=2e-5, err_msg=f"a_seq trial {trial}")
        np.testing.assert_allclose(got[1], want[1], rtol=2e-5, atol=2e-5, err_msg=f"a_turn trial {trial}")


def test_paper_hand_computed_group():
    # One group of 4, M = 3. Trajectory 0: correct, 2 tools (1 failed) + answer; 1: correct, no
    # tools; 2: wrong, 1 ok tool; 3: wrong, malformed, 1 failed tool.
    acc = np.array([1, 1, 0, 0], np.float32)
    fmt_ok = np.array([True, True, True, False])
    is_tool = np.array([[1, 1, 0], [0, 0, 0], [1, 0, 0], [1, 0, 0]], bool)
    failed = np.array([[1, 0, 0], [0, 0, 0], [0, 0, 0], [1, 0, 0]], bool)
    a_seq, a_turn = _run(RBATConfig.paper(), acc, fmt_ok, is_tool, failed, 4)
    d = 1 / (1 + math.exp(-4 * (0.5 - 0.5))) - 0.2  # μ_acc = 0.5 → d = 0.3
    r = np.array([1.5 + 1.0 * d * 0.5, 1.5, 0.5 + 0.5 * d * 1.0, 0.0 + 0.5 * d * 0.0])
    np.testing.assert_allclose(a_seq, (r - r.mean()) / (r.std() + 1e-6), rtol=1e-5)
    # Returns on tool turns: traj0 [-0.5, 0], traj2 [0], traj3 [-0.5] → μ = -0.25, σ = 0.25.
    want = np.zeros((4, 3))
    want[0, 0], want[0, 1], want[2, 0], want[3, 0] = -1, 1, 1, -1
    np.testing.assert_allclose(a_turn, want * 0.25 / (0.25 + 1e-6), rtol=1e-5)


def test_discounted_returns_propagate_backwards():
    # A later failure discounts into earlier turns: returns [-0.5·β², -0.5·β, -0.5] + one success.
    acc = np.array([1, 0], np.float32)
    fmt_ok = np.array([True, True])
    is_tool = np.array([[1, 1, 1, 0], [1, 0, 0, 0]], bool)
    failed = np.array([[0, 0, 1, 0], [0, 0, 0, 0]], bool)
    _, a_turn = _run(RBATConfig.paper(), acc, fmt_ok, is_tool, failed, 2)
    R = np.array([-0.02, -0.1, -0.5, 0.0])
    mu, sd = R.mean(), R.std()
    np.testing.assert_allclose(a_turn[0, :3], (R[:3] - mu) / (sd + 1e-6), rtol=1e-5)
    np.testing.assert_allclose(a_turn[1, 0], (0 - mu) / (sd + 1e-6), rtol=1e-5)
    assert a_turn[0, 3] == 0 and np.all(a_turn[1, 1:] == 0)


def test_edge_no_tool_calls_anywhere():
    acc = np.array([1, 0, 1, 1], np.float32)
    fmt_ok = np.ones(4, bool)
    none = np.zeros((4, 6), bool)
    for cfg in (RBATConfig.paper(), RBATConfig.release()):
        a_seq, a_turn = _run(cfg, acc, fmt_ok, none, none, 4)
        assert np.all(a_turn == 0) and np.all(np.isfinite(a_seq))
        # R_seq = 0 without tool calls: A_seq is plain outcome GRPO.
        out = _run(dataclasses.replace(cfg, mode="outcome"), acc, fmt_ok, none, none, 4)[0]
        np.testing.assert_allclose(a_seq, out, rtol=1e-6)


def test_edge_all_tools_failed():
    # Every tool turn fails with the same return pattern → σ_batch = 0: no turn signal (paper), raw
    # returns (release); R_seq = 0 for all since N_succ = 0.
    acc = np.array([1, 0, 0, 1], np.float32)
    fmt_ok = np.ones(4, bool)
    is_tool = np.array([[1, 0], [1, 0], [1, 0], [1, 0]], bool)
    failed = is_tool.copy()
    a_seq, a_turn = _run(RBATConfig.paper(), acc, fmt_ok, is_tool, failed, 4)
    assert np.all(a_turn == 0)
    np.testing.assert_allclose(a_seq, [1, -1, -1, 1], rtol=1e-5)
    _, a_turn = _run(RBATConfig.release(), acc, fmt_ok, is_tool, failed, 4)
    np.testing.assert_allclose(a_turn[:, 0], 0.2 * -0.5)
    assert np.all(a_turn[:, 1] == 0)


def test_edge_identical_rewards_give_zero_seq_advantage():
    acc = np.ones(8, np.float32)
    fmt_ok = np.ones(8, bool)
    is_tool = np.zeros((8, 3), bool)
    for cfg in (RBATConfig.paper(), RBATConfig.release()):
        a_seq, _ = _run(cfg, acc, fmt_ok, is_tool, is_tool, 8)
        assert np.all(a_seq == 0)


def test_edge_one_trajectory_groups():
    acc = np.array([1, 0, 1], np.float32)
    fmt_ok = np.array([True, True, False])
    is_tool = np.array([[1, 0], [0, 0], [1, 1]], bool)
    failed = np.array([[0, 0], [0, 0], [1, 0]], bool)
    a_seq, _ = _run(RBATConfig.paper(), acc, fmt_ok, is_tool, failed, 1)
    assert np.all(a_seq == 0)  # no contrast within a group of one
    a_seq, _ = _run(RBATConfig.release(), acc, fmt_ok, is_tool, failed, 1)
    # verl: mean 0, std 1, so the raw reward passes through.
    want, _ = reference_release(acc, fmt_ok, is_tool, failed, 1)
    np.testing.assert_allclose(a_seq, want, rtol=1e-5)
    d = (1 + math.tanh(4 * (0.5 - 1.0))) / 2 - 0.2  # μ_acc = 1 for a lone correct trajectory: d < 0
    assert a_seq[1] == 0 and a_seq[0] == pytest.approx((1 + 1.5 * d) / (1 + 1e-6), rel=1e-5)


def test_difficulty_sign_flips_above_mu_star():
    # d < 0 only above μ* ≈ 0.847: with 7/8 correct, a successful tool call lowers the reward.
    acc = np.array([1] * 7 + [0], np.float32)
    fmt_ok = np.ones(8, bool)
    is_tool = np.zeros((8, 2), bool)
    is_tool[0, 0] = True
    a_seq, _ = _run(RBATConfig.paper(mode="no_turn"), acc, fmt_ok, is_tool, np.zeros_like(is_tool), 8)
    assert a_seq[0] < a_seq[1]
    acc[5] = 0  # 6/8 = 0.75 < μ*: the tool call now helps
    a_seq, _ = _run(RBATConfig.paper(mode="no_turn"), acc, fmt_ok, is_tool, np.zeros_like(is_tool), 8)
    assert a_seq[0] > a_seq[1]


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
@pytest.mark.parametrize("P,G", [(16, 8), (2, 8)])  # 2 groups over 8 devices: groups span devices
def test_sharded_matches_single_device(axis_type, P, G):
    devices = jax.devices()
    if len(devices) < 8:
        pytest.skip("needs 8 devices (tests/conftest.py sets an 8-device CPU platform)")
    kind = AxisType.Explicit if axis_type == "explicit" else AxisType.Auto
    mesh = Mesh(np.array(devices[:8]), ("data",), axis_types=(kind,))
    rng = np.random.default_rng(7)
    M = 6
    acc, fmt_ok, is_tool, failed = random_batch(rng, P, G, M)
    for cfg in (RBATConfig.paper(), RBATConfig.release(), RBATConfig.paper(mode="tool_bonus")):
        single = _run(cfg, acc, fmt_ok, is_tool, failed, G)
        put = lambda x: jax.device_put(x, NamedSharding(mesh, PartitionSpec("data", *([None] * (x.ndim - 1)))))
        with jax.sharding.set_mesh(mesh):
            args = [put(x) for x in (acc, fmt_ok, is_tool, failed)]
            assert len(args[2].sharding.device_set) == 8
            a_seq, a_turn = rbat_advantages(*args, group_size=G, cfg=cfg)
        assert a_seq.sharding.is_equivalent_to(args[0].sharding, 1)
        assert a_turn.sharding.is_equivalent_to(args[2].sharding, 2)
        np.testing.assert_allclose(np.asarray(a_seq), single[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(a_turn), single[1], rtol=1e-5, atol=1e-6)
        # The turn statistics are global: statistics of one shard alone would differ.
        if cfg.mode == "full" and P * G // 8 >= G:
            shard = slice(0, P * G // 8)
            local = _run(cfg, acc[shard], fmt_ok[shard], is_tool[shard], failed[shard], G)[1]
            assert not np.allclose(local, single[1][shard])


def test_failure_rules_per_preset():
    paper, release = RBATConfig.paper(), RBATConfig.release()
    for status in ("error", "timeout", "crashed"):
        assert turn_failed_from_execution(status, cfg=paper) and turn_failed_from_execution(status, cfg=release)
    assert not turn_failed_from_execution("ok", "42\n", cfg=paper)
    assert not turn_failed_from_execution("ok", "42\n", cfg=release)
    # No output at all: fine in the paper, failed in the release.
    assert not turn_failed_from_execution("ok", "", 0, cfg=paper)
    assert turn_failed_from_execution("ok", "  \n", 0, cfg=release)
    assert not turn_failed_from_execution("ok", "", 1, cfg=release)  # a figure is output
    # The release greps the observation text, case-sensitively.
    assert turn_failed_from_execution("ok", "ValueError caught, printing fallback", cfg=release)
    assert not turn_failed_from_execution("ok", "no error here", cfg=release)
    with pytest.raises(ValueError, match="no_code"):
        turn_failed_from_execution("no_code", cfg=paper)


def test_turn_arrays_packs_records():
    turns = [
        [{"status": "ok", "observation": "1"}, {"status": "error"}, {"status": "no_code"}],
        [{"status": "no_code"}],
        [{"status": "ok", "observation": ""}],
    ]
    is_tool, failed = turn_arrays(turns, max_turns=4, cfg=RBATConfig.release())
    np.testing.assert_array_equal(is_tool, [[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]])
    np.testing.assert_array_equal(failed, [[0, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]])
    with pytest.raises(ValueError, match="max_turns"):
        turn_arrays(turns, max_turns=2, cfg=RBATConfig.paper())
    with pytest.raises(ValueError, match="not the last turn"):
        turn_arrays([[{"status": "no_code"}, {"status": "ok"}]], max_turns=2, cfg=RBATConfig.paper())


def test_config_validation_and_registry():
    with pytest.raises(ValueError, match="mode"):
        RBATConfig(mode="deepeyes")
    assert RBATConfig.release(gamma=5.0).gamma == 5.0 and RBATConfig.release().w_turn == 0.2
    assert hash(RBATConfig.paper()) == hash(RBATConfig())
    assert get_advantage("rbat") is rbat_advantages
    with pytest.raises(ValueError, match="whole number of groups"):
        rbat_advantages(
            np.zeros(6, np.float32),
            np.ones(6, bool),
            np.zeros((6, 2), bool),
            np.zeros((6, 2), bool),
            group_size=4,
            cfg=RBATConfig(),
        )


def test_run_config_overrides_seq_eps_and_w_turn_else_keeps_the_preset():
    """configs/grpo.py's rbat block: seq_eps / w_turn None keep each preset's value; set, they reach
    the kernel, which then matches the paper reference with the same epsilon and weight."""
    from configs import grpo as grpo_configs
    from runs.grpo import rbat_config

    c = grpo_configs.get_config("tiny").rbat
    for preset, factory in (("paper", RBATConfig.paper), ("release", RBATConfig.release)):
        c.preset = preset
        assert rbat_config(c) == factory(mode=c.mode, gamma=c.gamma, delta=c.delta, beta=c.beta)
    c.preset, c.seq_eps, c.w_turn = "paper", 0.5, 0.3
    cfg = rbat_config(c)
    assert (cfg.seq_eps, cfg.w_turn) == (0.5, 0.3)
    rng = np.random.default_rng(7)
    acc = rng.integers(0, 2, 16).astype(np.float32)
    fmt_ok, is_tool = rng.random(16) < 0.8, rng.random((16, 3)) < 0.6
    failed = rng.random((16, 3)) < 0.3
    a_seq, a_turn = _run(cfg, acc, fmt_ok, is_tool, failed, 4)
    ref_seq, ref_turn = reference_paper(acc, fmt_ok, is_tool, _clean(failed, is_tool), 4, seq_eps=0.5, w_turn=0.3)
    np.testing.assert_allclose(a_seq, ref_seq, atol=1e-5)
    np.testing.assert_allclose(a_turn, ref_turn, atol=1e-5)
    base_seq, _ = _run(RBATConfig.paper(), acc, fmt_ok, is_tool, failed, 4)
    assert np.abs(a_seq).sum() < np.abs(base_seq).sum()  # the larger epsilon damps every group
