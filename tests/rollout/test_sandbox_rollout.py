"""End to end with the real sandbox (needs Linux and root): code that crops the prompt image and
shows it, a variable kept across turns, an error; the image comes back into the trajectory."""

import os
import sys

import numpy as np
import pytest
from rollout_helpers import full_logprobs, random_image, small_config

from codedance_jax.rollout import RolloutEngine, SamplingConfig, rl_prompt


@pytest.fixture(scope="module")
def pool():
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("the sandbox needs Linux and root")
    from sandbox import SandboxPool

    with SandboxPool(num_workers=2, timeout_s=5.0, memory_mb=512) as p:
        yield p


CROP = (
    "<code>\n```python\nfrom PIL import Image\nim = Image.open('image.png')\nw, h = im.size\n"
    "im.crop((0, 0, 56, 56)).show()\nprint(w, h)\n```\n</code>"
)
USE = "<code>\n```python\nprint(w * h)\n```\n</code>"
FAIL = "<code>\n```python\n1 / 0\n```\n</code>"


def test_real_sandbox_turns(pool, model, processor):
    engine = RolloutEngine(model, processor, small_config(max_turn_tokens=64), SamplingConfig(greedy=True))
    prompts = [rl_prompt(processor, f"s{i}", "How wide?", [random_image(40 + i)]) for i in range(2)]
    scripts = {(0, 0): CROP, (0, 1): USE, (0, 2): "<answer>84</answer>", (1, 0): FAIL, (1, 1): "<answer>0</answer>"}
    trajs, stats = engine.rollout(prompts, 1, pool, script=lambda r, m: scripts.get((r, m)))
    t0, t1 = trajs
    assert t0.turn_status == ["ok", "ok", "no_code"] and t0.answer == "84"
    assert t0.turns[0]["observation"] == "84 56" and t0.turns[1]["observation"] == str(84 * 56)
    assert t0.image_grid_thw == [[1, 4, 6], [1, 4, 4]]  # the crop came back as an image
    # The traceback is cut to fit the 64-token observation bucket, with a visible marker.
    obs = t1.turns[0]["observation"]
    assert t1.turn_status == ["error", "no_code"] and obs.startswith("Traceback") and obs.endswith("[status: error]")
    assert "characters truncated" in obs
    assert stats.executions == 3 and stats.compiles >= 0
    ref = full_logprobs(model, processor, trajs)
    for t, lp in zip(trajs, ref, strict=True):
        m = np.asarray(t.loss_mask, bool)
        np.testing.assert_allclose(np.asarray(t.logprobs)[m], lp[m], atol=2e-4)
