"""Train state and its placement on the mesh.

`TrainState` is a plain pytree (step, params, opt_state, rng): the NNX graph definition of the
model is static and lives beside it (`ModelDef`), so the train step is a pure function of arrays
and orbax saves the state as it is. Parameters and optimizer moments are placed by the logical
axis rules (`codedance_jax.sharding`). A model above `SMALL_INIT_MAX_PARAMS` is created directly on
the mesh by a jitted initializer with explicit out shardings, never gathered on one device; a
smaller one is drawn on one device and placed (one program for every mesh).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import NamedSharding, PartitionSpec

from codedance_jax import sharding as shd
from codedance_jax.model.config import ModelConfig
from codedance_jax.model.qwen25vl import Qwen25VL


@struct.dataclass
class TrainState:
    step: jax.Array  # int32[]
    params: nnx.State  # float32 master weights (param_dtype)
    opt_state: optax.OptState
    rng: jax.Array  # uint32[2] raw key, so orbax stores it as a plain array


@dataclasses.dataclass(frozen=True)
class ModelDef:
    """The static half of the model: rebuild with `model(params)` inside jitted code."""

    cfg: ModelConfig
    graphdef: nnx.GraphDef
    rest: nnx.State  # non-Param state (empty for Qwen25VL; kept for generality)

    def model(self, params: nnx.State) -> Qwen25VL:
        return nnx.merge(self.graphdef, params, self.rest)

    def __hash__(self):  # used as a static jit argument
        return hash((self.cfg, self.graphdef))


def abstract_params(cfg: ModelConfig):
    abstract = nnx.eval_shape(lambda: Qwen25VL(cfg, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    return ModelDef(cfg, graphdef, rest), params


def param_shardings(params: nnx.State, mesh, rules=None, *, tolerance: float = shd.DEFAULT_SHARDING_TOLERANCE) -> nnx.State:
    """NamedSharding per parameter from its logical axis names (checked: `shd.param_shardings`)."""
    return shd.param_shardings(params, mesh, rules, tolerance=tolerance)[0]


def state_shardings(abstract_state: TrainState, params_sh, mesh, tx) -> TrainState:
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_sh = optax.tree_map_params(
        tx, lambda _, s: s, abstract_state.opt_state, params_sh,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    return TrainState(step=replicated, params=params_sh, opt_state=opt_sh, rng=replicated)


def _strip(params_sh):
    """State of Variables holding NamedSharding -> State of plain NamedSharding leaves."""
    return jax.tree.map(lambda v: v.get_value() if isinstance(v, nnx.Variable) else v, params_sh,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))


# Models up to this many parameters (64 MiB in float32) are drawn by one program with no shardings,
# on each process's first device, and then placed on the mesh. That program is the same for every
# mesh, so the compilation cache serves it to each later mesh and process: the sharded init of the
# tiny test model compiled for 5-8 s per mesh (of ~1 ms of work), and the suite builds it on a
# dozen meshes. Larger models are drawn sharded, in place, never whole on one device.
SMALL_INIT_MAX_PARAMS = 1 << 24


def _n_params(abstract) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(abstract))


def _random_params(cfg: ModelConfig, key) -> nnx.State:
    return nnx.split(Qwen25VL(cfg, rngs=nnx.Rngs(key)), nnx.Param, ...)[1]


def _small_random_params(cfg: ModelConfig, seed: int, p_sh):
    """The random init drawn on this process's first device, fetched, and placed by `p_sh`; every
    process draws the same numbers, so each fills its own shards."""
    host = jax.device_get(jax.jit(lambda key: _random_params(cfg, key))(jax.random.key(seed)))
    return jax.tree.map(lambda s, a: jax.make_array_from_callback(a.shape, s, lambda i: a[i]), p_sh, host)


def create_train_state(cfg: ModelConfig, tx, mesh, *, seed: int = 0, rules=None, params: nnx.State | None = None,
                       sharding_tolerance: float = shd.DEFAULT_SHARDING_TOLERANCE):
    """(ModelDef, TrainState, TrainState-of-shardings). Random init unless `params` is given.

    Raises `shd.ShardingError` before allocating anything when the mesh cannot shard the model
    within `sharding_tolerance`.
    """
    mdef, abstract = abstract_params(cfg)
    p_sh = _strip(param_shardings(abstract, mesh, rules, tolerance=sharding_tolerance))

    def wrap(p):
        rng = jax.random.key_data(jax.random.key(seed + 1))
        return TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=tx.init(p), rng=rng)

    def init_random(key):
        return wrap(_random_params(cfg, key))

    abstract_state = jax.eval_shape(wrap, abstract)
    sh = state_shardings(abstract_state, p_sh, mesh, tx)
    if params is None and _n_params(abstract) <= SMALL_INIT_MAX_PARAMS:
        params = _small_random_params(cfg, seed, p_sh)
    if params is None:
        state = jax.jit(init_random, out_shardings=sh)(jax.random.key(seed))
    else:  # already placed (e.g. from_pretrained(mesh=...)); only the optimizer state is new
        state = jax.jit(wrap, in_shardings=(p_sh,), out_shardings=sh, donate_argnums=0)(params)
    return mdef, state, sh
