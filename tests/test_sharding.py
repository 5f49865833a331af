"""Parameter sharding is a checked quantity: a mesh that cannot divide the model fails, naming what.

Full-size presets run under `jax.eval_shape` (no memory); the tiny model covers the tolerance's
two sides and the loaders' early failure.
"""

import logging

import jax
import ml_collections
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from codedance_jax import sharding as shd
from codedance_jax.checkpoint.build import model_from_tensors
from codedance_jax.model import ModelConfig
from codedance_jax.train import optim
from codedance_jax.train import state as st


def _tx():
    oc = ml_collections.ConfigDict(dict(lr=1e-3, warmup_ratio=0.0, weight_decay=0.0, b1=0.9, b2=0.95, eps=1e-8,
                                        clip_norm=1.0, schedule="constant"))
    return optim.make_optimizer(oc, 10)[0]


def _abstract_state(cfg, mesh, **kw):
    """The train state's shapes and shardings; its jitted initializer is traced, never run."""
    return jax.eval_shape(lambda: st.create_train_state(cfg, _tx(), mesh, **kw)[1])


def test_7b_on_a_mesh_that_cannot_divide_it_raises_naming_parameter_and_axis():
    # 28 query heads and 4 KV heads do not split 8 ways; neither does the vision MLP (3420).
    mesh = shd.make_mesh(1, 1, 8)
    with pytest.raises(shd.ShardingError) as e:
        _abstract_state(ModelConfig.qwen25vl_7b(), mesh)
    msg = str(e.value)
    assert "layers/0/attn/k_bias (4, 128) dim 0 (kv_heads=4) not divisible by mesh axis tensor=8" in msg, msg
    assert "14.99%" in msg and "tolerance 2.00%" in msg, msg


@pytest.fixture(scope="module")
def params_7b():
    return st.abstract_params(ModelConfig.qwen25vl_7b())[1]


def test_7b_report_counts_exactly_the_tensors_that_do_not_divide(params_7b):
    params = params_7b
    _, rep = shd.param_shardings(params, shd.make_mesh(1, 1, 8), tolerance=1.0)
    # Independently: a tensor falls back iff it has a q_heads (28), kv_heads (4) or vision_mlp (3420) dimension.
    sizes = {"q_heads": 28, "kv_heads": 4, "vision_mlp": 3420}
    want_n, want_el, total = 0, 0, 0
    for _, var in jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: hasattr(x, "get_metadata"))[0]:
        axes = var.get_metadata()["out_sharding"]
        total += int(np.prod(var.shape))
        if any(a in sizes and sizes[a] % 8 for a in axes):
            want_n += 1
            want_el += int(np.prod(var.shape))
    assert (rep.dropped_params, rep.dropped_elements, rep.elements) == (want_n, want_el, total) == (356, 1_242_681_088, 8_292_166_656)
    assert {d.logical for d in rep.dropped} == {"q_heads", "kv_heads", "vision_mlp"}


def test_7b_on_a_dividing_mesh_shards_every_parameter_as_the_rules_ask(params_7b):
    tree, rep = shd.param_shardings(params_7b, shd.make_mesh(1, 4, 2), tolerance=0.0)
    assert rep.dropped == () and rep.fraction == 0.0 and rep.params == 3 + 28 * 12 + 32 * 12 + 6  # embed, lm_head, norm; layers; blocks; merger + patch_embed
    assert tree["layers"][0]["attn"]["q_kernel"].spec == P("fsdp", "tensor", None)
    assert tree["embed"].spec == P("tensor", "fsdp")


def test_tiny_model_fallback_is_counted_and_the_tolerance_is_a_strict_bound(caplog):
    """Tiny on (1, 2, 4): its 2 KV heads do not split 4 ways, in k/v kernels and biases of 2 layers."""
    cfg, mesh = ModelConfig.tiny(), shd.make_mesh(1, 2, 4)
    _, params = st.abstract_params(cfg)
    d, kv, hd = cfg.text.hidden_size, cfg.text.num_key_value_heads, cfg.text.head_dim
    want = cfg.text.num_hidden_layers * 2 * (d * kv * hd + kv * hd)  # (k, v) x (kernel + bias)
    with caplog.at_level(logging.WARNING, logger="codedance_jax.sharding"):
        tree, rep = shd.param_shardings(params, mesh)
    assert rep.dropped_elements == want and rep.dropped_params == 4 * cfg.text.num_hidden_layers
    assert "layers/0/attn/k_kernel" in caplog.text and "keep a dimension unsharded" in caplog.text
    # only the non-dividing dimension is replicated; the others keep their axes
    assert tree["layers"][0]["attn"]["k_kernel"].spec == P("fsdp", None, None)
    assert tree["layers"][0]["attn"]["q_kernel"].spec == P("fsdp", "tensor", None)
    shd.param_shardings(params, mesh, tolerance=rep.fraction)  # at the bound: allowed
    with pytest.raises(shd.ShardingError, match=r"layers/0/attn/k_kernel \(64, 2, 16\) dim 1"):
        shd.param_shardings(params, mesh, tolerance=rep.fraction * 0.99)


def test_tiny_model_on_the_test_meshes_drops_nothing():
    _, params = st.abstract_params(ModelConfig.tiny())
    for shape in [(8, 1, 1), (1, 8, 1), (2, 4, 1), (2, 2, 2)]:
        assert shd.param_shardings(params, shd.make_mesh(*shape), tolerance=0.0)[1].dropped == ()


def test_loader_fails_before_reading_any_tensor():
    def get(rule):
        raise AssertionError(f"read {rule.hf_name} before the sharding check")

    with pytest.raises(shd.ShardingError, match="kv_heads"):
        model_from_tensors(ModelConfig.tiny(), get, mesh=shd.make_mesh(1, 2, 4), sharding_tolerance=0.0)
