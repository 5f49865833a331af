"""Engines on one sampling mesh share their compiled programs, whichever way the policy was placed.

The demo evaluates a policy loaded from a checkpoint (one device's arrays) and then rolls out the
GRPO trainer's parameters (NamedShardings over the trainer's mesh). Both go through
`placement.sampling_params`, which gives every leaf the one sharding `NamedSharding(mesh, P())`: the
jitted rollout programs are keyed by their arguments' sharding objects, so the second engine's
warm-up then compiles nothing."""

import jax
from flax import nnx
from rollout_helpers import small_config

from codedance_jax import sharding
from codedance_jax.rollout import RolloutEngine, SamplingConfig
from codedance_jax.rollout.placement import sampling_mesh, sampling_params


def test_checkpoint_and_trainer_placements_share_the_rollout_programs(model, processor):
    mesh = sampling_mesh(1)
    graphdef, state = nnx.split(model)
    cfg = small_config(obs_buckets=(48,))  # a bucket no other test of the session compiles
    loaded = nnx.merge(graphdef, sampling_params(state, mesh))  # a checkpoint's single-device arrays
    first = RolloutEngine(loaded, processor, cfg, SamplingConfig(greedy=True), mesh=mesh).warm_up(prompts=4)
    assert first["compilations"] > 0

    # The trainer's layout on a one-device mesh of its own: the same values, other sharding objects.
    trainer_mesh = sharding.make_mesh(1, 1, 1, devices=jax.local_devices()[:1])
    shardings, _ = sharding.param_shardings(state, trainer_mesh)
    trained = jax.tree.map(lambda v, s: jax.device_put(v, s), state, shardings,
                           is_leaf=lambda x: isinstance(x, nnx.Variable))
    assert any(x.sharding != jax.tree.leaves(loaded)[0].sharding for x in jax.tree.leaves(trained))
    placed = sampling_params(trained, mesh)
    want = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    assert all(x.sharding == want for x in jax.tree.leaves(placed))
    second = RolloutEngine(nnx.merge(graphdef, placed), processor, cfg, SamplingConfig(greedy=True),
                           mesh=mesh).warm_up(prompts=4)
    assert second["compilations"] == 0, second
