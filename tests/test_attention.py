"""The cache-free forward's blocked causal attention and the custom-VJP softmax.

`text.Attention` splits queries into `CAUSAL_BLOCK`-row blocks that skip the upper triangle, and
`layers.masked_softmax` has its own backward. Both must give the values and gradients of the plain
computation: one block over all keys and `jax.nn.softmax` of the masked logits, differentiated by
JAX (the parity tests against `transformers` check values only).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from codedance_jax.model import layers, text
from codedance_jax.model.config import TextConfig


def _plain_softmax(logits, mask):
    return jax.nn.softmax(jnp.where(mask, logits, layers.NEG_INF), axis=-1)


def test_masked_softmax_values_and_gradients_equal_jax_softmax():
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(size=(3, 2, 9, 11)) * 4, jnp.float32)
    mask = jnp.asarray(rng.random((3, 1, 9, 11)) < 0.7)
    mask = mask.at[0, 0, 2].set(False)  # a row that sees nothing: uniform, finite
    ct = jnp.asarray(rng.normal(size=logits.shape), jnp.float32)
    ours = layers.masked_softmax(logits, mask)
    ref = _plain_softmax(logits, mask)
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-7)
    assert bool(jnp.all(jnp.isfinite(ours)))
    g_ours = jax.grad(lambda x: jnp.sum(layers.masked_softmax(x, mask) * ct))(logits)
    g_ref = jax.grad(lambda x: jnp.sum(_plain_softmax(x, mask) * ct))(logits)
    np.testing.assert_allclose(g_ours, g_ref, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(g_ref).max()) > 1e-2  # the comparison is not between two zeros


@pytest.mark.parametrize("kind", ["causal", "segments"])
def test_blocked_causal_attention_equals_one_block_in_values_and_gradients(kind, monkeypatch):
    cfg = TextConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, mrope_section=(1, 1, 2))
    attn = text.Attention(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(4 if kind == "causal" else 5)
    b, t = 3, 45  # blocks of 16: two full and a partial one
    x = jnp.asarray(rng.normal(size=(b, t, cfg.hidden_size)), jnp.float32)
    ang = rng.normal(size=(b, t, cfg.head_dim // 2))
    cos = jnp.asarray(np.cos(np.concatenate([ang, ang], -1)), jnp.float32)
    sin = jnp.asarray(np.sin(np.concatenate([ang, ang], -1)), jnp.float32)
    if kind == "causal":  # right padding of different lengths
        valid = np.arange(t)[None] < np.array([[t], [30], [7]])
        mask = text.causal_mask(jnp.asarray(valid))
    else:  # packed rows: segments of random lengths, padding at the end
        seg = np.sort(rng.integers(0, 4, (b, t)), axis=1)
        seg[:, -5:] = -1
        mask = text.segment_mask(jnp.asarray(seg))
    ct = jnp.asarray(rng.normal(size=x.shape), jnp.float32)
    graphdef, params = nnx.split(attn)

    def loss(params, x):
        out, _ = nnx.merge(graphdef, params)(x, cos, sin, mask)
        return jnp.sum(out * ct), out

    def run(block):
        monkeypatch.setattr(text, "CAUSAL_BLOCK", block)  # read when the function is traced
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)

    (_, out_b), grads_b = run(16)
    (_, out_1), grads_1 = run(t)  # one block over all keys, the cache path's computation
    np.testing.assert_allclose(out_b, out_1, rtol=1e-5, atol=1e-6)
    for gb, g1 in zip(jax.tree.leaves(grads_b), jax.tree.leaves(grads_1), strict=True):
        np.testing.assert_allclose(gb, g1, rtol=1e-4, atol=1e-6)
        assert float(jnp.abs(g1).max()) > 1e-4


@pytest.mark.parametrize("grouped", [False, True], ids=["per_head", "grouped"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (8, 2), (4, 4)])
def test_one_token_decode_step_equals_plain_attention_over_the_cache(heads, kv_heads, grouped):
    """A one-token step against a cache takes each KV head's query heads one at a time (M = 1
    products; XLA CPU) or together (one M = G product; TPU, `grouped_decode`); either way the result
    is plain softmax attention over the valid slots, per head."""
    cfg = TextConfig(vocab_size=64, hidden_size=8 * heads, intermediate_size=48, num_hidden_layers=1,
                     num_attention_heads=heads, num_key_value_heads=kv_heads, mrope_section=(1, 1, 2))  # head_dim 8
    attn = text.Attention(cfg, dtype=jnp.float32, rngs=nnx.Rngs(1), grouped_decode=grouped)
    rng = np.random.default_rng(heads * 10 + kv_heads)
    b, s, index, h = 5, 24, 17, cfg.head_dim
    x = jnp.asarray(rng.normal(size=(b, 1, cfg.hidden_size)), jnp.float32)
    ang = rng.normal(size=(b, 1, h // 2))
    cos = jnp.asarray(np.cos(np.concatenate([ang, ang], -1)), jnp.float32)
    sin = jnp.asarray(np.sin(np.concatenate([ang, ang], -1)), jnp.float32)
    ck = rng.normal(size=(b, kv_heads, s, h)).astype(np.float32)
    cv = rng.normal(size=(b, kv_heads, s, h)).astype(np.float32)
    valid = rng.random((b, s)) < 0.6
    valid[:, index] = True  # the new token's own slot
    mask = text.cache_mask(jnp.asarray(valid), index, 1)
    out, (k_all, v_all) = jax.jit(lambda x: attn(x, cos, sin, mask, (jnp.asarray(ck), jnp.asarray(cv)), index))(x)
    # The reference: the step's own query, keys and values (written at `index`), attention in numpy.
    q = jnp.einsum("btd,dnh->btnh", x, attn.q_kernel.value) + attn.q_bias.value
    q = np.asarray(text.rope.apply_rope(q, cos[:, :, None], sin[:, :, None]))[:, 0]  # [B, N, H]
    k_all, v_all = np.asarray(k_all), np.asarray(v_all)
    np.testing.assert_allclose(np.delete(k_all, index, axis=2), np.delete(ck, index, axis=2))
    see = np.asarray(mask)[:, 0]  # [B, S]
    ref = np.zeros((b, heads, h), np.float32)
    for n in range(heads):
        kv = n // (heads // kv_heads)
        logits = np.einsum("bh,bsh->bs", q[:, n], k_all[:, kv]) * h**-0.5
        logits = np.where(see, logits, -np.inf)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        ref[:, n] = np.einsum("bs,bsh->bh", p, v_all[:, kv])
    want = ref.reshape(b, 1, heads * h) @ np.asarray(attn.o_kernel.value).reshape(heads * h, cfg.hidden_size)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
    assert float(np.abs(want).max()) > 1e-3


def test_cached_chunk_in_query_blocks_equals_one_block(monkeypatch):
    """A chunk appended over a cache goes EXTEND_BLOCK queries at a time (`lax.map`) when it is a
    multiple of the block: the values of one block over all slots, every head, holes in the cache."""
    cfg = TextConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, mrope_section=(1, 1, 2))
    attn = text.Attention(cfg, dtype=jnp.float32, rngs=nnx.Rngs(2))
    rng = np.random.default_rng(6)
    b, t, s, index, h = 3, 24, 40, 11, cfg.head_dim
    x = jnp.asarray(rng.normal(size=(b, t, cfg.hidden_size)), jnp.float32)
    ang = rng.normal(size=(b, t, h // 2))
    cos = jnp.asarray(np.cos(np.concatenate([ang, ang], -1)), jnp.float32)
    sin = jnp.asarray(np.sin(np.concatenate([ang, ang], -1)), jnp.float32)
    cache = tuple(jnp.asarray(rng.normal(size=(b, 2, s, h)), jnp.float32) for _ in range(2))
    valid = rng.random((b, s)) < 0.6
    valid[:, index:index + t] = rng.random((b, t)) < 0.8  # ragged chunk rows
    mask = text.cache_mask(jnp.asarray(valid), index, t)

    def run(block):
        monkeypatch.setattr(text, "EXTEND_BLOCK", block)  # read when the function is traced
        return jax.jit(lambda x: attn(x, cos, sin, mask, cache, index))(x)

    out_b, kv_b = run(8)  # three blocks
    out_1, kv_1 = run(t)  # one block: the chunk's scores at once
    np.testing.assert_allclose(out_b, out_1, rtol=1e-5, atol=1e-6)
    for a, c in zip(kv_b, kv_1, strict=True):
        np.testing.assert_array_equal(a, c)
    assert float(jnp.abs(out_1).max()) > 1e-3
    jaxpr = lambda: str(jax.make_jaxpr(lambda x: attn(x, cos, sin, mask, cache, index))(x))  # noqa: E731
    assert "scan" not in jaxpr()  # one block: no loop
    monkeypatch.setattr(text, "EXTEND_BLOCK", 8)
    assert "scan" in jaxpr()  # the blocks ran as a loop (`lax.map`)
