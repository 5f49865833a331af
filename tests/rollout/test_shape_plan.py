"""The rollout's shape plan (`rollout/shapes.py`): derived from the config, compiled by `warm_up`,
and after it no rollout compiles anything, whatever the content (images of other sizes, fewer
prompts, cache growth and compaction, tokens rolled back past a stop string)."""

import io

import numpy as np
from fakes import FakePool
from PIL import Image
from rollout_helpers import small_config
from test_engine import ANSWER, CODE_IMG, make_prompts

from codedance_jax.model.config import VisionConfig
from codedance_jax.processing.image import smart_resize
from codedance_jax.rollout import RolloutEngine, SamplingConfig
from codedance_jax.rollout.shapes import cache_sizes, grid_needs, image_caps, row_buckets
from codedance_jax.rollout.turns import fit_image


def _png(w, h):
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (10, 200, 30)).save(buf, "PNG")
    return buf.getvalue()


def test_image_caps_bound_observation_images_exactly():
    """Any captured image, after `fit_image` and the processor's resize, fits the caps for its budget,
    and some image reaches them (they are the maximum, not a loose bound)."""
    vcfg = VisionConfig()  # windows of 4 x 4 merged units
    rng = np.random.default_rng()
    for budget in (28 * 28 * 16, 112 * 112, 100 * 90):
        units, windows = image_caps(budget, window_merged=vcfg.window_merged, snapped=True)
        sizes = [(int(w), int(h)) for w, h in rng.integers(1, 4 * int(budget**0.5), (150, 2))]
        sizes += [(1, 3000), (3000, 1), (28, 28 * 16), (10, 10), (int(budget**0.5),) * 2, (113, 111)]
        seen_u = seen_w = 0
        for w, h in sizes:
            im = fit_image(_png(w, h), budget)
            assert im.size[0] * im.size[1] <= budget or im.size == (28, 28)
            rh, rw = smart_resize(im.size[1], im.size[0])
            u, win = grid_needs(np.array([[1, rh // 14, rw // 14]]), vcfg)
            assert u <= units and win <= windows, (budget, w, h, im.size)
            seen_u, seen_w = max(seen_u, u), max(seen_w, win)
        # the square of the budget reaches the unit cap; the caps' own witness the window cap
        assert seen_u == units, (budget, seen_u, units)


def test_image_caps_bound_rounded_prompt_images():
    """Unsnapped images (prompts) under the budget: every moderate aspect ratio fits the caps."""
    vcfg = VisionConfig()
    rng = np.random.default_rng()
    budget = 168 * 168
    units, windows = image_caps(budget, window_merged=vcfg.window_merged)
    for w, h in rng.integers(28, 3 * 168, (2000, 2)):
        if w * h > budget:
            continue
        rh, rw = smart_resize(int(h), int(w), max_pixels=budget)
        u, win = grid_needs(np.array([[1, rh // 14, rw // 14]]), vcfg)
        assert u <= units and win <= windows, (w, h)


def test_plan_lists_follow_the_config():
    cfg = small_config(cache_len=None, cache_grow=256, max_total_tokens=600, obs_buckets=(64, 128), decode_chunk=8)
    assert cache_sizes(cfg) == (256, 512, 728)  # 600 + the larger of chunk and obs bucket
    assert row_buckets(64, 8) == (8, 16, 32, 64) and row_buckets(24, 8) == (8, 16, 24) and row_buckets(8, 8) == (8,)


def test_no_compilation_after_warm_up(model, processor):
    """A cache that grows (two sizes) and compacts, two observation buckets, images in prompts and
    observations, a smaller last batch: all inside the plan the warm-up compiled."""
    cfg = small_config(cache_len=None, cache_grow=256, max_total_tokens=300, obs_buckets=(32, 64), max_turns=3,
                       max_turn_tokens=40, max_new_tokens=100)
    engine = RolloutEngine(model, processor, cfg, SamplingConfig(temperature=1.0, seed=3))
    warm = engine.warm_up(prompts=6, group_size=2)
    assert warm["compilations"] > 0 and warm["programs"] == len(engine.plan.programs())
    pool = FakePool()

    def script_a(r, m):
        return [CODE_IMG, None, '<code>\n```python\nprint("x" * 30)\n```\n</code>'][r % 3] if m < 2 else ANSWER

    def script_b(r, m):  # an image of another size, sampled turns (no script) past the turn budget
        return ['<code>\n```python\nshow(84, 56)\n```\n</code>', None][r % 2] if m == 0 else None

    _, s1 = engine.rollout(make_prompts(processor, 6, seed=11), 2, pool, script=script_a)
    trajs, s2 = engine.rollout(make_prompts(processor, 3, seed=12), 2, pool, script=script_b)
    assert s1.compiles == 0 and s2.compiles == 0, (s1.compiles, s2.compiles)
    assert s1.cache_growths + s2.cache_growths > 0 and any(t.images[1:] for t in trajs)


def test_append_images_caps_the_vision_call_and_rows_wait(model, processor):
    """append_images=1: four rows whose cells each return an image at once are appended one image
    per call (the others wait), inside the plan, and the cache still holds exactly the tokens (the
    recorded log-probs equal one full forward's)."""
    from test_engine import assert_logprobs_match

    cfg = small_config(append_images=1, obs_max_images=1, overlap=False)
    engine = RolloutEngine(model, processor, cfg, SamplingConfig(greedy=True))
    engine.warm_up(prompts=4)
    assert engine.plan.vision("append", 8) == engine.plan.vision("append", 1)  # one image's room
    trajs, stats = engine.rollout(make_prompts(processor, 4, seed=13), 1, FakePool(),
                                  script=lambda r, m: CODE_IMG if m == 0 else ANSWER)
    assert stats.compiles == 0 and stats.appends == 4 and all(len(t.images) == 2 for t in trajs)
    assert_logprobs_match(model, processor, trajs)
