"""The sampling mesh (`codedance_jax/rollout/placement.py`) on the session's 8 CPU devices: the
trainer's parameters placed for it on device, bit for bit; multi-turn rollouts that are token for
token those of one device when the rows are split over 8 or 4 devices (greedy with the random
policy; sampled with every logit 0, so the draws are the keys' alone); the placement in the stats;
the GRPO config's `rollout.mesh_data` checked against `rollout.batch_multiple`.
(The GRPO loop's own rollouts over 8 devices: tests/train/test_grpo_loop.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fakes import FakePool
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from rollout_helpers import random_image, small_config

from codedance_jax import sharding
from codedance_jax.errors import ConfigError
from codedance_jax.rollout import RolloutEngine, SamplingConfig, rl_prompt
from codedance_jax.rollout.placement import sampling_mesh, sampling_params

CODE_IMG = '<think>crop</think>\n<code>\n```python\nshow(56, 56)\nprint("size 56")\n```\n</code>'


def _trainer_params(rng):
    """Fresh random leaves laid out as a trainer's: split over fsdp and tensor, over data, replicated."""
    mesh = sharding.make_mesh(2, 2, 2)
    shapes = {"w": ((8, 6), PartitionSpec("fsdp", "tensor")), "v": ((6, 4), PartitionSpec(None, "data")),
              "b": ((5,), PartitionSpec())}
    host = {k: rng.normal(size=s).astype(np.float32) for k, (s, _) in shapes.items()}
    return host, {k: jax.device_put(host[k], NamedSharding(mesh, spec)) for k, (_, spec) in shapes.items()}


def test_sampling_params_are_the_trainers_bit_for_bit_placed_device_to_device():
    assert jax.device_count() == 8
    host, params = _trainer_params(np.random.default_rng())
    with pytest.raises(Exception, match="host-to-device"):  # the naive reshard goes through the host
        with jax.transfer_guard_host_to_device("disallow_explicit"), jax.transfer_guard_device_to_host("disallow_explicit"):
            jax.device_put(params["w"], NamedSharding(sampling_mesh(8), PartitionSpec()))
    for n in (8, 4, 1):
        mesh = sampling_mesh(n)
        assert mesh.shape == {"data": n, "fsdp": 1, "tensor": 1} and list(mesh.devices.flat) == jax.local_devices()[:n]
        with jax.transfer_guard("disallow"):
            out = sampling_params(params, mesh)
        for k, x in out.items():
            assert x.sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec()), x.ndim), (n, k, x.sharding)
            assert x.sharding.device_set == set(mesh.devices.flat)
            for s in x.addressable_shards:  # every device holds the whole array, equal to the trainer's
                np.testing.assert_array_equal(np.asarray(s.data), host[k])
        again = sampling_params(out, mesh)
        assert all(again[k] is out[k] for k in out)  # already placed: no copy
    # One device's weights onto several devices (an engine over a model that lives on one device).
    one = {k: jax.device_put(v, jax.devices()[0]) for k, v in host.items()}
    out = sampling_params(one, sampling_mesh(8))
    assert all(len(x.sharding.device_set) == 8 and np.array_equal(np.asarray(x), host[k]) for k, x in out.items())


def _rollouts(model, processor, prompts, sampling, meshes):
    """{n: (trajectories, stats)} of one rollout of `prompts` x 2 on `sampling_mesh(n)` for each n; a
    third of the rows forced to run code on turn 0 (an image comes back and is appended to a row
    subset while the other rows decode in subsets)."""
    graphdef, state = nnx.split(model)
    out = {}
    for n in meshes:
        mesh = sampling_mesh(n)
        engine = RolloutEngine(nnx.merge(graphdef, sampling_params(state, mesh)), processor, small_config(), sampling,
                               mesh=mesh)
        out[n] = engine.rollout(prompts, group_size=2, sandbox=FakePool(delay_s=0.01),
                                script=lambda row, turn: CODE_IMG if turn == 0 and row % 3 == 0 else None)
    return out


def _prompts(processor, seed):
    return [rl_prompt(processor, f"m{i}", f"What is shown? ({seed}, {i})", [random_image(seed + i)], "code")
            for i in range(5)]


def _check_same(runs):
    base, _ = runs[1]
    assert sum(t.num_executions for t in base) == 4 and all(len(t.images) == 2 for t in base[::3])
    for n, (trajs, stats) in runs.items():
        assert [t.tokens for t in trajs] == [t.tokens for t in base], n
        assert [t.turn_status for t in trajs] == [t.turn_status for t in base], n
        assert stats.sampling_devices == n and stats.sampling_mesh == {"data": n, "fsdp": 1, "tensor": 1}
        cache_spec = stats.row_shardings["cache.k"]
        assert cache_spec == str(PartitionSpec("data", None, None, None)) if n > 1 else "data" not in cache_spec
    return base


def test_greedy_rollouts_are_the_same_on_every_sampling_mesh(model, processor):
    """The policy's logits on 8 and 4 devices (rows split, weights replicated) give one device's
    trajectories: 16 rows (10 trajectories), multi-turn with images. Greedy, because the logits
    agree to ~1e-6, not bit for bit: XLA's CPU matmul picks its kernel by the rows a device holds
    (2 of 16 here: a different summation order), and at temperature 1 such noise moves the
    inverse-CDF draw of a near-uniform tiny-model distribution to a neighbouring id in about one
    token of a few hundred (as another row schedule does on one device, test_engine). The prompts
    are fixed (seed 0): a near-tie of the top two logits could flip a greedy token too."""
    runs = _rollouts(model, processor, _prompts(processor, 0), SamplingConfig(greedy=True), (1, 8, 4))
    base = _check_same(runs)
    for n, (trajs, _) in runs.items():
        np.testing.assert_allclose(sum((t.logprobs for t in trajs), []), sum((t.logprobs for t in base), []),
                                   atol=1e-5, err_msg=str(n))


def test_sampled_rollouts_draw_the_same_tokens_on_every_sampling_mesh(model, processor):
    """Temperature 1 with the final norm's scale at zero: every logit is exactly 0 on any layout, so
    each draw is decided by its row's key alone (uniform over the vocabulary). Fresh seeds; the
    rows split over 8 devices draw what one device draws, row for row and token for token."""
    flat = nnx.clone(model)
    flat.norm.scale[...] = jnp.zeros_like(flat.norm.scale[...])
    seed = int(np.random.default_rng().integers(1 << 20))
    runs = _rollouts(flat, processor, _prompts(processor, seed), SamplingConfig(temperature=1.0, seed=seed), (1, 8))
    base = _check_same(runs)
    assert len({tuple(t.tokens) for t in base}) == len(base)  # sampled: every row draws its own tokens
    for trajs, _ in runs.values():
        assert [t.logprobs for t in trajs] == [t.logprobs for t in base]  # -log V, bit for bit


def test_grpo_sampling_mesh_follows_the_config():
    from configs import grpo as grpo_configs
    from runs.grpo import rollout_config, rollout_mesh

    c = grpo_configs.get_config("tiny")
    assert c.rollout.mesh_data == -1 and rollout_mesh(c).shape["data"] == jax.local_device_count() == 8
    assert rollout_config(c).batch_multiple == 8  # mesh_data is not a RolloutConfig field
    c.rollout.mesh_data = 4
    assert list(rollout_mesh(c).devices.flat) == jax.local_devices()[:4]
    c.rollout.mesh_data = 3
    with pytest.raises(ConfigError, match="batch_multiple=8 is not a multiple of the sampling mesh's 3 devices"):
        rollout_mesh(c)
    c.rollout.mesh_data, c.rollout.batch_multiple = -1, 4
    with pytest.raises(ConfigError, match="rollout.batch_multiple"):
        rollout_mesh(c)
    c.rollout.mesh_data = 16
    with pytest.raises(ConfigError, match="mesh_data=16: this process has 8 devices"):
        rollout_mesh(c)
