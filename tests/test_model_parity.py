"""Our NNX Qwen2.5-VL against `transformers` in float32 on a tiny random model.

Parity measure: max |ours - ref| / max |ref| over the compared logits (non-padding positions),
required <= 1e-4. Observed on this machine: about 1e-6.
"""

import numpy as np
import pytest
from model_helpers import build_row, left_pad, random_patches, ref_logits, rel_err

TOL = 1e-4


def test_text_only(tiny_pair):
    ref, ours, cfg = tiny_pair
    rng = np.random.default_rng(11)
    ids = rng.integers(0, cfg.text.vocab_size, (2, 37))
    mask = np.ones_like(ids)
    assert rel_err(ours(ids, mask), ref_logits(ref, ids, mask)) <= TOL


def test_long_left_padded_rows_cross_the_causal_blocks(tiny_pair):
    """Rows longer than text.CAUSAL_BLOCK take the blocked causal attention (a partial last block);
    left padding puts rows that see no key inside the first blocks."""
    from codedance_jax.model import text

    ref, ours, cfg = tiny_pair
    rng = np.random.default_rng(15)
    lens = (2 * text.CAUSAL_BLOCK + 23, text.CAUSAL_BLOCK + 5, 17)
    ids, mask = left_pad([list(rng.integers(10, 5000, n)) for n in lens])
    assert ids.shape[1] > 2 * text.CAUSAL_BLOCK
    keep = mask.astype(bool)
    assert rel_err(np.asarray(ours(ids, mask))[keep], ref_logits(ref, ids, mask)[keep]) <= TOL


def test_one_image(tiny_pair):
    ref, ours, cfg = tiny_pair
    rng = np.random.default_rng(12)
    grids = [(1, 10, 14)]  # 5 x 7 merged units: partial windows at the right and bottom edges
    ids, mask = left_pad([build_row(rng, cfg, grids, [7, 9])])
    pv = random_patches(rng, cfg, grids)
    assert rel_err(ours(ids, mask, pv, np.array(grids)), ref_logits(ref, ids, mask, pv, grids)) <= TOL


def test_several_images_of_different_sizes_from_real_resizing(tiny_pair):
    """Three images of awkward sizes go through the reference image processor (which resizes)."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    ref, ours, cfg = tiny_pair
    rng = np.random.default_rng(13)
    proc = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 40)
    sizes = [(45, 67), (130, 31), (200, 220)]  # the last one exceeds max_pixels and shrinks
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
    enc = proc(images=images, return_tensors="np")
    grids = [tuple(g) for g in enc["image_grid_thw"]]
    assert len(set(grids)) == 3
    ids, mask = left_pad([build_row(rng, cfg, grids, [5, 3, 4, 6])])
    pv = enc["pixel_values"].astype(np.float32)
    ours_l = ours(ids, mask, pv, np.array(grids))
    assert rel_err(ours_l, ref_logits(ref, ids, mask, pv, grids)) <= TOL


def test_left_padded_batch_with_images(tiny_pair):
    """Rows with 2, 0 and 1 images and different lengths, left-padded like generation batches."""
    ref, ours, cfg = tiny_pair
    rng = np.random.default_rng(14)
    row_grids = [[(1, 4, 6), (1, 6, 4)], [], [(1, 8, 8)]]
    rows = [build_row(rng, cfg, g, [4] + [3] * len(g)) for g in row_grids]
    rows[1] = list(rng.integers(10, 5000, 9))
    ids, mask = left_pad(rows)
    grids = [g for gs in row_grids for g in gs]
    pv = random_patches(rng, cfg, grids)
    ours_l = np.asarray(ours(ids, mask, pv, np.array(grids)))
    ref_l = ref_logits(ref, ids, mask, pv, grids)
    keep = mask.astype(bool)
    assert rel_err(ours_l[keep], ref_l[keep]) <= TOL


def test_vision_tower_layer_parity(tiny_pair):
    """The merged image features (after undoing the window order) equal the reference's."""
    import torch

    from codedance_jax.model.qwen25vl import VisionInputs

    ref, ours, cfg = tiny_pair
    rng = np.random.default_rng(15)
    grids = [(1, 10, 14), (1, 4, 4), (1, 8, 6)]
    pv = random_patches(rng, cfg, grids)
    feats = np.asarray(ours.encode_images(VisionInputs.build(pv, np.array(grids), cfg)))[0]
    with torch.no_grad():
        want = ref.model.visual(torch.tensor(pv), grid_thw=torch.tensor(grids)).pooler_output.numpy()
    assert feats.shape == want.shape
    assert rel_err(feats, want) <= TOL


def test_vision_plan_is_padding_invariant(tiny_pair):
    """Padding the plan to a larger bucket (as rollouts do) must not change the real features."""
    from codedance_jax.model.qwen25vl import VisionInputs

    _, ours, cfg = tiny_pair
    rng = np.random.default_rng(16)
    grids = np.array([(1, 10, 14), (1, 4, 4)])
    pv = random_patches(rng, cfg, grids)
    a = np.asarray(ours.encode_images(VisionInputs.build(pv, grids, cfg)))[0]
    b = np.asarray(ours.encode_images(VisionInputs.build(pv, grids, cfg, num_windows=20, num_units=60)))[0]
    assert b.shape == (60, cfg.text.hidden_size)
    np.testing.assert_allclose(b[: len(a)], a, rtol=1e-5, atol=1e-6)


def test_per_example_image_groups_equal_flat_batch(tiny_pair):
    """Training batches carry images per example (G = B, padded); logits equal the flat call's."""
    import jax.numpy as jnp

    from codedance_jax.model.qwen25vl import VisionInputs
    from codedance_jax.model.rope import mrope_positions
    from codedance_jax.model.vision import make_plan

    _, ours, cfg = tiny_pair
    rng = np.random.default_rng(21)
    row_grids = [[(1, 4, 6), (1, 2, 2)], [], [(1, 6, 6)]]
    rows = [build_row(rng, cfg, g, [3] + [2] * len(g)) for g in row_grids]
    rows[1] = list(rng.integers(10, 5000, 8))
    ids, mask = left_pad(rows)
    flat_grids = np.array([g for gs in row_grids for g in gs])
    pv_rows = [random_patches(rng, cfg, g) if g else np.zeros((0, cfg.vision.patch_dim), np.float32) for g in row_grids]
    want = np.asarray(ours(ids, mask, np.concatenate(pv_rows), flat_grids))

    nb, wb = 12, 6
    plans = [make_plan(np.array(g).reshape(-1, 3), cfg.vision, num_windows=wb, num_units=nb) for g in row_grids]
    pv = np.zeros((3, nb * 4, cfg.vision.patch_dim), np.float32)
    for b, p in enumerate(pv_rows):
        pv[b, : len(p)] = p
    vis = VisionInputs(jnp.asarray(pv), *(jnp.asarray(np.stack([getattr(p, f) for p in plans]))
                                          for f in ("unit_src", "pos_hw", "image_id", "out_index")))
    pos = np.concatenate([mrope_positions(ids[b:b + 1], mask[b:b + 1], np.array(g).reshape(-1, 3) if g else None,
                                          image_token_id=cfg.image_token_id, spatial_merge_size=2)[0]
                          for b, g in enumerate(row_grids)], axis=1)
    got = np.asarray(ours.forward(jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(mask), vis))
    keep = mask.astype(bool)
    assert rel_err(got[keep], want[keep]) <= 1e-5


def test_decoder_layer_parity(tiny_pair):
    """One decoder layer with M-RoPE positions from the reference's own rotary module."""
    import torch

    from codedance_jax.model import rope, text

    ref, ours, cfg = tiny_pair
    rng = np.random.default_rng(17)
    b, t, d = 2, 13, cfg.text.hidden_size
    x = rng.standard_normal((b, t, d)).astype(np.float32)
    pos = np.stack([np.arange(t), np.arange(t) // 2, np.arange(t) % 5])[:, None].repeat(b, 1) + 3
    ref_layer = ref.model.language_model.layers[1]
    with torch.no_grad():
        cos_sin = ref.model.language_model.rotary_emb(torch.tensor(x), torch.tensor(pos))
        causal = torch.full((t, t), float("-inf")).triu(1)[None, None]
        want = ref_layer(torch.tensor(x), attention_mask=causal, position_embeddings=cos_sin)
        want = (want[0] if isinstance(want, tuple) else want).numpy()
    cos, sin = rope.mrope_cos_sin(pos, cfg.text.head_dim, cfg.text.rope_theta, cfg.text.mrope_section)
    np.testing.assert_allclose(np.asarray(cos), cos_sin[0].numpy(), atol=1e-6)
    got, _ = ours.layers[1](x, cos, sin, text.causal_mask(np.ones((b, t))))
    assert rel_err(got, want) <= TOL


def test_mrope_positions_match_get_rope_index(tiny_pair):
    """Multi-image rows with left padding: positions equal the reference's get_rope_index."""
    import torch

    from codedance_jax.model.rope import mrope_positions

    ref, _, cfg = tiny_pair
    rng = np.random.default_rng(18)
    row_grids = [[(1, 4, 6), (1, 6, 4), (1, 2, 2)], [(1, 8, 8)], []]
    rows = [build_row(rng, cfg, g, [3] + [2] * len(g)) for g in row_grids]
    rows[2] = list(rng.integers(10, 5000, 6))
    ids, mask = left_pad(rows)
    grids = np.array([g for gs in row_grids for g in gs])
    pos, next_pos = mrope_positions(ids, mask, grids, image_token_id=cfg.image_token_id, spatial_merge_size=2)
    want, deltas = ref.model.get_rope_index(
        torch.tensor(ids), mm_token_type_ids=torch.tensor((ids == cfg.image_token_id).astype(np.int64)),
        image_grid_thw=torch.tensor(grids), attention_mask=torch.tensor(mask))
    np.testing.assert_array_equal(pos, want.numpy())
    np.testing.assert_array_equal(next_pos, deltas.numpy()[:, 0] + mask.sum(1))


def test_bfloat16_stays_close_to_float32(tiny_pair):
    """bf16 params and compute vs f32, same weights: measured about 1-2e-2 relative; bound 5e-2."""
    import jax.numpy as jnp
    from flax import nnx

    from codedance_jax.model.qwen25vl import Qwen25VL

    _, ours, cfg = tiny_pair
    bcfg = cfg.replace(dtype="bfloat16", param_dtype="bfloat16")
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Qwen25VL(bcfg, rngs=nnx.Rngs(0))))
    src = dict(nnx.to_flat_state(nnx.state(ours, nnx.Param)))
    for path, var in nnx.to_flat_state(state):
        var.set_value(src[path].get_value().astype(jnp.bfloat16))
    bf = nnx.merge(graphdef, state)
    rng = np.random.default_rng(19)
    grids = [(1, 8, 8)]
    ids, mask = left_pad([build_row(rng, cfg, grids, [6, 8])])
    pv = random_patches(rng, cfg, grids)
    a = np.asarray(ours(ids, mask, pv, np.array(grids)))
    b = np.asarray(bf(ids, mask, pv, np.array(grids))).astype(np.float32)
    err = rel_err(b, a)
    assert 0 < err <= 5e-2, err


def test_placeholder_mismatch_is_a_clear_error(tiny_pair):
    _, ours, cfg = tiny_pair
    rng = np.random.default_rng(20)
    grids = [(1, 4, 6)]
    ids, mask = left_pad([build_row(rng, cfg, grids, [3, 3])])
    ids = ids[:, 1:]  # drop one token... then drop one placeholder as well
    ids = np.concatenate([ids[:, :4], ids[:, 5:]], axis=1)
    pv = random_patches(rng, cfg, grids)
    with pytest.raises(ValueError, match=r"hold 5 image placeholder.*gives 6 image features"):
        ours(ids, np.ones_like(ids), pv, np.array(grids))
