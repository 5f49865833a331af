"""The sharded GRPO update on the tiny model: direction, micro-batch and mesh invariance."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx
from model_helpers import FAST_COMPILE, tiny_small_vocab, train_batch

from codedance_jax import sharding as shd
from codedance_jax.rl.grpo_loss import GRPOLossConfig
from codedance_jax.train import grpo, optim, sft
from codedance_jax.train import state as st

M = 3


def _setup(mesh_shape, lr=1e-3, remat="none"):
    cfg = tiny_small_vocab().replace(remat=remat)
    # eps 1e-6, not 1e-8: Adam's first step is lr * g / (|g| + eps), so with eps 1e-8 an embedding row
    # whose gradient is ~1e-8 turns float rounding (another mesh's reduction order) into 1e-5 of
    # parameter (seen: 8e-6 and 1.2e-5 on the tiny model); with 1e-6 the meshes agree to ~5e-7.
    oc = ml_collections.ConfigDict(dict(lr=lr, warmup_ratio=0.0, weight_decay=0.0, b1=0.9, b2=0.95, eps=1e-6,
                                        clip_norm=0.0, schedule="constant"))
    tx, sched = optim.make_optimizer(oc, 10)
    mesh = shd.make_mesh(*mesh_shape, devices=jax.devices()[: int(np.prod(mesh_shape))])
    mdef, state, sh = st.create_train_state(cfg, tx, mesh, seed=3)
    return cfg, tx, sched, mesh, mdef, state, sh


def _rl_batch(cfg, seed=0):
    rng = np.random.default_rng(seed)
    b = train_batch(rng, cfg, 8, 32, [[(1, 4, 4)], []])
    lm = b["loss_mask"] > 0
    turn = np.where(lm, rng.integers(0, M, lm.shape), -1).astype(np.int32)
    b["turn_ids"] = turn
    b["a_seq"] = np.where(np.arange(8) % 2 == 0, 1.0, -1.0).astype(np.float32)  # +A on even rows
    b["a_turn"] = np.zeros((8, M), np.float32)
    return b


def test_one_update_moves_logprobs_with_the_advantage_sign():
    cfg, tx, sched, mesh, mdef, state, sh = _setup((1, 1, 1))
    b = _rl_batch(cfg)
    lp_fn = grpo.make_logprob_fn(mdef, sh.params, sft.batch_shardings(b, mesh), mesh, compiler_options=FAST_COMPILE)
    old = np.asarray(lp_fn(state.params, b))
    b["old_logprobs"] = old * b["loss_mask"]
    bsh = sft.batch_shardings(b, mesh)
    step = grpo.make_grpo_step(mdef, tx, sched, GRPOLossConfig(), sh, bsh, mesh, compiler_options=FAST_COMPILE)
    gb, rng = {k: jax.device_put(v, bsh[k]) for k, v in b.items()}, jax.random.key(0)
    with jax.transfer_guard("disallow"):
        with pytest.raises(Exception, match="Disallowed host-to-device transfer"):
            step(state, b, rng)  # the guard is live: a numpy batch is a host->device copy (state is not consumed)
        state, m = step(state, gb, rng)
    m = jax.device_get(m)
    new = np.asarray(lp_fn(state.params, {k: v for k, v in b.items() if k != 'old_logprobs'}))
    mask = b["loss_mask"] > 0
    delta = (new - old)
    pos = delta[mask & (b["a_seq"][:, None] > 0)].mean()
    neg = delta[mask & (b["a_seq"][:, None] < 0)].mean()
    assert pos > 0 > neg, (pos, neg)
    # on-policy first step: ratio 1, nothing clipped
    assert abs(float(m["ratio_mean"]) - 1.0) < 1e-5 and float(m["clip_frac"]) == 0.0


@pytest.mark.parametrize("mesh_shape,accum", [((1, 1, 1), 4), ((2, 2, 2), 1)])
def test_grpo_step_is_invariant_to_micro_batches_and_mesh(mesh_shape, accum):
    """Tolerance: loss 1e-5 relative, params 1e-5 absolute vs single device, no accumulation."""
    results = []
    for shape, acc in (((1, 1, 1), 1), (mesh_shape, accum)):
        cfg, tx, sched, mesh, mdef, state, sh = _setup(shape)
        b = _rl_batch(cfg, seed=1)
        rng = np.random.default_rng(2)
        b["old_logprobs"] = (-rng.random(b["loss_mask"].shape) * 12).astype(np.float32) * b["loss_mask"]
        b["a_turn"] = rng.standard_normal((8, M)).astype(np.float32)
        bsh = sft.batch_shardings(b, mesh)
        step = grpo.make_grpo_step(mdef, tx, sched, GRPOLossConfig(), sh, bsh, mesh, accum_steps=acc, compiler_options=FAST_COMPILE)
        gb, rng = {k: jax.device_put(v, bsh[k]) for k, v in b.items()}, jax.random.key(0)
        with jax.transfer_guard("disallow"):
            state, m = step(state, gb, rng)
        m = jax.device_get(m)
        results.append((float(m["loss"]), jax.device_get(state.params), float(m["clip_frac"])))
    (l0, p0, c0), (l1, p1, c1) = results
    np.testing.assert_allclose(l1, l0, rtol=1e-5)
    np.testing.assert_allclose(c1, c0, rtol=1e-5)
    diff = max(float(jnp.abs(x - y).max()) for x, y in zip(jax.tree.leaves(p0), jax.tree.leaves(p1), strict=True))
    assert diff < 1e-5


@pytest.mark.parametrize("remat", ["none", "full"])
def test_micro_batched_logprob_recompute_keeps_rows_and_values(remat):
    """accum_steps splits rows with a stride (each micro-batch spans every chip); rows come back in order.
    remat='full' (the 3B/7B GRPO presets): the micro-batch loop failed to trace (TraceContextError; issue 19)."""
    cfg, tx, sched, mesh, mdef, state, sh = _setup((1, 4, 1), remat=remat)
    b = {k: v for k, v in _rl_batch(cfg, seed=5).items() if k in sft.BATCH_FIELDS}
    bsh = sft.batch_shardings(b, mesh)
    whole = np.asarray(grpo.make_logprob_fn(mdef, sh.params, bsh, mesh, compiler_options=FAST_COMPILE)(state.params, b))
    micro = np.asarray(grpo.make_logprob_fn(mdef, sh.params, bsh, mesh, accum_steps=2, compiler_options=FAST_COMPILE)(state.params, b))
    np.testing.assert_allclose(micro, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("accum", [1, 2])
def test_old_logprobs_from_the_update_forward_equal_a_separate_recompute(accum):
    """`old_from_forward`: the update's own forward gives the old log-probs (one update per batch), so
    the new parameters equal those of a step fed the separately recomputed ones, and
    `logprob_mismatch` is the max gap to the batch's (sampler's) log-probs over the trained tokens."""
    results = []
    for from_forward in (False, True):
        cfg, tx, sched, mesh, mdef, state, sh = _setup((1, 1, 1))
        b = _rl_batch(cfg, seed=7)
        b["a_turn"] = np.random.default_rng(8).standard_normal((8, M)).astype(np.float32)
        old = np.asarray(grpo.make_logprob_fn(mdef, sh.params, sft.batch_shardings(b, mesh), mesh, compiler_options=FAST_COMPILE)(state.params, b))
        mask = b["loss_mask"] > 0
        # recompute: the batch holds the trainer's log-probs; from the forward: the "sampler's", off by
        # up to 0.5 (ratios that far from 1 would be clipped: a step that used them would differ)
        noise = np.random.default_rng(9).uniform(-0.5, 0.5, old.shape).astype(np.float32)
        b["old_logprobs"] = ((old + noise * from_forward) * b["loss_mask"]).astype(np.float32)
        bsh = sft.batch_shardings(b, mesh)
        step = grpo.make_grpo_step(mdef, tx, sched, GRPOLossConfig(), sh, bsh, mesh, accum_steps=accum,
                                   old_from_forward=from_forward, compiler_options=FAST_COMPILE)
        state, m = step(state, {k: jax.device_put(v, bsh[k]) for k, v in b.items()}, jax.random.key(0))
        m = jax.device_get(m)
        results.append((jax.device_get(state.params), m))
        if from_forward:
            np.testing.assert_allclose(float(m["logprob_mismatch"]), np.abs(noise[mask]).max(), rtol=1e-4)
        else:
            assert "logprob_mismatch" not in m
    (p0, m0), (p1, m1) = results
    np.testing.assert_allclose(float(m1["loss"]), float(m0["loss"]), rtol=1e-5)
    assert abs(float(m1["ratio_mean"]) - 1.0) < 1e-6 and float(m1["clip_frac"]) == 0.0
    diff = max(float(jnp.abs(x - y).max()) for x, y in zip(jax.tree.leaves(p0), jax.tree.leaves(p1), strict=True))
    assert diff < 1e-5  # two compiled programs: float rounding only (the other tests' tolerance)



def test_frozen_groups_get_no_update_and_the_others_the_unfrozen_one():
    """optim.freeze (AdamW with weight decay and a global-norm clip, random gradients): the frozen
    vision tower's updates are exactly 0 over three steps; the decoder's equal those of the
    unfrozen optimizer whose clip sees the decoder's gradients alone."""
    cfg = tiny_small_vocab()
    abstract = nnx.to_pure_dict(st.abstract_params(cfg)[1])
    rng = np.random.default_rng(6)
    params = jax.tree.map(lambda p: rng.standard_normal(p.shape).astype(np.float32) * 0.1, abstract)
    grads = [jax.tree.map(lambda p: rng.standard_normal(p.shape).astype(np.float32), abstract) for _ in range(3)]
    base = dict(lr=1e-3, warmup_ratio=0.0, weight_decay=0.1, b1=0.9, b2=0.95, eps=1e-6, clip_norm=1.0, schedule="constant")
    frozen_tx, _ = optim.make_optimizer(ml_collections.ConfigDict({**base, "freeze": ("visual",)}), 10)
    plain_tx, _ = optim.make_optimizer(ml_collections.ConfigDict(base), 10)
    fs, ps = frozen_tx.init(params), plain_tx.init(params)
    f_update, p_update = jax.jit(frozen_tx.update), jax.jit(plain_tx.update)
    for g in grads:
        fu, fs = f_update(g, fs, params)
        pu, ps = p_update({**g, "visual": jax.tree.map(np.zeros_like, g["visual"])}, ps, params)
        assert _maxabs(fu["visual"]) == 0.0
        assert _maxabs(fu["layers"]) > 1e-5
        for k in ("embed", "layers", "norm"):
            assert _maxdiff(fu[k], pu[k]) < 1e-7, k
    bad_tx, _ = optim.make_optimizer(ml_collections.ConfigDict({**base, "freeze": ("vision",)}), 10)
    with pytest.raises(ValueError, match=r"config.optim.freeze=\('vision',\): no parameter group \['vision'\]"):
        jax.jit(bad_tx.update)(grads[0], bad_tx.init(params), params)


def _maxabs(a) -> float:
    return max(float(np.abs(x).max()) for x in jax.tree.leaves(a))


def _maxdiff(a, b) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
