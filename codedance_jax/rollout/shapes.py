"""The rollout's shape plan: every device program a rollout can run, derived from the config alone.

A rollout call of B rows (prompts x group size, rounded up to `batch_multiple`) runs these programs
(`RolloutPlan.programs`), each at a shape taken from a short fixed list:

* **prefill** of the n prompts (rounded up to `batch_multiple`) at each prompt bucket, with and
  without images, into the first cache size, then copied to the B rows;
* **append** of an observation chunk at each observation bucket, with and without images, over a
  row bucket (`device_batch.row_bucket`: `batch_multiple` x a power of two, or B) at each cache size;
* **decode chunk** over each row bucket at each cache size;
* cache upkeep at each size: slot drops, compaction, growth from one size to a larger one.

Image features enter the model as one array per call, so a vision call has one shape per (kind,
rows): room for `rows` x the images a row may bring (`prompt_images` for prompts, `obs_max_images`
for observations), each as large as the pixel budget allows (`image_caps`: the largest unit and
window counts the processor's rounding can produce under `max_pixels`). A call whose images need
more (a prompt with more images than `prompt_images`) falls back to a power-of-two bucket: it runs,
but outside the plan, and the loops report it as an unplanned compilation.

`RolloutEngine.warm_up` runs every program of the plan once on dummy inputs, so the jit caches hold
them before the first real rollout, and nothing compiles afterwards.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np


@functools.lru_cache(maxsize=64)
def image_caps(max_pixels: int, *, patch: int = 14, merge: int = 2, window_merged: int = 4, snapped: bool = False,
               min_pixels: int = 56 * 56, processor_max_pixels: int | None = None) -> tuple[int, int]:
    """(units, windows): the most merged units and vision windows one image of at most `max_pixels`
    pixels can have after the processor's `smart_resize` (sides rounded to multiples of f = patch x
    merge, scaled up to `min_pixels`, down to `processor_max_pixels`).

    snapped: the image's sides already are multiples of f within the budget (observation images,
    `turns.fit_image`): a x b multiples with a b f^2 <= max_pixels. Otherwise (prompt images, as the
    data gives them) rounding to the nearest multiple can add half a multiple per side: the bound
    takes (a - 1/2)(b - 1/2) f^2 <= max_pixels. A prompt image outside that (a side scaled below one
    multiple and clamped) is encoded outside the plan, and reported."""
    from codedance_jax.processing.image import smart_resize

    f = patch * merge
    budget = max_pixels / (f * f)
    ceiling = processor_max_pixels or 1 << 62
    best_u = best_w = 1
    a = 1
    while (a if snapped else a - 0.5) <= budget:
        b = 1
        while a * b <= budget if snapped else (a - 0.5) * (b - 0.5) <= budget:
            if max(a, b) <= 200 * min(a, b):
                rh, rw = smart_resize(a * f, b * f, factor=f, min_pixels=min_pixels, max_pixels=ceiling)
                ua, ub = rh // f, rw // f
                best_u = max(best_u, ua * ub)
                best_w = max(best_w, -(-ua // window_merged) * -(-ub // window_merged))
            b += 1
        a += 1
    return best_u, best_w


@dataclasses.dataclass(frozen=True)
class RolloutPlan:
    """The finite set of shapes one rollout call (B rows, n prompts) may use. See the module docstring."""

    rows: int  # B
    prompt_rows: int  # n prompts rounded up to batch_multiple
    row_buckets: tuple[int, ...]  # row counts of appends and decode chunks (B last)
    cache_sizes: tuple[int, ...]  # ascending; the first is the prefill's
    prompt_buckets: tuple[int, ...]
    obs_buckets: tuple[int, ...]
    decode_chunk: int
    prompt_image: tuple[int, int]  # (units, windows) of one prompt image at most
    obs_image: tuple[int, int]  # of one observation image
    prompt_images: int  # images per prompt row in the plan
    obs_images: int  # images per observation row
    append_images: int = 0  # images per append call at most (0: rows x obs_images)

    def vision(self, kind: str, rows: int) -> tuple[int, int]:
        """(num_units, num_windows) of the planned vision call for `rows` rows of `kind` (prefill | append)."""
        (u, w), k = (self.prompt_image, self.prompt_images) if kind == "prefill" else (self.obs_image, self.obs_images)
        n = rows * k
        if kind != "prefill" and self.append_images:
            n = min(n, max(self.append_images, k))
        return n * u, n * w

    def growths(self) -> list[tuple[int, int]]:
        return [(a, b) for i, a in enumerate(self.cache_sizes) for b in self.cache_sizes[i + 1 :]]

    def programs(self) -> list[dict]:
        """One entry per program: {"program", "rows", "tokens", "cache", "vision_units"} (None where
        it does not apply). The count is what the warm-up compiles, up to small host-to-device ops."""
        out = []
        for c in self.prompt_buckets:
            for img in (False, True):
                out.append(dict(program="prefill", rows=self.prompt_rows, tokens=c, cache=self.cache_sizes[0],
                                vision_units=self.vision("prefill", self.prompt_rows)[0] if img else None))
        for s in self.cache_sizes:
            for r in self.row_buckets:
                out.append(dict(program="decode", rows=r, tokens=self.decode_chunk, cache=s, vision_units=None))
                for c in self.obs_buckets:
                    for img in (False, True):
                        out.append(dict(program="append", rows=r, tokens=c, cache=s,
                                        vision_units=self.vision("append", r)[0] if img else None))
            out.append(dict(program="compact", rows=self.rows, tokens=None, cache=s, vision_units=None))
        for a, b in self.growths():
            out.append(dict(program=f"grow {a}->{b}", rows=self.rows, tokens=None, cache=b, vision_units=None))
        return out


def grid_needs(grid_thw, vision_cfg) -> tuple[int, int]:
    """(units, windows) the images of `grid_thw` int[I, 3] fill in a vision call (unpadded)."""
    m, wm = vision_cfg.spatial_merge_size, vision_cfg.window_merged
    units = windows = 0
    for t, h, w in np.asarray(grid_thw).reshape(-1, 3).tolist():
        units += t * (h // m) * (w // m)
        windows += t * -(-(h // m) // wm) * -(-(w // m) // wm)
    return units, windows


def row_buckets(rows: int, multiple: int) -> tuple[int, ...]:
    out, nb = [], multiple
    while nb < rows:
        out.append(nb)
        nb *= 2
    return (*out, rows)


def cache_sizes(cfg) -> tuple[int, ...]:
    """The cache sizes a rollout can reach: `cache_slots`, or with `cache_grow` g the multiples of g
    up to it (the last one `cache_slots`)."""
    full, g = cfg.cache_slots, cfg.cache_grow
    if g <= 0 or g >= full:
        return (full,)
    return tuple(sorted({min(full, k * g) for k in range(1, -(-full // g) + 1)}))


def rollout_plan(cfg, model_cfg, *, rows: int, prompts: int, prompt_max_pixels: int, min_pixels: int = 56 * 56,
                 processor_max_pixels: int | None = None) -> RolloutPlan:
    """The plan of a rollout call of `rows` trajectories from `prompts` prompts under `RolloutConfig` cfg."""
    from codedance_jax.rollout.buckets import round_up

    m = cfg.batch_multiple
    b = round_up(rows, m)
    v = model_cfg.vision
    caps = functools.partial(image_caps, patch=v.patch_size, merge=v.spatial_merge_size, window_merged=v.window_merged,
                             min_pixels=min_pixels, processor_max_pixels=processor_max_pixels)
    return RolloutPlan(
        rows=b, prompt_rows=round_up(prompts, m), row_buckets=row_buckets(b, m), cache_sizes=cache_sizes(cfg),
        prompt_buckets=tuple(sorted(cfg.prompt_buckets)), obs_buckets=tuple(sorted(cfg.obs_buckets)),
        decode_chunk=cfg.decode_chunk, prompt_image=caps(int(prompt_max_pixels)),
        obs_image=caps(int(cfg.obs_max_pixels), snapped=True), prompt_images=int(cfg.prompt_images),
        obs_images=int(cfg.obs_max_images), append_images=int(cfg.append_images))
