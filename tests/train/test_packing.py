"""Packed GRPO and SFT batches (`train.packing`): the same log-probs, losses and updates as unpacked."""

import jax
import ml_collections
import numpy as np
import pytest
from model_helpers import FAST_COMPILE, tiny_small_vocab, train_batch

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
        lp = np.asarray(grpo.make_logprob_fn(mdef, sh.params, sft.batch_shardings(fields, mesh), mesh, compiler_options=FAST_COMPILE)(state.params, fields))
        step = grpo.make_grpo_step(mdef, tx, sched, GRPOLossConfig(), sh, sft.batch_shardings(batch, mesh), mesh, compiler_options=FAST_COMPILE)
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


def _examples(cfg, rng, n):
    """n random trajectories with 0-2 images each, as `data.featurize` makes them."""
    from model_helpers import build_row, random_patches

    from codedance_jax.model.rope import mrope_positions
    from codedance_jax.train.batching import Bucket, Example, num_windows

    out = []
    for i in range(n):
        grids = [[], [(1, 4, 4)], [(1, 2, 4), (1, 4, 2)]][i % 3]
        text = [int(x) for x in rng.integers(3, 30, len(grids) + 1)]
        ids = np.asarray(build_row(rng, cfg, grids, text), np.int32)
        g = np.asarray(grids, np.int64).reshape(-1, 3)
        pos = mrope_positions(ids[None], None, g if len(g) else None, image_token_id=cfg.image_token_id,
                              spatial_merge_size=cfg.vision.spatial_merge_size)[0][:, 0]
        pv = random_patches(rng, cfg, grids) if grids else np.zeros((0, cfg.vision.patch_dim), np.float32)
        trained = (rng.random(len(ids)) < 0.6) & (ids != cfg.image_token_id)
        needs = Bucket(len(ids), int(sum(np.prod(x) for x in grids)) // 4, num_windows(g, cfg.vision))
        out.append(Example(ids, trained, pos, pv, g, needs, 0, f"ex{i}"))
    return out


def test_packed_sft_batch_gives_the_unpacked_loss_and_update_on_any_mesh():
    """Ten examples packed several to a row (segment mask, per-example positions and images) train
    exactly as the same ten padded one per row: loss within 1e-5 and parameters after one AdamW step
    within 5e-5 (observed 1.5e-5: the first Adam step is ~lr * sign(g), so gradients near 0 summed
    in another order move by up to lr; a wrong mask or position moves them by ~lr everywhere), on
    one device and on a (2, 2, 1) mesh with 2 micro-batches."""
    from codedance_jax.train.batching import Bucket, collate, collate_packed

    cfg = tiny_small_vocab()
    rng = np.random.default_rng(7)
    exs = _examples(cfg, rng, 10)
    bucket = Bucket(96, 16, 8)
    row = Bucket(192, 32, 16)
    rows = packing.pack_examples(exs, row)
    assert sorted(ex.source for r in rows for ex in r) == sorted(ex.source for ex in exs)  # each example once
    assert len(rows) < len(exs) // 2
    for r in rows:
        assert sum(ex.needs.tokens for ex in r) <= row.tokens and sum(ex.needs.image_tokens for ex in r) <= row.image_tokens
    plain = collate(exs, bucket, pad_id=cfg.bos_token_id, vision_cfg=cfg.vision)
    packed = collate_packed(rows, 8, row, pad_id=cfg.bos_token_id, vision_cfg=cfg.vision)
    assert packed["input_ids"].shape == (8, 192) and packed["loss_mask"].sum() == plain["loss_mask"].sum()
    assert set(np.unique(packed["segment_ids"][len(rows):])) == {0}
    oc = ml_collections.ConfigDict(dict(lr=1e-3, warmup_ratio=0.0, weight_decay=0.0, b1=0.9, b2=0.95, eps=1e-8,
                                        clip_norm=1.0, schedule="constant"))
    tx, sched = optim.make_optimizer(oc, 10)
    out = []
    for batch, mesh_shape, accum in ((plain, (1, 1, 1), 1), (packed, (1, 1, 1), 1), (packed, (2, 2, 1), 2)):
        mesh = shd.make_mesh(*mesh_shape, devices=jax.devices()[: int(np.prod(mesh_shape))])
        mdef, state, sh = st.create_train_state(cfg, tx, mesh, seed=3)
        fields = {k: v for k, v in batch.items() if k in sft.BATCH_FIELDS}
        bsh = sft.batch_shardings(fields, mesh)
        step = sft.make_train_step(mdef, tx, sched, sh, bsh, mesh, accum_steps=accum, compiler_options=FAST_COMPILE)
        state, m = step(state, {k: jax.device_put(v, bsh[k]) for k, v in fields.items()}, jax.random.key(0))
        out.append((float(m["loss"]), float(m["loss_tokens"]), jax.device_get(state.params)))
    (l0, n0, p0) = out[0]
    for l1, n1, p1 in out[1:]:
        assert n1 == n0
        np.testing.assert_allclose(l1, l0, rtol=1e-5)
        diff = max(float(np.abs(x - y).max()) for x, y in zip(jax.tree.leaves(p0), jax.tree.leaves(p1), strict=True))
        assert diff < 5e-5
    moved = max(float(np.abs(np.asarray(x) - np.asarray(y)).max())
                for x, y in zip(jax.tree.leaves(p0), jax.tree.leaves(jax.device_get(st.create_train_state(
                    cfg, tx, shd.make_mesh(1, 1, 1, devices=jax.devices()[:1]), seed=3)[1].params)), strict=True))
    assert moved > 1e-4  # the step did something (an update that did nothing would also match)


def _group_examples(cfg, rng, prompts=3, group=4):
    """GRPO-like trajectories: each group's members carry their prompt's image (the same pixels)
    and even members one observation image of their own, as rollouts with code cells do."""
    from model_helpers import build_row, random_patches

    from codedance_jax.model.rope import mrope_positions
    from codedance_jax.train.batching import Bucket, Example, num_windows

    out = []
    for p in range(prompts):
        prompt_px = random_patches(rng, cfg, [(1, 4, 4)])
        for m in range(group):
            grids = [(1, 4, 4)] + ([(1, 2, 4)] if m % 2 == 0 else [])
            pv = np.concatenate([prompt_px] + ([random_patches(rng, cfg, [(1, 2, 4)])] if m % 2 == 0 else []))
            text = [int(x) for x in rng.integers(3, 20, len(grids) + 1)]
            ids = np.asarray(build_row(rng, cfg, grids, text), np.int32)
            g = np.asarray(grids, np.int64)
            pos = mrope_positions(ids[None], None, g, image_token_id=cfg.image_token_id,
                                  spatial_merge_size=cfg.vision.spatial_merge_size)[0][:, 0]
            trained = (rng.random(len(ids)) < 0.6) & (ids != cfg.image_token_id)
            needs = Bucket(len(ids), int(sum(np.prod(x) for x in grids)) // 4, num_windows(g, cfg.vision))
            out.append(Example(ids, trained, pos, pv, g, needs, 0, f"p{p}m{m}"))
    return out


def test_shared_images_give_the_unshared_logprobs_and_update_on_any_mesh():
    """A GRPO batch whose group members share their prompt's image: encoded once
    (`packing.share_images`, placeholders mapped by `feat_src`), the log-probs equal the per-row
    layout's within 2e-5 and one update's parameters within 1e-5, on one device and with the rows
    split over two (the features then cross devices); micro-batches are refused."""
    from codedance_jax.train.batching import Bucket, collate

    cfg = tiny_small_vocab()
    rng = np.random.default_rng(11)
    exs = _group_examples(cfg, rng)
    bucket = Bucket(128, 16, 8)
    plain = collate(exs, bucket, pad_id=cfg.bos_token_id, vision_cfg=cfg.vision)
    plain.pop("num_tokens")
    lm = plain["loss_mask"] > 0
    plain["turn_ids"] = np.where(lm, rng.integers(0, 3, lm.shape), -1).astype(np.int32)
    plain["a_seq"] = rng.standard_normal(len(exs)).astype(np.float32)
    plain["a_turn"] = rng.standard_normal((len(exs), 3)).astype(np.float32)
    plain["old_logprobs"] = (-rng.random(lm.shape) * 8).astype(np.float32) * plain["loss_mask"]
    shared_fields = packing.share_images(exs, bucket, cfg.vision)
    assert shared_fields is not None
    shared = {**plain, **shared_fields}
    # 3 prompt images of 4 units + 6 observations of 2 units are encoded, not 12 x 4 + 6 x 2.
    assert int((shared["unit_src"] >= 0).sum()) == 3 * 4 + 6 * 2
    assert int((plain["unit_src"] >= 0).sum()) == 12 * 4 + 6 * 2
    assert shared["pixel_values"].shape[0] < plain["pixel_values"].shape[0]  # in fewer vision rows
    padded = rl_batch.pad_rows(shared, 14)  # as the loop pads rows to the mesh: the vision rows stay
    assert padded["feat_src"].shape[0] == 14 and padded["pixel_values"].shape == shared["pixel_values"].shape
    oc = ml_collections.ConfigDict(dict(lr=1e-3, warmup_ratio=0.0, weight_decay=0.0, b1=0.9, b2=0.95, eps=1e-8,
                                        clip_norm=0.0, schedule="constant"))
    tx, sched = optim.make_optimizer(oc, 10)
    out = []
    for batch, n_dev in ((plain, 1), (shared, 1), (padded, 2)):
        mesh = shd.make_mesh(n_dev, 1, 1, devices=jax.devices()[:n_dev])
        mdef, state, sh = st.create_train_state(cfg, tx, mesh, seed=3)
        bsh = sft.batch_shardings(batch, mesh)
        arrays = {k: jax.device_put(v, bsh[k]) for k, v in batch.items()}
        fields = {k: v for k, v in arrays.items() if k in sft.BATCH_FIELDS}
        lp = None
        if n_dev == 1:  # the 2-device run checks the update only (one compile less)
            lp_fn = grpo.make_logprob_fn(mdef, sh.params, {k: bsh[k] for k in fields}, mesh, compiler_options=FAST_COMPILE)
            lp = np.asarray(lp_fn(state.params, fields))
        step = grpo.make_grpo_step(mdef, tx, sched, GRPOLossConfig(), sh, bsh, mesh, compiler_options=FAST_COMPILE)
        state, m = step(state, arrays, jax.random.key(0))
        out.append((lp, float(m["loss"]), jax.device_get(state.params)))
    lp0, l0, p0 = out[0]
    mask = plain["attention_mask"] > 0
    assert out[2][0] is None
    np.testing.assert_allclose(out[1][0][mask], lp0[mask], atol=2e-5)
    for _, l1, p1 in out[1:]:
        np.testing.assert_allclose(l1, l0, rtol=1e-5)
        diff = max(float(np.abs(x - y).max()) for x, y in zip(jax.tree.leaves(p0), jax.tree.leaves(p1), strict=True))
        assert diff < 1e-5
    with pytest.raises(ValueError, match="share_images=False"):
        grpo.whole_batch_fields(shared, 2)
