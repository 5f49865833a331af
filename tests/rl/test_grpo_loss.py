"""The clipped GRPO loss and its gradient against hand computation; the chunked log-prob helper."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from codedance_jax.rl.grpo_loss import GRPOLossConfig, grpo_loss, token_advantages, token_logprobs
from codedance_jax.rl.registry import get_loss

# Two sequences, 4 positions, 2 turns. Seq 0: prompt token, 2 tokens of turn 0, 1 token of turn 1.
# Seq 1: two tokens of turn 0, an observation token (turn −1, mask 0), one padding token.
OLD = np.log(np.array([[0.5, 0.5, 0.4, 0.2], [0.3, 0.6, 0.9, 0.1]], np.float32))
RATIO = np.array([[1.0, 1.5, 0.7, 1.1], [0.9, 1.3, 5.0, 1.0]], np.float32)  # chosen by hand
NEW = OLD + np.log(RATIO)
MASK = np.array([[0, 1, 1, 1], [1, 1, 0, 0]], np.float32)
TURN = np.array([[-1, 0, 0, 1], [0, 0, -1, -1]], np.int32)
A_SEQ = np.array([0.5, -1.0], np.float32)
A_TURN = np.array([[0.3, -0.4], [0.2, 0.0]], np.float32)


def test_token_advantages_by_hand():
    got = np.asarray(token_advantages(A_SEQ, A_TURN, TURN))
    want = np.array([[0, 0.8, 0.8, 0.1], [-0.8, -0.8, 0, 0]], np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_clipped_loss_and_gradient_by_hand():
    # Seq 0 tokens: A = 0.8, r = 1.5 → clipped at 1.2 (A>0, r>1+ε): term 0.96, no gradient.
    #               A = 0.8, r = 0.7 → min(0.56, 0.8·0.8=0.64) = 0.56 unclipped, gradient.
    #               A = 0.1, r = 1.1 → inside the clip range: 0.11, gradient.
    # Seq 1 tokens: A = −0.8, r = 0.9 → inside: −0.72, gradient.
    #               A = −0.8, r = 1.3 → min(−1.04, −0.96) = −1.04 unclipped (A<0, r>1+ε), gradient.
    j0 = (0.96 + 0.56 + 0.11) / 3
    j1 = (-0.72 - 1.04) / 2
    want_loss = -(j0 + j1) / 2
    cfg = GRPOLossConfig()
    loss, metrics = grpo_loss(NEW, OLD, None, MASK, TURN, A_SEQ, A_TURN, cfg)
    assert float(loss) == pytest.approx(want_loss, rel=1e-5)
    assert float(metrics["clip_frac"]) == pytest.approx(1 / 5)
    assert float(metrics["n_tokens"]) == 5
    # d loss / d logprob = −A·r/(|τ_b|·n_seq) on unclipped tokens, 0 on clipped and masked ones.
    grad = np.asarray(jax.grad(lambda lp: grpo_loss(lp, OLD, None, MASK, TURN, A_SEQ, A_TURN, cfg)[0])(NEW))
    want = np.zeros((2, 4), np.float32)
    want[0, 2] = -0.8 * 0.7 / 3 / 2
    want[0, 3] = -0.1 * 1.1 / 3 / 2
    want[1, 0] = 0.8 * 0.9 / 2 / 2
    want[1, 1] = 0.8 * 1.3 / 2 / 2
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-7)


def test_token_mean_asymmetric_clip_and_denom():
    cfg = GRPOLossConfig(aggregation="token_mean", clip_eps_low=0.2, clip_eps_high=0.6)
    # ε_high = 0.6 un-clips the r = 1.5 token: its term becomes 1.2 (0.8·1.5).
    want = -(1.2 + 0.56 + 0.11 - 0.72 - 1.04) / 5
    loss, m = grpo_loss(NEW, OLD, None, MASK, TURN, A_SEQ, A_TURN, cfg)
    assert float(loss) == pytest.approx(want, rel=1e-5)
    assert float(m["clip_frac"]) == 0
    # Micro-batching: each half normalized by the global token count sums to the full loss.
    halves = [
        grpo_loss(
            NEW[i : i + 1],
            OLD[i : i + 1],
            None,
            MASK[i : i + 1],
            TURN[i : i + 1],
            A_SEQ[i : i + 1],
            A_TURN[i : i + 1],
            cfg,
            denom=5.0,
        )[0]
        for i in range(2)
    ]
    assert float(sum(halves)) == pytest.approx(want, rel=1e-5)
    cfg_seq = GRPOLossConfig()
    halves = [
        grpo_loss(
            NEW[i : i + 1],
            OLD[i : i + 1],
            None,
            MASK[i : i + 1],
            TURN[i : i + 1],
            A_SEQ[i : i + 1],
            A_TURN[i : i + 1],
            cfg_seq,
            denom=2.0,
        )[0]
        for i in range(2)
    ]
    full = grpo_loss(NEW, OLD, None, MASK, TURN, A_SEQ, A_TURN, cfg_seq)[0]
    assert float(sum(halves)) == pytest.approx(float(full), rel=1e-5)


def test_k3_kl_term_and_entropy_metric():
    ref = OLD + 0.3
    cfg = GRPOLossConfig(kl_coef=0.1)
    base, _ = grpo_loss(NEW, OLD, None, MASK, TURN, A_SEQ, A_TURN, GRPOLossConfig())
    loss, m = grpo_loss(NEW, OLD, ref, MASK, TURN, A_SEQ, A_TURN, cfg, entropy=np.full((2, 4), 2.0, np.float32))
    d = ref - NEW
    k3 = np.exp(d) - d - 1
    kl = ((k3[0, 1:].sum() / 3) + (k3[1, :2].sum() / 2)) / 2
    assert float(m["kl_ref"]) == pytest.approx(kl, rel=1e-5)
    assert float(loss) == pytest.approx(float(base) + 0.1 * kl, rel=1e-5)
    assert float(m["entropy"]) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(NEW, OLD, None, MASK, TURN, A_SEQ, A_TURN, cfg)
    assert get_loss("grpo") is grpo_loss


def test_masked_garbage_does_not_leak():
    # Huge log-probs on masked positions must not produce inf/nan in the loss or the gradient.
    new = NEW.copy()
    new[1, 2:] = 500.0
    loss, grads = jax.value_and_grad(
        lambda lp: grpo_loss(lp, OLD, None, MASK, TURN, A_SEQ, A_TURN, GRPOLossConfig())[0]
    )(new)
    assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(grads)))
    assert np.all(np.asarray(grads)[1, 2:] == 0)


@pytest.mark.parametrize("chunk", [3, 64])  # ragged last chunk; one chunk bigger than T
def test_token_logprobs_matches_full_log_softmax(chunk):
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(2, 7, 11)) * 3, jnp.bfloat16)
    targets = jnp.asarray(rng.integers(0, 11, size=(2, 7)), jnp.int32)
    temp = 0.7
    lp, ent = token_logprobs(logits, targets, temperature=temp, chunk_size=chunk)
    z = np.asarray(logits, np.float64) / temp
    logp = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)
    want_lp = np.take_along_axis(logp, np.asarray(targets)[..., None], -1)[..., 0]
    want_ent = -(np.exp(logp) * logp).sum(-1)
    np.testing.assert_allclose(np.asarray(lp), want_lp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ent), want_ent, rtol=1e-5, atol=1e-5)
    assert lp.dtype == jnp.float32
    # Gradients through the checkpointed chunks equal those of the plain formula.
    f = lambda x: token_logprobs(x, targets, temperature=temp, chunk_size=chunk)[0].sum()
    g = lambda x: jnp.take_along_axis(jax.nn.log_softmax(x.astype(jnp.float32) / temp), targets[..., None], -1).sum()
    x32 = logits.astype(jnp.float32)
    np.testing.assert_allclose(np.asarray(jax.grad(f)(x32)), np.asarray(jax.grad(g)(x32)), rtol=1e-5, atol=1e-6)
    assert math.isfinite(float(f(x32)))
