"""Packed GRPO batches (`train.packing`): the same log-probs, losses and updates as unpacked."""

import jax
import ml_collections
import numpy as np
from model_helpers import tiny_small_vocab, train_batch

from codedance_jax import sharding as shd
from codedance_jax.rl.grpo_loss import GRPOLossConfig
from codedance_jax.train import grpo, optim, packing, rl_batch, sft
from codedance_jax.train import state as st


def _batch(cfg, seed, pad_to=96):
    rng = np.random.default_rng(seed)
    b = train_batch(rng, cfg, 8, 32, [[(1, 4, 4)], [], [(1, 4, 8)]])
    t = b["input_ids"].shape[1]
    for k in ("input_ids", "attention_mask", "targets", "loss_mask"):  # right-pad the rows to a long bucket
        fill = cfg.bos_token_id if k in ("input_ids", "targets") else 0
        b[k] = np.pad(b[k], ((0, 0), (0, pad_to - t)), constant_values=fill)
    b["positions"] = np.pad(b["positions"], ((0, 0), (0, 0), (0, pad_to - t)))
    lm = b["loss_mask"] > 0
    b["turn_ids"] = np.where(lm, rng.integers(0, 3, lm.shape), -1).astype(np.int32)
    b["a_seq"] = rng.standard_normal(8).astype(np.float32)
    b["a_turn"] = rng.standard_normal((8, 3)).astype(np.float32)
    b["old_logprobs"] = (-rng.random(lm.shape) * 8).astype(np.float32) * b["loss_mask"]
    return b


def test_pack_plan_covers_every_token_once_in_whole_rows():
    rng = np.random.default_rng(0)
    mask = np.zeros((16, 64), np.int32)
    lengths = rng.integers(1, 20, 16)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    src = packing.pack_plan(mask)
    assert src is not None and src.shape[0] == 16 and src.shape[1] in (8, 12, 16, 24, 32)
    flat = src.reshape(-1)
    got = np.sort(flat[flat >= 0])
    assert np.array_equal(got, np.sort(np.nonzero(mask.reshape(-1))[0]))
    rows = np.pad(flat, (0, (-len(flat)) % 64), constant_values=-1).reshape(-1, 64)
    for r in rows:  # each original row sits whole, in order, inside one packed row
        v = r[r >= 0]
        for seg in np.unique(v // 64):
            s = v[v // 64 == seg]
            assert np.array_equal(s, seg * 64 + np.arange(lengths[seg]))
    full = np.ones((4, 64), np.int32)
    assert packing.pack_plan(full) is None  # nothing to save


def test_packed_logprobs_loss_and_update_equal_unpacked():
    cfg = tiny_small_vocab()  # packing does not depend on the vocabulary; tiny's 152k rows dominate the step
    oc = ml_collections.ConfigDict(dict(lr=1e-3, warmup_ratio=0.0, weight_decay=0.0, b1=0.9, b2=0.95, eps=1e-8,
                                        clip_norm=0.0, schedule="constant"))
    tx, sched = optim.make_optimizer(oc, 10)
    mesh = shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    b = _batch(cfg, seed=4)
    src = packing.pack_plan(b["attention_mask"])
    assert src is not None
    pb = rl_batch.pad_rows({**b, "pack_src": src}, 10)  # padding rows (as the loop adds) stay empty
    b = rl_batch.pad_rows(b, 10)
    out = []
    for batch in (b, pb):
        mdef, state, sh = st.create_train_state(cfg, tx, mesh, seed=3)
        fields = {k: v for k, v in batch.items() if k in sft.BATCH_FIELDS}
        lp = np.asarray(grpo.make_logprob_fn(mdef, sh.params, sft.batch_shardings(fields, mesh), mesh)(state.params, fields))
        step = grpo.make_grpo_step(mdef, tx, sched, GRPOLossConfig(), sh, sft.batch_shardings(batch, mesh), mesh)
        state, m = step(state, batch, jax.random.key(0))
        out.append((lp, float(m["loss"]), float(m["entropy"]), jax.device_get(state.params)))
    (lp0, l0, e0, p0), (lp1, l1, e1, p1) = out
    mask = b["attention_mask"] > 0
    np.testing.assert_allclose(lp1[mask], lp0[mask], atol=2e-5)
    assert np.all(lp1[~mask] == 0)
    np.testing.assert_allclose(l1, l0, rtol=1e-5)
    np.testing.assert_allclose(e1, e0, rtol=1e-5)
    diff = max(float(np.abs(x - y).max()) for x, y in zip(jax.tree.leaves(p0), jax.tree.leaves(p1), strict=True))
    assert diff < 1e-5
