"""Inputs and reference calls shared by the model tests."""

import numpy as np


def rel_err(ours, ref) -> float:
    """max |ours - ref| / max |ref|: the parity measure used throughout the tests."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def build_row(rng, cfg, grids, text_lens):
    """Token ids with one <|vision_start|><|image_pad|>*n<|vision_end|> block per grid.

    text_lens has len(grids) + 1 entries: random text before, between and after the images.
    """
    row = list(rng.integers(10, 5000, text_lens[0]))
    for g, n in zip(grids, text_lens[1:], strict=True):
        row += [cfg.vision_start_token_id] + [cfg.image_token_id] * (int(np.prod(g)) // 4) + [cfg.vision_end_token_id]
        row += list(rng.integers(10, 5000, n))
    return row


def random_patches(rng, cfg, grids):
    return np.concatenate([rng.standard_normal((int(np.prod(g)), cfg.vision.patch_dim)).astype(np.float32) for g in grids])


def left_pad(rows, pad_id=151643):
    t = max(len(r) for r in rows)
    ids = np.full((len(rows), t), pad_id, np.int64)
    mask = np.zeros((len(rows), t), np.int64)
    for i, r in enumerate(rows):
        ids[i, t - len(r):] = r
        mask[i, t - len(r):] = 1
    return ids, mask


def ref_logits(ref, ids, mask, pv=None, grids=None, image_token_id=151655):
    import torch

    kw = dict(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask))
    if pv is not None:
        kw.update(pixel_values=torch.tensor(pv), image_grid_thw=torch.tensor(np.asarray(grids)),
                  mm_token_type_ids=torch.tensor((np.asarray(ids) == image_token_id).astype(np.int64)))
    with torch.no_grad():
        return ref(**kw).logits.numpy()


def train_batch(rng, cfg, batch: int, seq: int, row_grids, n_units: int = 8, n_windows: int = 4):
    """A synthetic SFT batch in the data pipeline's contract (per-example images, right padding)."""
    from codedance_jax.model.rope import mrope_positions
    from codedance_jax.model.vision import make_plan

    q = cfg.vision.merge_unit
    ids = np.full((batch, seq), cfg.bos_token_id, np.int32)  # pad (151643 in the Qwen presets)
    mask = np.zeros((batch, seq), np.int32)
    pv = np.zeros((batch, n_units * q, cfg.vision.patch_dim), np.float32)
    plans = []
    positions = np.zeros((3, batch, seq), np.int32)
    for b in range(batch):
        grids = row_grids[b % len(row_grids)]
        n_text = int(rng.integers(seq // 2, seq - 4 * len(grids) - sum(int(np.prod(g)) // q for g in grids)))
        row = build_row(rng, cfg, grids, [n_text - 3 * len(grids)] + [3] * len(grids))[:seq]
        ids[b, : len(row)] = row
        mask[b, : len(row)] = 1
        g = np.array(grids).reshape(-1, 3) if grids else None
        if grids:
            p = random_patches(rng, cfg, grids)
            pv[b, : len(p)] = p
        plans.append(make_plan(np.zeros((0, 3)) if g is None else g, cfg.vision, num_windows=n_windows, num_units=n_units))
        positions[:, b : b + 1] = mrope_positions(ids[b : b + 1], mask[b : b + 1], g, image_token_id=cfg.image_token_id,
                                                  spatial_merge_size=cfg.vision.spatial_merge_size)[0]
    targets = np.concatenate([ids[:, 1:], np.full((batch, 1), cfg.bos_token_id, np.int32)], axis=1)
    loss_mask = (mask * np.concatenate([mask[:, 1:], np.zeros((batch, 1), np.int32)], axis=1)).astype(np.float32)
    loss_mask *= (rng.random((batch, seq)) < 0.6) & (targets != cfg.image_token_id)
    out = dict(input_ids=ids, attention_mask=mask, targets=targets, loss_mask=loss_mask, positions=positions, pixel_values=pv)
    for f in ("unit_src", "pos_hw", "image_id", "out_index"):
        out[f] = np.stack([getattr(p, f) for p in plans])
    return out


# XLA options for the train-step tests' compiles (`compiler_options=` of the step builders): LLVM -O0
# for XLA's CPU kernels. Their steps compile for seconds and run for milliseconds: a tiny SFT step's
# compile took 11.7 s at XLA's default and 6.6 s at -O0 (17.4 / 9.1 s on a (2,2,2) mesh). Every
# program of a comparison gets the same options, so invariance tolerances compare like with like.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def tiny_small_vocab(vocab: int = 32768, vision_depth: int = 2):
    """`ModelConfig.tiny()` with a 32k vocabulary, its special tokens at Qwen's offsets from the end,
    and a vision tower of `vision_depth` blocks, the last one full attention (tiny's has 4).

    For the train-step tests: tiny's 152k x 64 embedding and head are 98% of its weights and most
    of a step's time, and the steps' properties (mesh/micro-batch invariance, learning) do not
    depend on the vocabulary size. ln(32768) = 10.4, so a fresh model's loss still starts above 10.
    Two vision blocks keep both kinds (windowed, full attention) and cut a step's compile by ~20%
    (an accumulated (2,1,1) SFT run: 24.4 s -> 19.1 s, one after the other on a quiet machine).
    """
    import dataclasses

    from codedance_jax.model import ModelConfig

    base = ModelConfig.tiny()
    shift = vocab - base.text.vocab_size
    ids = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id", "bos_token_id", "eos_token_id")
    vision = dataclasses.replace(base.vision, depth=vision_depth, fullatt_block_indexes=(vision_depth - 1,))
    return base.replace(vision=vision, text=dataclasses.replace(base.text, vocab_size=vocab), **{k: getattr(base, k) + shift for k in ids})
