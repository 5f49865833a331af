"""Configs, inputs and reference computations shared by the rollout tests."""

import numpy as np
from PIL import Image

from codedance_jax.rollout import RolloutConfig


def small_config(**kw) -> RolloutConfig:
    """Buckets shared by every rollout test: batch 8, prompt chunk 256, observation chunk 64, cache 512."""
    base = dict(
        max_turns=3,
        max_turn_tokens=40,
        max_new_tokens=120,
        max_total_tokens=448,
        decode_chunk=8,
        batch_multiple=8,
        prompt_buckets=(256,),
        obs_buckets=(64,),
        vision_min_units=16,
        obs_max_pixels=28 * 28 * 16,
        cache_len=512,
    )
    base.update(kw)
    return RolloutConfig(**base)


def random_image(seed, w=84, h=56):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


def full_logprobs(model, processor, trajs, temperature=1.0, length=448, replace_images=None):
    """log_softmax(logits / T) of each token given its prefix, from ONE full forward over the final
    token sequences (right-padded to `length`) and their images, computed as the trainer does
    (`train.logprobs.token_logprobs`). Returns a list of float[T] (entry 0 is 0).
    `replace_images`: {(row, k): image} swaps image k of a row (a control)."""
    import jax.numpy as jnp

    ids = np.full((len(trajs), length), 151643, np.int64)
    mask = np.zeros_like(ids)
    images = []
    for r, t in enumerate(trajs):
        ids[r, : len(t.tokens)] = t.tokens
        mask[r, : len(t.tokens)] = 1
        for k, im in enumerate(t.images):
            images.append((replace_images or {}).get((r, k), im))
    pv, grid = processor.encode_images(images) if images else (None, None)
    p = model.prepare(ids, mask, pv, grid)
    targets = jnp.asarray(np.concatenate([ids[:, 1:], ids[:, :1]], axis=1), jnp.int32)
    lp = np.asarray(
        _recompute(model, p["input_ids"], p["positions"], p["attention_mask"], p["vis"], targets, temperature)
    )
    out = []
    for r, t in enumerate(trajs):
        row = np.zeros(len(t.tokens))
        row[1:] = lp[r, : len(t.tokens) - 1]
        out.append(row)
    return out


def _recompute_impl(model, ids, positions, mask, vis, targets, temperature):
    from codedance_jax.train.logprobs import output_weight, token_logprobs

    h = model.forward(ids, positions, mask, vis, return_hidden=True)
    return token_logprobs(h, output_weight(model), targets, temperature=temperature, chunk=64)


def _recompute(*args):
    from flax import nnx

    global _RECOMPUTE
    if "_RECOMPUTE" not in globals():
        _RECOMPUTE = nnx.jit(_recompute_impl)
    return _RECOMPUTE(*args)
