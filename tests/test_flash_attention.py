"""The TPU flash-attention path (`model.flash`, `ModelConfig.attention="flash"`) against the XLA path.

The Pallas TPU kernel runs here in its interpreter (`pltpu.force_tpu_interpret_mode`), so the
segment-id masks, the grouped-query head order and the backward are checked on CPU: the model's
hidden states and parameter gradients at every real token must equal the dense-mask path's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.pallas import tpu as pltpu

from codedance_jax import sharding as shd
from codedance_jax.model import flash, text
from codedance_jax.model.config import ModelConfig, TextConfig, VisionConfig
from codedance_jax.model.qwen25vl import Qwen25VL


def _kernel_context():
    """The kernel serves calls traced under compute_sharding (the train steps'), here on one device."""
    return shd.compute_sharding(shd.make_mesh(1, 1, 1, devices=jax.devices()[:1]))


def test_resolve_and_bad_names():
    assert flash.resolve("auto", platform="tpu") == "flash"
    assert flash.resolve("auto", platform="cpu") == "xla"
    assert flash.resolve("xla", platform="tpu") == "xla"
    with pytest.raises(ValueError, match="attention='pallas'.*xla"):
        flash.resolve("pallas")


@pytest.mark.parametrize("packed", [False, True])
def test_text_attention_kernel_equals_dense_masks_in_values_and_gradients(packed):
    """GQA (2 query heads per KV head), left padding or packed segments, 128 tokens."""
    cfg = TextConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, mrope_section=(2, 3, 3))
    attn = text.Attention(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(7)
    params = nnx.state(attn, nnx.Param)  # non-zero biases too
    nnx.update(attn, jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape) * 0.3, jnp.float32), params))
    b, t = 2, 128
    x = jnp.asarray(rng.normal(size=(b, t, 64)), jnp.float32)
    ang = jnp.asarray(rng.uniform(0, 6, size=(b, t, 8)), jnp.float32)
    cos, sin = jnp.cos(jnp.concatenate([ang, ang], -1)), jnp.sin(jnp.concatenate([ang, ang], -1))
    if packed:
        seg = np.full((b, t), -1, np.int32)
        seg[0, :50], seg[0, 50:110], seg[1, :128] = 0, 1, 2
        make = lambda fa: text.packed_segments(jnp.asarray(seg), fa)  # noqa: E731
        real = seg >= 0
    else:
        mask = np.ones((b, t), np.int32)
        mask[1, :37] = 0  # left padding
        make = lambda fa: text.causal_segments(jnp.asarray(mask), fa)  # noqa: E731
        real = mask.astype(bool)
    assert not isinstance(make(True), flash.Segments)  # no compute_sharding: XLA (a Mosaic call cannot be partitioned)
    with _kernel_context():
        kern = make(True)
    dense = make(False)
    assert isinstance(kern, flash.Segments) and not isinstance(dense, flash.Segments)
    ct = jnp.asarray(rng.normal(size=(b, t, 64)), jnp.float32) * jnp.asarray(real)[..., None]

    @nnx.jit  # jitted: the kernel's interpreter, dispatched op by op, hung once in a full suite run
    def run(a, m):
        def loss(a):
            out, _ = a(x, cos, sin, m)
            return jnp.sum(out * ct), out

        (_, out), g = nnx.value_and_grad(loss, has_aux=True)(a)
        return out, g

    with pltpu.force_tpu_interpret_mode(), _kernel_context():
        out_k, g_k = run(attn, kern)
    out_d, g_d = run(attn, dense)
    np.testing.assert_allclose(np.asarray(out_k)[real], np.asarray(out_d)[real], rtol=2e-4, atol=2e-5)
    for a, r in zip(jax.tree.leaves(g_k), jax.tree.leaves(g_d), strict=True):
        np.testing.assert_allclose(a, r, rtol=2e-4, atol=2e-4 * float(jnp.abs(r).max()))
    assert float(jnp.abs(jax.tree.leaves(g_d)[0]).max()) > 1e-3


def test_model_forward_and_vision_tower_with_the_kernel_equal_xla():
    """The whole model (text and the vision tower's full-attention block over 128+ patches)."""
    base = ModelConfig(vision=VisionConfig(depth=2, hidden_size=32, intermediate_size=48, num_heads=2,
                                           out_hidden_size=64, fullatt_block_indexes=(1,), window_size=56),
                       text=TextConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, mrope_section=(2, 3, 3)),
                       image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253,
                       bos_token_id=254, eos_token_id=255)
    rng = np.random.default_rng(11)
    grids = [(1, 16, 16)]  # 256 patches: the full-attention block takes the kernel
    n_img = 16 * 16 // 4
    row = [252] + [250] * n_img + [253] + list(rng.integers(0, 240, 128 - n_img - 2))
    ids = np.asarray([row, [254] * 20 + list(rng.integers(0, 240, 108))], np.int32)
    mask = np.ones_like(ids)
    mask[1, :20] = 0
    pv = rng.standard_normal((256, base.vision.patch_dim)).astype(np.float32)
    forward = nnx.jit(lambda m, ids, pos, mask, vis: m.forward(ids, pos, mask, vis))
    outs = {}
    for impl in ("xla", "flash"):
        model = Qwen25VL(base.replace(attention=impl), rngs=nnx.Rngs(3))
        p = model.prepare(ids[:1], mask[:1], pv, np.asarray(grids))
        p2 = model.prepare(ids[1:], mask[1:])
        with pltpu.force_tpu_interpret_mode(), _kernel_context():
            outs[impl] = (np.asarray(forward(model, p["input_ids"], p["positions"], p["attention_mask"], p["vis"])),
                          np.asarray(forward(model, p2["input_ids"], p2["positions"], p2["attention_mask"], None)))
    for a, r, m in zip(outs["flash"], outs["xla"], (mask[:1], mask[1:]), strict=True):
        np.testing.assert_allclose(a[m.astype(bool)], r[m.astype(bool)], rtol=1e-3, atol=1e-4)
