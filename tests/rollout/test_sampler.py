"""The sampling step and the device stop check, without a model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from codedance_jax.rollout import SamplingConfig, build_stop_table, sample
from codedance_jax.rollout.sampler import categorical, stop_hit


def test_categorical_draws_follow_the_distribution():
    rng = np.random.default_rng(0)
    v = 2500  # three blocks of the two-level inverse CDF, the last one partial
    p = rng.random(v) ** 8
    p[rng.random(v) < 0.3] = 0.0  # masked ids must never come out
    p[-1] = 0.0
    p = p / p.sum()
    n = 40000
    keys = jax.random.split(jax.random.key(1), n)
    draws = np.asarray(jax.jit(categorical)(keys, jnp.broadcast_to(jnp.asarray(p, jnp.float32), (n, v))))
    assert p[draws].min() > 0
    freq = np.bincount(draws, minlength=v) / n
    # Binomial standard error per id is at most sqrt(p/n); allow 5 of them plus a little.
    assert np.all(np.abs(freq - p) <= 5 * np.sqrt(p / n) + 2e-4)


def _draws(logits, cfg, vocab_limit, n=1000):
    keys = jax.random.split(jax.random.key(cfg.seed), n)
    fn = jax.jit(
        lambda k: sample(
            jnp.broadcast_to(logits, (n, logits.shape[0])),
            k,
            cfg.temperature,
            cfg.top_p,
            vocab_limit=vocab_limit,
            top_k=cfg.top_k,
            use_top_p=cfg.top_p < 1,
            greedy=cfg.greedy,
        )
    )
    tok, z, lse = fn(keys)
    return np.asarray(tok), np.asarray(z[0] - lse[0])


def test_top_k_top_p_vocab_mask_and_logprobs_before_truncation():
    v = 1500
    logits = np.full(v, -4.3, np.float32)
    logits[[10, 20, 30, 40]] = [3.0, 2.5, 2.0, 1.0]
    logits[1490] = 9.0  # past the tokenizer: the most likely id must never be sampled
    logits = jnp.asarray(logits)
    full_lp = np.asarray(jax.nn.log_softmax(logits / 0.7))

    tok, lp = _draws(logits, SamplingConfig(temperature=0.7, top_k=2), vocab_limit=1400)
    assert set(np.unique(tok)) == {10, 20}
    np.testing.assert_allclose(lp, full_lp, atol=1e-5)  # the recorded log-probs ignore truncation

    # top_p: masses (T=1, among allowed ids) of ids 10, 20, 30 are ~0.32, 0.20, 0.12 (cumulative 0.32,
    # 0.52, 0.64): p = 0.5 keeps 10 and 20 (20 crosses p), p = 0.6 also 30.
    tok, _ = _draws(logits, SamplingConfig(top_p=0.5), vocab_limit=1400)
    assert set(np.unique(tok)) == {10, 20}
    tok, _ = _draws(logits, SamplingConfig(top_p=0.6), vocab_limit=1400)
    assert set(np.unique(tok)) == {10, 20, 30}

    tok, _ = _draws(logits, SamplingConfig(greedy=True), vocab_limit=1400, n=4)
    assert set(tok) == {10}
    tok, _ = _draws(logits, SamplingConfig(), vocab_limit=1400)
    assert tok.max() < 1400


def test_sampling_config_rejects_bad_values():
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0.0)


@pytest.fixture(scope="module")
def stop_table(processor):
    return build_stop_table(processor.tokenizer, ("</code>", "</tool_call>", "</answer>", "<|im_end|>"), 151936)


@pytest.mark.parametrize(
    "text, hit",
    [
        ("```\n</code>", True),  # canonical </ code >
        ("x </code>", True),  # ' </' merged with the space
        ("(1)</answer>", True),
        ("done.<|im_end|>", True),
        ("<tool_call>{}</tool_call>", True),  # one added token
        ("</cod", False),
        ("</code", False),
        ("<code>\n", False),
        ("</code>\n", False),  # ends inside '>\\n': left to the host check
    ],
)
def test_stop_forms_on_token_ids(processor, stop_table, text, hit):
    table = stop_table
    ids = processor.tokenizer.encode(text)
    hist = np.full((1, table.history), -1, np.int32)
    tail = ids[-table.history :]
    hist[0, table.history - len(tail) :] = tail
    got = stop_hit(
        jnp.asarray(hist),
        jnp.asarray(table.tail),
        jnp.asarray(table.head_col),
        jnp.asarray(table.head_ok),
        jnp.asarray(table.has_head),
    )
    assert bool(got[0]) == hit
