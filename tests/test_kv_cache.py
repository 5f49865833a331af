"""Prefill + decode + append-prefill through the static cache equal one full forward.

The trajectory mimics a rollout: a left-padded batch of prompts with images, a few decoded
tokens, then an observation chunk with a new image for one row only (the other row sits out),
then more decoding. Every logit produced along the way must equal the full forward's logit at
the same token (max relative error <= 1e-4; observed ~1e-6).
"""

import jax.numpy as jnp
import numpy as np
from model_helpers import build_row, left_pad, random_patches, rel_err

from codedance_jax.model.generate import decode_step, extend_host, greedy_decode


def test_prefill_decode_append_equal_full_forward(tiny_pair):
    _, model, cfg = tiny_pair
    rng = np.random.default_rng(30)
    g0 = [[(1, 4, 6)], [(1, 6, 4), (1, 2, 2)]]
    rows = [build_row(rng, cfg, g, [3] + [4] * len(g)) for g in g0]
    rows[0] = rows[0][:-2]  # different prompt lengths -> left padding
    ids, mask = left_pad(rows)
    grids0 = np.array([g for gs in g0 for g in gs])
    pv0 = random_patches(rng, cfg, grids0)

    cache = model.init_cache(batch=2, max_len=96)
    logits_pre, cache = extend_host(model, cache, ids, mask, pv0, grids0)
    seq_logits = [[lg for lg, m in zip(np.asarray(logits_pre[b]), mask[b], strict=True) if m] for b in range(2)]
    seqs = [list(r) for r in rows]
    images = [list(map(tuple, grids0[:1])), list(map(tuple, grids0[1:]))]
    patches = [pv0[: 24], pv0[24:]]

    # Decode 3 tokens (random, as a sampler would pick) for both rows.
    for _ in range(3):
        tok = rng.integers(10, 5000, 2)
        lg, cache = decode_step(model, cache, jnp.asarray(tok, jnp.int32))
        for b in range(2):
            seqs[b].append(int(tok[b]))
            seq_logits[b].append(np.asarray(lg[b]))

    # Row 1 receives an observation with a new image; row 0 sits out (mask 0).
    obs_grid = (1, 4, 4)
    obs = [151645, 198, 151644, 872] + [cfg.vision_start_token_id] + [cfg.image_token_id] * 4 + [cfg.vision_end_token_id, 77, 88]
    chunk = np.array([[0] * len(obs), obs])
    cmask = np.array([[0] * len(obs), [1] * len(obs)])
    pv_obs = random_patches(rng, cfg, [obs_grid])
    lg, cache = extend_host(model, cache, chunk, cmask, pv_obs, np.array([obs_grid]))
    seqs[1] += obs
    seq_logits[1] += list(np.asarray(lg[1]))
    images[1].append(obs_grid)
    patches[1] = np.concatenate([patches[1], pv_obs])

    for _ in range(2):
        tok = rng.integers(10, 5000, 2)
        lg, cache = decode_step(model, cache, jnp.asarray(tok, jnp.int32))
        for b in range(2):
            seqs[b].append(int(tok[b]))
            seq_logits[b].append(np.asarray(lg[b]))

    for b in range(2):
        full = np.asarray(model(np.array([seqs[b]]), None, patches[b], np.array(images[b])))[0]
        got = np.stack(seq_logits[b])
        assert got.shape == full.shape
        assert rel_err(got, full) <= 1e-4


def test_greedy_decode_loop_matches_stepwise(tiny_pair):
    _, model, cfg = tiny_pair
    rng = np.random.default_rng(31)
    ids = rng.integers(10, 5000, (3, 11))
    cache = model.init_cache(batch=3, max_len=32)
    last, cache = extend_host(model, cache, ids, last_only=True)
    toks, _, _ = greedy_decode(model, cache, last, 6)
    toks = np.asarray(toks)
    # Reference: recompute greedily with full forwards.
    seq = ids.copy()
    for i in range(6):
        nxt = np.asarray(model(seq)).argmax(-1)[:, -1]
        np.testing.assert_array_equal(toks[:, i], nxt)
        seq = np.concatenate([seq, nxt[:, None]], axis=1)


def test_cache_overflow_is_a_clear_error(tiny_pair):
    import pytest

    _, model, _ = tiny_pair
    cache = model.init_cache(batch=1, max_len=8)
    with pytest.raises(ValueError, match="cache overflow"):
        extend_host(model, cache, np.arange(10, 20)[None])


def test_a_remat_policy_decodes_in_the_jitted_loop_like_a_plain_one():
    """The GRPO presets train with remat='full' and hand that model to the rollout engine: its cache
    steps must run inside the decode loops (nnx.remat there raised TraceContextError; issue 19)."""
    from flax import nnx
    from model_helpers import tiny_small_vocab

    from codedance_jax.model.qwen25vl import Qwen25VL

    cfg = tiny_small_vocab()
    plain, remat = (Qwen25VL(cfg.replace(remat=r), rngs=nnx.Rngs(3)) for r in ("none", "full"))
    ids = np.random.default_rng(5).integers(10, 5000, (2, 7))
    out = []
    for model in (plain, remat):
        last, cache = extend_host(model, model.init_cache(batch=2, max_len=16), ids, last_only=True)
        out.append(np.asarray(greedy_decode(model, cache, last, 4)[0]))
    np.testing.assert_array_equal(out[1], out[0])


def test_fresh_prefill_of_long_left_padded_prompts_equals_full_forward(tiny_pair):
    """A prompt into an empty cache attends within itself (blocked causal attention over its own
    keys, `extend(fresh=True)`); prompts longer than two blocks, left-padded, then two decode steps
    that read the cache it wrote."""
    from codedance_jax.model import text

    _, model, cfg = tiny_pair
    rng = np.random.default_rng(31)
    rows = [list(rng.integers(10, 5000, n)) for n in (2 * text.CAUSAL_BLOCK + 9, text.CAUSAL_BLOCK - 3)]
    ids, mask = left_pad(rows)
    cache = model.init_cache(batch=2, max_len=ids.shape[1] + 8)
    logits_pre, cache = extend_host(model, cache, ids, mask)
    seqs = [list(r) for r in rows]
    got = [[lg for lg, m in zip(np.asarray(logits_pre[b]), mask[b], strict=True) if m] for b in range(2)]
    for _ in range(2):
        tok = rng.integers(10, 5000, 2)
        lg, cache = decode_step(model, cache, jnp.asarray(tok, jnp.int32))
        for b in range(2):
            seqs[b].append(int(tok[b]))
            got[b].append(np.asarray(lg[b]))
    for b in range(2):
        full = np.asarray(model(np.array([seqs[b]]), None))[0]
        assert rel_err(np.stack(got[b]), full) <= 1e-4
