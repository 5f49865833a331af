"""The policy-gradient variants of the GRPO loss against plain loops written from each paper's formula.

The reference walks sequences and tokens one by one, as the papers write the objectives:

- GRPO / CodeDance eq. 3:  J = 1/G Σ_i 1/|o_i| Σ_t min(r_it A_it, clip(r_it, 1 − ε, 1 + ε) A_it);
- DAPO (Yu et al. 2025, eq. 8): J = 1/Σ_i|o_i| Σ_i Σ_t min(r_it A_it, clip(r_it, 1 − ε_low, 1 + ε_high) A_it);
- Dr. GRPO (Liu et al. 2025, eq. 3 without 1/|o_i|): J = 1/G Σ_i 1/L Σ_t min(...), L a constant;
- GSPO-token (Zheng et al. 2025, eq. 13): s_it = sg[s_i]·π(y_it)/sg[π(y_it)],
  s_i = exp(1/|y_i| Σ_t log π(y_it)/π_old(y_it)), J = 1/G Σ_i 1/|y_i| Σ_t min(s_it A_it, clip(s_it) A_it);

and the gradient d(−J)/d log π(y_it) from the same formulas: the unclipped branch gives r·A (GRPO,
DAPO, Dr. GRPO) or s_i·A_it (GSPO-token) times the aggregation weight, the clipped branch 0.
"""

import math

import jax
import numpy as np
import pytest

from codedance_jax.rl.grpo_loss import GRPOLossConfig, grpo_loss

B, T, M = 6, 12, 3


def random_batch(seed):
    """Fresh random log-probs, masks (prompt, observation and padding positions untrained, one row
    with no trained token at all) and advantages."""
    rng = np.random.default_rng(seed)
    old = np.log(rng.uniform(0.05, 0.95, (B, T))).astype(np.float32)
    new = (old + rng.normal(0, 0.25, (B, T))).astype(np.float32)
    mask = (rng.random((B, T)) < 0.75).astype(np.float32)
    mask[:, :2] = 0  # prompt
    turn = np.where(mask > 0, rng.integers(0, M, (B, T)), -1).astype(np.int32)
    turn[1, 5:8] = -1  # observation tokens inside a trajectory: sampled mask may say 1, turn id says no
    mask[4] = 0  # a padding row
    turn[4] = -1
    a_seq = rng.normal(0, 1, B).astype(np.float32)
    a_turn = rng.normal(0, 0.5, (B, M)).astype(np.float32)
    new[4] = 300.0  # garbage on a row that trains nothing
    return new, old, mask, turn, a_seq, a_turn


def reference(new, old, mask, turn, a_seq, a_turn, *, eps_low=0.2, eps_high=0.2, aggregation="seq_mean",
              length=None, ratio="token"):
    """−J and d(−J)/d new, loops over sequences and tokens (float64)."""
    new, old = np.asarray(new, np.float64), np.asarray(old, np.float64)
    grad = np.zeros_like(new)
    seq_terms = []  # per sequence: list of (t, term, d term / d new[b, t])
    for b in range(B):
        toks = [t for t in range(T) if mask[b, t] > 0 and turn[b, t] >= 0]
        if not toks:
            continue
        s = math.exp(sum(new[b, t] - old[b, t] for t in toks) / len(toks))
        terms = []
        for t in toks:
            adv = float(a_seq[b]) + float(a_turn[b, turn[b, t]])
            r = s if ratio == "sequence" else math.exp(new[b, t] - old[b, t])
            dr = s if ratio == "sequence" else r  # d r / d new[b, t] (GSPO-token: through π(y_t) only)
            clipped = min(max(r, 1 - eps_low), 1 + eps_high)
            if r * adv <= clipped * adv:
                terms.append((t, r * adv, dr * adv))
            else:
                terms.append((t, clipped * adv, 0.0))
        seq_terms.append((b, terms))
    n_seq = len(seq_terms)
    n_tok = sum(len(terms) for _, terms in seq_terms)
    j = 0.0
    for b, terms in seq_terms:
        if aggregation == "seq_mean":
            w = 1.0 / (len(terms) * n_seq)
        elif aggregation == "token_mean":
            w = 1.0 / n_tok
        else:  # seq_sum_norm
            w = 1.0 / (length * n_seq)
        for t, term, dterm in terms:
            j += w * term
            grad[b, t] = -w * dterm
    return -j, grad


def loss_and_grad(cfg, new, old, mask, turn, a_seq, a_turn):
    f = lambda lp: grpo_loss(lp, old, None, mask, turn, a_seq, a_turn, cfg)[0]  # noqa: E731
    loss, grad = jax.value_and_grad(f)(new)
    return float(loss), np.asarray(grad)


def check(cfg, seed, **ref_kw):
    batch = random_batch(seed)
    loss, grad = loss_and_grad(cfg, *batch)
    want_loss, want_grad = reference(*batch, **ref_kw)
    assert loss == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-7)
    assert np.all(grad[4] == 0) and np.all(np.isfinite(grad))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_default_is_todays_loss_and_gradient(seed):
    """The paper's eq. 3 with ε = 0.2, per-sequence means, token ratios: what the loss computed before
    the variants were added (the default config of configs/grpo.py builds exactly this)."""
    from configs import grpo as grpo_configs
    from runs.grpo import loss_config

    cfg = loss_config(grpo_configs.get_config("qwen25vl_7b").loss, max_new_tokens=4096)
    assert cfg == GRPOLossConfig()
    check(cfg, seed)


@pytest.mark.parametrize("seed", [3, 4])
def test_dr_grpo_constant_normaliser(seed):
    cfg = GRPOLossConfig(aggregation="seq_sum_norm", norm_length=T)
    check(cfg, seed, aggregation="seq_sum_norm", length=T)
    with pytest.raises(ValueError, match="norm_length"):
        GRPOLossConfig(aggregation="seq_sum_norm")


def test_dr_grpo_micro_batches_add_up():
    """Dr. GRPO's loss divides by the (global) number of sequences: micro-batches given `denom` sum
    to the full-batch loss."""
    cfg = GRPOLossConfig(aggregation="seq_sum_norm", norm_length=40)
    new, old, mask, turn, a_seq, a_turn = random_batch(5)
    full = grpo_loss(new, old, None, mask, turn, a_seq, a_turn, cfg)[0]
    n_seq = float(((mask > 0) & (turn >= 0)).any(axis=1).sum())
    halves = [grpo_loss(new[s], old[s], None, mask[s], turn[s], a_seq[s], a_turn[s], cfg, denom=n_seq)[0]
              for s in (slice(0, 3), slice(3, 6))]
    assert float(sum(halves)) == pytest.approx(float(full), rel=1e-5)


@pytest.mark.parametrize("seed", [6, 7])
def test_dapo_decoupled_clip_and_token_mean(seed):
    # ε_high large enough that some positive-advantage tokens with r > 1.2 escape the clip.
    cfg = GRPOLossConfig(clip_eps_low=0.2, clip_eps_high=0.28, aggregation="token_mean")
    check(cfg, seed, eps_low=0.2, eps_high=0.28, aggregation="token_mean")
    # Asymmetric on the other side too: a wrong pairing of ε_low with the upper bound is seen.
    cfg = GRPOLossConfig(clip_eps_low=0.05, clip_eps_high=0.4)
    check(cfg, seed, eps_low=0.05, eps_high=0.4)


@pytest.mark.parametrize("seed", [8, 9])
def test_gspo_sequence_ratio_with_token_advantages(seed):
    cfg = GRPOLossConfig(ratio="sequence", clip_eps_low=0.03, clip_eps_high=0.04)
    check(cfg, seed, eps_low=0.03, eps_high=0.04, ratio="sequence")


def test_gspo_with_one_advantage_per_sequence_is_sequence_level_gspo():
    """With A constant over a sequence, GSPO-token's gradient is GSPO's: A_i·∇s_i / G (unclipped)."""
    new, old, mask, turn, a_seq, a_turn = random_batch(10)
    a_turn = np.zeros_like(a_turn)
    cfg = GRPOLossConfig(ratio="sequence", clip_eps=10.0)  # nothing clipped
    _, grad = loss_and_grad(cfg, new, old, mask, turn, a_seq, a_turn)
    trained = (mask > 0) & (turn >= 0)
    rows = np.flatnonzero(trained.any(axis=1))

    def s_i(lp, b):
        return jax.numpy.exp(((lp[b] - old[b]) * trained[b]).sum() / trained[b].sum())

    want = sum(-a_seq[b] / len(rows) * np.asarray(jax.grad(s_i)(new, b)) for b in rows)
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-7)


def test_config_rejects_unknown_variants():
    with pytest.raises(ValueError, match="aggregation"):
        GRPOLossConfig(aggregation="sum")
    with pytest.raises(ValueError, match="ratio"):
        GRPOLossConfig(ratio="geometric")
