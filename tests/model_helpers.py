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
    for g, n in zip(grids, text_lens[1:]):
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
