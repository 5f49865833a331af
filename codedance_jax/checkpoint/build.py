"""Builds a `Qwen25VL` from per-tensor arrays without ever holding two copies of the model.

The model is first created abstractly (`nnx.eval_shape`, no memory); then each parameter is
filled from one source tensor at a time, placed straight onto its sharding when a mesh is given
(`jax.make_array_from_callback`, so each device receives only its own shard).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from codedance_jax import sharding as shd
from codedance_jax.model.config import ModelConfig
from codedance_jax.model.params import Rule, rules
from codedance_jax.model.qwen25vl import Qwen25VL


def abstract_model(cfg: ModelConfig):
    """(graphdef, abstract Param state) of the model; no memory is allocated."""
    abstract = nnx.eval_shape(lambda: Qwen25VL(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    return graphdef, state


def put(x: np.ndarray, dtype, sharding) -> jax.Array:
    x = np.asarray(x)
    if sharding is None:
        return jnp.asarray(x, dtype=dtype)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: np.asarray(x[idx]).astype(dtype))


def model_from_tensors(
    cfg: ModelConfig,
    get: Callable[[Rule], np.ndarray],
    *,
    mesh: jax.sharding.Mesh | None = None,
    rules_table=None,
    sharding_tolerance: float = shd.DEFAULT_SHARDING_TOLERANCE,
) -> Qwen25VL:
    """`get(rule)` returns the Hugging Face tensor of `rule` (torch layout) as a numpy array."""
    graphdef, state = abstract_model(cfg)
    flat = dict(nnx.to_flat_state(state))
    # All shardings first, so a mesh that cannot shard the model fails before any tensor is read.
    shardings = None if mesh is None else dict(nnx.to_flat_state(
        shd.param_shardings(state, mesh, rules_table, tolerance=sharding_tolerance)[0]))
    dtype = cfg.weight_dtype
    for rule in rules(cfg):
        var = flat.get(rule.path)
        if var is None:  # the table and the module disagree: a bug here, not bad input
            raise KeyError(f"parameter path {rule.path} from the HF table is not in the model")
        sharding = None if shardings is None else shardings[rule.path]
        var.set_value(put(rule.to_ours(get(rule)), dtype, sharding))
        del flat[rule.path]
    missing = [p for p, v in flat.items() if isinstance(v, nnx.Param)]
    if missing:
        raise KeyError(f"no source tensor for parameters {missing[:5]}")
    return nnx.merge(graphdef, state)


def params_to_hf(model: Qwen25VL):
    """Yields (hf_name, numpy array in torch layout), one tensor at a time (device -> host)."""
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    for rule in rules(model.cfg):
        yield rule.hf_name, rule.to_hf(np.asarray(jax.device_get(flat[rule.path].get_value())))
