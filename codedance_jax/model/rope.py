"""Rotary embeddings: M-RoPE positions for the decoder and the 2D rotary table of the vision tower.

Positions are computed on the host in numpy (they depend on `image_grid_thw`, which is host data)
and enter jitted code as int32 arrays, so a trajectory can be extended chunk by chunk:
`mrope_positions(..., start=next_pos)` on a new chunk gives exactly the positions that
`transformers`' `get_rope_index` gives to those tokens on the whole sequence. Its decode path,
which adds a fixed `rope_deltas` from prefill, would be wrong for images arriving mid-trajectory.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def mrope_positions(
    input_ids: np.ndarray,
    attention_mask: np.ndarray | None,
    image_grid_thw: np.ndarray | None,
    *,
    image_token_id: int,
    spatial_merge_size: int,
    start: np.ndarray | int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """The `get_rope_index` equivalent, for any number of images per row and left/right padding.

    Args:
      input_ids: int[B, T]. A run of consecutive image tokens is one image; images are consumed
        from `image_grid_thw` in row-major order over the batch (the order of `pixel_values`).
      attention_mask: {0,1}[B, T] or None; masked tokens get position 0 and do not advance.
      image_grid_thw: int[I, 3] (t, h, w in patches) for the images in these rows, or None.
      start: int or int[B], the first position of each row (the cache's `next_pos` for a chunk
        appended to a running trajectory).

    Returns:
      positions int32[3, B, T] (temporal, height, width) and next_pos int32[B]: one past the
      largest position of each row, where the next token's position starts.
    """
    ids = np.asarray(input_ids)
    b, t = ids.shape
    mask = np.ones((b, t), bool) if attention_mask is None else np.asarray(attention_mask).astype(bool)
    grids = [] if image_grid_thw is None else [tuple(int(x) for x in g) for g in np.asarray(image_grid_thw)]
    starts = np.broadcast_to(np.asarray(start, np.int64), (b,))
    pos = np.zeros((3, b, t), np.int64)
    next_pos = np.zeros((b,), np.int64)
    gi = 0
    m = spatial_merge_size
    for row in range(b):
        cols = np.nonzero(mask[row])[0]
        is_img = ids[row, cols] == image_token_id
        cur = int(starts[row])
        i = 0
        n = len(cols)
        while i < n:
            j = i
            while j < n and is_img[j] == is_img[i]:
                j += 1
            if not is_img[i]:
                pos[:, row, cols[i:j]] = cur + np.arange(j - i)
                cur += j - i
                i = j
                continue
            # A run of image tokens may hold several images back to back; consume grids until the
            # run is covered, exactly as the reference iterates one grid per placeholder run.
            while i < j:
                if gi >= len(grids):
                    raise ValueError(
                        f"row {row}: more image placeholder runs than images in image_grid_thw "
                        f"({len(grids)} given)"
                    )
                gt, gh, gw = grids[gi]
                gi += 1
                lh, lw = gh // m, gw // m
                size = gt * lh * lw
                if i + size > j:
                    raise ValueError(
                        f"row {row}: image {gi - 1} with grid {(gt, gh, gw)} needs {size} placeholder "
                        f"tokens but the run holds {j - i}"
                    )
                tt, hh, ww = np.meshgrid(np.arange(gt), np.arange(lh), np.arange(lw), indexing="ij")
                sel = cols[i : i + size]
                pos[0, row, sel] = tt.reshape(-1) + cur
                pos[1, row, sel] = hh.reshape(-1) + cur
                pos[2, row, sel] = ww.reshape(-1) + cur
                cur += max(gh, gw) // m
                i += size
        next_pos[row] = cur
    if gi != len(grids):
        raise ValueError(f"image_grid_thw has {len(grids)} images but the tokens hold {gi} placeholder runs")
    return pos.astype(np.int32), next_pos.astype(np.int32)


def inv_freq(head_dim: int, theta: float) -> jnp.ndarray:
    """float32[head_dim // 2]; computed like the reference (float32 arange / dim, then power)."""
    exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    return jnp.asarray(1.0 / (np.float32(theta) ** exponent), jnp.float32)


def mrope_cos_sin(positions_3bt: jnp.ndarray, head_dim: int, theta: float, section: tuple[int, ...]):
    """cos, sin float32[B, T, H] for M-RoPE: frequency band i of the half-dim reads axis i % 3."""
    freq = inv_freq(head_dim, theta)  # [H/2]
    angles = positions_3bt.astype(jnp.float32)[..., None] * freq  # [3, B, T, H/2]
    # Select, per frequency index, which of the three position axes drives it.
    axis_of = np.concatenate([np.full(s, i % 3) for i, s in enumerate(section)])  # [H/2]
    onehot = jnp.asarray(np.eye(3, dtype=np.float32)[axis_of].T)  # [3, H/2]
    angles = jnp.einsum("abtf,af->btf", angles, onehot)  # exact: one nonzero term per output
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def vision_cos_sin(pos_hw_p2: jnp.ndarray, head_dim: int, theta: float):
    """cos, sin float32[P, Hv] for the vision tower's axial 2D rope (h band, then w band, twice)."""
    freq = inv_freq(head_dim // 2, theta)  # [Hv/4]
    ang = pos_hw_p2.astype(jnp.float32)[..., None] * freq  # [P, 2, Hv/4]
    ang = ang.reshape(ang.shape[0], -1)  # [P, Hv/2]: h freqs then w freqs
    ang = jnp.concatenate([ang, ang], axis=-1)
    return jnp.cos(ang), jnp.sin(ang)


def rotate_half(x):
    h = x.shape[-1] // 2
    return jnp.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def apply_rope(x, cos, sin):
    """x: [..., T, N, H]; cos/sin broadcastable [..., T, 1, H]. Rotation in float32."""
    xf = x.astype(jnp.float32)
    return (xf * cos + rotate_half(xf) * sin).astype(x.dtype)
