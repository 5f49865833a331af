"""One SFT trajectory -> an `Example`: decode images, render, tokenize once, M-RoPE positions, bucket.

The example and the buckets are the train steps' (`codedance_jax.train.batching`); what is data
here is the trajectory and its rendering (`data.chat`).
"""

from __future__ import annotations

import io
from collections.abc import Sequence

from PIL import Image

from codedance_jax.model.config import ModelConfig
from codedance_jax.model.rope import mrope_positions
from codedance_jax.protocol import CODE, TurnFormat
from codedance_jax.train.batching import Bucket, Example, choose_bucket, num_windows
from data import chat
from data.trajectory import Trajectory


def featurize(
    traj: Trajectory,
    processor,
    model_cfg: ModelConfig,
    buckets: Sequence[Bucket],
    fmt: str | TurnFormat = CODE,
) -> Example:
    """Decode images (PIL), render, tokenize once, and compute M-RoPE positions and the bucket."""
    images = [Image.open(io.BytesIO(b)) for b in traj.images]
    pixel_values, grid = processor.encode_images(images)  # [P, patch_dim], [I, 3]
    image_tokens = [int(n) for n in processor.num_image_tokens(grid)] if len(grid) else []
    rendered = chat.render(traj.messages, image_tokens, fmt)
    ids, trained = chat.tokenize(processor.tokenizer, rendered)
    got = int((ids == model_cfg.image_token_id).sum())
    if got != sum(image_tokens):  # cannot happen for validated records; guards tokenizer surprises
        raise ValueError(f"{traj.source}: {got} image tokens after tokenization, {sum(image_tokens)} expected")
    pos, _ = mrope_positions(
        ids[None],
        None,
        grid if len(grid) else None,
        image_token_id=model_cfg.image_token_id,
        spatial_merge_size=model_cfg.vision.spatial_merge_size,
    )
    needs = Bucket(len(ids), sum(image_tokens), num_windows(grid, model_cfg.vision))
    return Example(ids, trained, pos[:, 0], pixel_values, grid, needs, choose_bucket(needs, buckets), traj.source)
