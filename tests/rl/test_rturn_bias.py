"""The bias of R_turn's normalisation on a two-turn bandit whose true advantage is known exactly
(benchmarks/rturn_bias.py; the figures are in benchmarks/results/rturn_bias/README.md).

The policy answers at once (1 turn), or calls a tool that runs or fails (r^0 = −0.5) and then
answers (2 turns). The expected kernel gradient E[ĝ] = E[1/N Σ_i (e_{a_i} − π) Â^0_i] is enumerated
over every batch composition and compared with ∇_θ E[R^0] (softmax logits θ). The leave-one-out
baseline over all turns must be exactly parallel to it; today's tool-turn statistics are not: they
give the answer-at-once action no turn advantage although a tool call risks a failure.

With only two return levels, any estimator that treats equal-return actions alike is parallel to
∇J in the two-turn bandit, so a three-turn bandit (a second decision at turn 1, four return levels)
checks what it cannot: against E[Σ_m ∇log π_m(a_m) R^m] (no baseline), a scale that depends on the
trajectory itself or differs between turn indices tilts the gradient.
"""

import importlib.util
import math
import pathlib
import sys

import numpy as np
import pytest

from codedance_jax.rl import RBATConfig

_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "rturn_bias.py"
_spec = importlib.util.spec_from_file_location("rturn_bias", _PATH)
bandit = importlib.util.module_from_spec(_spec)
sys.modules["rturn_bias"] = bandit  # its dataclasses look their module up there
_spec.loader.exec_module(bandit)

N = 8


def _j(theta):
    """J(θ) = E[R^0] = Σ_a softmax(θ)_a R^0(a), written out."""
    z = [math.exp(t) for t in theta]
    return sum(zi / sum(z) * r for zi, r in zip(z, (0.0, 0.0, -0.5), strict=True))


@pytest.mark.parametrize("pi", bandit.SETTINGS)
def test_true_gradient_is_the_finite_difference_of_the_objective(pi):
    theta = np.log(pi)
    h = 1e-6
    fd = [(_j(theta + h * e) - _j(theta - h * e)) / (2 * h) for e in np.eye(3)]
    np.testing.assert_allclose(bandit.true_gradient(pi), fd, atol=1e-8)
    assert sum(bandit.multinomial(c, pi) for c in bandit.compositions(N)) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("pi", bandit.SETTINGS)
@pytest.mark.parametrize("preset", ["paper", "release"])
def test_leave_one_out_over_all_turns_is_unbiased(pi, preset):
    factory = RBATConfig.paper if preset == "paper" else RBATConfig.release
    e = bandit.expected(factory(turn_stats="all", turn_baseline="turn_loo"), pi, N)
    g = bandit.true_gradient(pi)
    scale = float(e["grad"] @ g / (g @ g))
    assert scale > 0
    np.testing.assert_allclose(e["grad"], scale * g, rtol=1e-5, atol=1e-9)  # parallel, component by component
    # Answering and a tool call that runs have the same true advantage: the estimator agrees.
    assert e["cond_adv"][0] == pytest.approx(e["cond_adv"][1], rel=1e-5)
    assert e["cond_adv"][2] < 0 < e["cond_adv"][0]


def test_tool_turn_statistics_are_biased():
    """SPEC's [decided] statistics (the default): the answer action gets Â = 0 while its true advantage
    is 0.5·π_fail > 0, and the expected gradient leaves the answer logit alone (38° off ∇J here)."""
    pi = (0.5, 0.3, 0.2)
    e = bandit.expected(RBATConfig.paper(), pi, N)
    g = bandit.true_gradient(pi)
    assert e["cond_adv"][0] == 0 and g[0] == pytest.approx(0.05)
    assert abs(e["grad"][0]) < 1e-6 * np.abs(e["grad"]).max()
    assert bandit.cosine(e["grad"], g) == pytest.approx(0.7857, abs=1e-3)
    # The release's statistics (its non-final steps) share the bias.
    assert bandit.cosine(bandit.expected(RBATConfig.release(), pi, N)["grad"], g) < 0.8


PIS3 = ((0.5, 0.3, 0.2), (0.3, 0.3, 0.4))


def test_three_turn_bandit_reference_is_the_baseline_free_gradient():
    """The reference E[Σ_m ∇log π_m R^m] equals the estimator with the baseline 0 and no scale, and
    the trajectory probabilities sum to 1."""
    assert sum(bandit.type_prob(bandit.THREE_TURN, t, PIS3) for t in bandit.THREE_TURN.types) == pytest.approx(1.0)
    ref = bandit.reference_gradient(bandit.THREE_TURN, PIS3)
    # Turn 1, written out: after a tool call, answering returns 0, a running call 0, a failing one −0.5.
    pi1, reach = np.array(PIS3[1]), PIS3[0][1] + PIS3[0][2]
    np.testing.assert_allclose(ref[1], reach * pi1 * (np.array([0, 0, -0.5]) - pi1 @ [0, 0, -0.5]), atol=1e-12)


def test_three_turn_leave_one_out_is_unbiased_over_both_turns():
    ref = bandit.reference_gradient(bandit.THREE_TURN, PIS3)
    for cfg in (RBATConfig.paper(turn_stats="all", turn_baseline="turn_loo"),
                RBATConfig.release(turn_stats="all", turn_baseline="turn_loo")):
        g = bandit.expected(cfg, PIS3, 6, bandit.THREE_TURN)["grad"]
        scale = float((g * ref).sum() / (ref * ref).sum())
        assert scale > 0
        np.testing.assert_allclose(g, scale * ref, rtol=1e-4, atol=1e-8)
    g = bandit.expected(RBATConfig.paper(), PIS3, 6, bandit.THREE_TURN)["grad"]
    assert bandit.cosine(g, ref) == pytest.approx(0.7401, abs=1e-3)  # the default: biased here too
