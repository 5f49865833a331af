"""The sampling mesh (`codedance_jax/rollout/placement.py`) on the session's 8 CPU devices: the
trainer's parameters placed for it on device, bit for bit, replicated or split over `tensor` as the
model's logical axes ask; multi-turn rollouts that are token for token those of one device when the
rows are split over 8 devices, or over 4 with the weights and KV cache split over 2 more (greedy
with the random policy; sampled with every logit 0, so the draws are the keys' alone); nothing
compiled after the warm-up on a data x tensor mesh; the placement in the stats; the GRPO config's
`rollout.mesh_data` / `mesh_tensor` checked against the devices and `rollout.batch_multiple`.
(The GRPO loop's own rollouts over 8 devices: tests/train/test_grpo_loop.py.)"""

import dataclasses

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
from codedance_jax.model.qwen25vl import Qwen25VL
from codedance_jax.rollout import RolloutEngine, SamplingConfig, rl_prompt
from codedance_jax.rollout.device_batch import RowPlacement
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


# The dimension `tensor` splits, by a parameter's logical axes (DEFAULT_RULES): attention heads, MLP
# columns, vocabulary, the vision merger's hidden width. Any other parameter is whole on every device.
SPLIT = {
    ("vocab", "embed"): 0, ("embed", "vocab"): 1,
    ("embed", "q_heads", "head_dim"): 1, ("q_heads", "head_dim"): 0, ("q_heads", "head_dim", "embed"): 0,
    ("embed", "kv_heads", "head_dim"): 1, ("kv_heads", "head_dim"): 0,
    ("embed", "mlp"): 1, ("mlp", "embed"): 0,
    ("vision_embed", None, "vision_heads", "head_dim"): 2, (None, "vision_heads", "head_dim"): 1,
    ("vision_heads", "head_dim", "vision_embed"): 0,
    ("vision_embed", "vision_mlp"): 1, ("vision_mlp",): 0, ("vision_mlp", "vision_embed"): 0,
    ("vision_merged", "vision_merged_out"): 1, ("vision_merged_out",): 0, ("vision_merged_out", "embed"): 0,
}


def _variables(state):
    return jax.tree_util.tree_leaves_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def test_sampling_params_split_over_tensor_as_the_model_asks(model):
    """On a (4, 1, 2) mesh the trainer's parameters (fsdp x tensor over (2, 2, 2)) come out split over
    `tensor` on their heads, MLP and vocabulary dimensions, whole elsewhere, with no host transfer;
    each device's shard is the trainer's slice bit for bit. The same from a mesh over other devices
    in another order (gathered whole, then sliced); with 4-way tensor the 2 KV heads stay whole."""
    _, state = nnx.split(model)
    host = [np.asarray(x) for x in jax.tree.leaves(state)]
    trainer = jax.device_put(state, sharding.param_shardings(state, sharding.make_mesh(2, 2, 2))[0])
    for mesh in (sampling_mesh(4, 2), sampling_mesh(2, 2), sampling_mesh(4, 2, devices=jax.local_devices()[::-1])):
        with jax.transfer_guard("disallow"):
            out = sampling_params(trainer, mesh)
        split = set()
        for (path, var), want in zip(_variables(out), host, strict=True):
            x, axes = var.get_value(), tuple(var.get_metadata()["out_sharding"])
            spec = tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
            assert spec == tuple("tensor" if d == SPLIT.get(axes) else None for d in range(x.ndim)), (path, spec)
            assert x.sharding.mesh == mesh and x.sharding.device_set == set(mesh.devices.flat), path
            if axes in SPLIT:
                split.add(axes)
            for s in x.addressable_shards:
                np.testing.assert_array_equal(np.asarray(s.data), want[s.index], err_msg=jax.tree_util.keystr(path))
        assert split == set(SPLIT)  # every kind of split parameter met
        again = sampling_params(out, mesh)
        assert all(a is b for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(out), strict=True))
    wide = sampling_params(trainer, sampling_mesh(2, 4))
    k = wide["layers"][0]["attn"]["k_kernel"].get_value()  # 2 KV heads do not split 4 ways: whole
    assert k.sharding.is_fully_replicated and not wide["layers"][0]["attn"]["q_kernel"].get_value().is_fully_replicated
    # the cache follows: rows over `data`, KV heads over `tensor` where they divide
    cache = jax.eval_shape(lambda: model.init_cache(8, 64))
    assert RowPlacement(sampling_mesh(4, 2)).layout(cache).k[0].spec == PartitionSpec("data", "tensor", None, None)
    assert RowPlacement(sampling_mesh(4, 2)).layout(cache).valid.spec == PartitionSpec("data", None)
    assert RowPlacement(sampling_mesh(2, 4)).layout(cache).k[0].spec == PartitionSpec("data", None, None, None)


def _rollouts(model, processor, prompts, sampling, meshes):
    """{(data, tensor): (trajectories, stats)} of one rollout of `prompts` x 2 on `sampling_mesh(data,
    tensor)` for each; a third of the rows forced to run code on turn 0 (an image comes back and is
    appended to a row subset while the other rows decode in subsets). The weights come from a
    trainer's layout (fsdp x tensor over (2, 2, 2)), as a GRPO step's do."""
    graphdef, state = nnx.split(model)
    trainer = jax.device_put(state, sharding.param_shardings(state, sharding.make_mesh(2, 2, 2))[0])
    out = {}
    for n in meshes:
        mesh = sampling_mesh(*n)
        engine = RolloutEngine(nnx.merge(graphdef, sampling_params(trainer, mesh)), processor, small_config(),
                               sampling, mesh=mesh)
        out[n] = engine.rollout(prompts, group_size=2, sandbox=FakePool(delay_s=0.01),
                                script=lambda row, turn: CODE_IMG if turn == 0 and row % 3 == 0 else None)
    return out


def _prompts(processor, seed):
    return [rl_prompt(processor, f"m{i}", f"What is shown? ({seed}, {i})", [random_image(seed + i)], "code")
            for i in range(5)]


def _check_same(runs):
    base, _ = runs[1, 1]
    assert sum(t.num_executions for t in base) == 4 and all(len(t.images) == 2 for t in base[::3])
    for (d, t), (trajs, stats) in runs.items():
        assert [t.tokens for t in trajs] == [t.tokens for t in base], (d, t)
        assert [t.turn_status for t in trajs] == [t.turn_status for t in base], (d, t)
        assert stats.sampling_devices == d * t and stats.sampling_mesh == {"data": d, "fsdp": 1, "tensor": t}
        cache_spec = stats.row_shardings["cache.k"]
        if d * t == 1:
            assert "data" not in cache_spec and "tensor" not in cache_spec
        else:  # rows over `data`, KV heads over `tensor` (2 heads: split 2 ways)
            assert cache_spec == str(PartitionSpec("data", "tensor" if t > 1 else None, None, None)), (d, t)
    return base


def test_greedy_rollouts_are_the_same_on_every_sampling_mesh(model, processor):
    """The policy's logits on 8 devices (rows split, weights replicated) and on 4 x 2 (rows split
    over 4, weights and KV cache split by heads over 2) give one device's trajectories: 16 rows (10
    trajectories), multi-turn with images. Greedy, because the logits agree to ~1e-6, not bit for
    bit: XLA's CPU matmul picks its kernel by the rows a device holds (2 of 16 here: a different
    summation order), the tensor split sums the heads' and MLP columns' halves across devices, and
    at temperature 1 such noise moves the inverse-CDF draw of a near-uniform tiny-model
    distribution to a neighbouring id in about one token of a few hundred (as another row schedule
    does on one device, test_engine). The prompts are fixed (seed 0): a near-tie of the top two
    logits could flip a greedy token too."""
    runs = _rollouts(model, processor, _prompts(processor, 0), SamplingConfig(greedy=True), ((1, 1), (8, 1), (4, 2)))
    base = _check_same(runs)
    for n, (trajs, _) in runs.items():
        np.testing.assert_allclose(sum((t.logprobs for t in trajs), []), sum((t.logprobs for t in base), []),
                                   atol=1e-5, err_msg=str(n))


def test_a_bfloat16_models_sampler_holds_bfloat16_weights_and_samples_the_same(model, processor):
    """float32 weights of a bfloat16-compute model are cast on the trainer's shards before they move
    (`placement.sampler_dtype`): the sampler holds half the bytes, no host transfer, and its
    trajectories are the float32 copy's bit for bit (every use casts a weight to the compute dtype)."""
    cfg = dataclasses.replace(model.cfg, dtype="bfloat16")
    _, state = nnx.split(model)
    bdef, _ = nnx.split(Qwen25VL(cfg, rngs=nnx.Rngs(0)))
    trainer = jax.device_put(state, sharding.param_shardings(state, sharding.make_mesh(2, 2, 2))[0])
    mesh = sampling_mesh(4, 2)
    with jax.transfer_guard("disallow"):
        cast = sampling_params(trainer, mesh, compute_dtype=jnp.bfloat16)
    full = sampling_params(trainer, mesh)
    for a, b in zip(jax.tree.leaves(cast), jax.tree.leaves(full), strict=True):
        assert a.dtype == jnp.bfloat16 and b.dtype == jnp.float32 and a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(jnp.bfloat16)))
    assert sampling_params(cast, mesh, compute_dtype=jnp.bfloat16)["embed"].get_value() is cast["embed"].get_value()
    got = []
    for params in (full, cast):
        engine = RolloutEngine(nnx.merge(bdef, params), processor, small_config(), SamplingConfig(greedy=True), mesh=mesh)
        got.append(engine.rollout(_prompts(processor, 1), group_size=2, sandbox=FakePool(delay_s=0.01),
                                  script=lambda row, turn: CODE_IMG if turn == 0 and row % 3 == 0 else None)[0])
    assert sum(t.num_executions for t in got[0]) > 0
    assert [t.tokens for t in got[1]] == [t.tokens for t in got[0]]
    assert [t.logprobs for t in got[1]] == [t.logprobs for t in got[0]]


def test_sampled_rollouts_draw_the_same_tokens_on_every_sampling_mesh(model, processor):
    """Temperature 1 with the final norm's scale at zero: every logit is exactly 0 on any layout, so
    each draw is decided by its row's key alone (uniform over the vocabulary). Fresh seeds; the
    rows split over 8 devices, or over 4 with the weights over 2, draw what one device draws, row
    for row and token for token."""
    flat = nnx.clone(model)
    flat.norm.scale[...] = jnp.zeros_like(flat.norm.scale[...])
    seed = int(np.random.default_rng().integers(1 << 20))
    runs = _rollouts(flat, processor, _prompts(processor, seed), SamplingConfig(temperature=1.0, seed=seed),
                     ((1, 1), (8, 1), (4, 2)))
    base = _check_same(runs)
    assert len({tuple(t.tokens) for t in base}) == len(base)  # sampled: every row draws its own tokens
    for trajs, _ in runs.values():
        assert [t.logprobs for t in trajs] == [t.logprobs for t in base]  # -log V, bit for bit


def test_nothing_compiles_after_warm_up_on_a_tensor_mesh(model, processor):
    """On a 4 x 2 mesh (rows over 4, weights and KV cache split over 2) the warm-up compiles the
    whole shape plan: then rollouts with images in prompts and observations, a cache that grows and
    compacts, fewer prompts, and a policy placed afresh from the trainer's layout (as each GRPO step
    does) compile nothing."""
    from test_engine import ANSWER, make_prompts

    mesh = sampling_mesh(4, 2)
    graphdef, state = nnx.split(model)
    trainer = sharding.param_shardings(state, sharding.make_mesh(1, 8, 1))[0]
    cfg = small_config(cache_len=None, cache_grow=256, max_total_tokens=300, max_turns=3, max_turn_tokens=40,
                       max_new_tokens=100)
    engine = RolloutEngine(nnx.merge(graphdef, sampling_params(jax.device_put(state, trainer), mesh)), processor, cfg,
                           SamplingConfig(temperature=1.0, seed=5), mesh=mesh)
    warm = engine.warm_up(prompts=4, group_size=2)
    assert warm["compilations"] > 0
    pool = FakePool()
    _, s1 = engine.rollout(make_prompts(processor, 4, seed=21), 2, pool,
                           script=lambda r, m: [CODE_IMG, None][r % 2] if m < 2 else ANSWER)
    moved = jax.tree.map(lambda x: x * 0.5, state)  # the next step's policy, on the trainer's mesh
    engine.set_model(nnx.merge(graphdef, sampling_params(jax.device_put(moved, trainer), mesh)))
    trajs, s2 = engine.rollout(make_prompts(processor, 3, seed=22), 2, pool,
                               script=lambda r, m: '<code>\n```python\nshow(84, 56)\n```\n</code>' if m == 0 else None)
    assert (s1.compiles, s2.compiles) == (0, 0)
    assert s1.cache_growths + s2.cache_growths > 0 and any(t.images[1:] for t in trajs)
    for s in (s1, s2):
        assert s.sampling_devices == 8 and s.sampling_mesh == {"data": 4, "fsdp": 1, "tensor": 2}
        assert s.row_shardings["cache.k"] == str(PartitionSpec("data", "tensor", None, None))


def test_grpo_sampling_mesh_follows_the_config():
    from configs import grpo as grpo_configs
    from runs.grpo import rollout_config, rollout_mesh

    c = grpo_configs.get_config("tiny")
    assert c.rollout.mesh_data == -1 and rollout_mesh(c).shape["data"] == jax.local_device_count() == 8
    assert rollout_config(c).batch_multiple == 8  # mesh_data is not a RolloutConfig field
    c.rollout.mesh_data = 4
    assert list(rollout_mesh(c).devices.flat) == jax.local_devices()[:4]
    c.rollout.mesh_data = 3
    with pytest.raises(ConfigError, match="batch_multiple=8 is not a multiple of the sampling mesh's 3 data slices"):
        rollout_mesh(c)
    c.rollout.mesh_data, c.rollout.batch_multiple = -1, 4
    with pytest.raises(ConfigError, match="rollout.batch_multiple"):
        rollout_mesh(c)
    c.rollout.mesh_data = 16
    with pytest.raises(ConfigError, match="mesh_data=16: this process has 8 devices"):
        rollout_mesh(c)
    # mesh_tensor: the weights over groups of that many devices, mesh_data = -1 the groups there are
    c.rollout.mesh_data, c.rollout.batch_multiple = -1, 8
    assert c.rollout.mesh_tensor == 1
    c.rollout.mesh_tensor = 2
    sm = rollout_mesh(c)
    assert sm.shape == {"data": 4, "fsdp": 1, "tensor": 2} and list(sm.devices.flat) == jax.local_devices()
    assert rollout_config(c).batch_multiple == 8  # mesh_tensor is not a RolloutConfig field either
    c.rollout.mesh_data = 2
    assert list(rollout_mesh(c).devices.flat) == jax.local_devices()[:4]
    for data, tensor, match in ((-1, 3, "mesh_tensor=3: this process has 8 devices, which do not split into groups of 3"),
                                (-1, 0, "mesh_tensor=0"), (-1, 16, "mesh_tensor=16"),
                                (8, 2, r"mesh_data=8: this process has 8 devices \(4 groups of mesh_tensor=2\)")):
        c.rollout.mesh_data, c.rollout.mesh_tensor = data, tensor
        with pytest.raises(ConfigError, match=match):
            rollout_mesh(c)


def test_a_host_whose_chips_are_not_neighbours_in_the_trainers_order_still_receives_only_its_shards(model):
    """v5e-256's hosts own 2 x 2 blocks (ids 0, 1, 16, 17 for host 0): in the trainer's device order
    they are not neighbours, so no (n / tensor, 1, tensor) reshape gives each chip its tensor index.
    Here: sampling devices 0, 1, 4, 5 of a (2, 2, 2) trainer mesh; the cover is (2, 2, 2) with axes
    0 and 2 as `tensor`. One program, shards only (no leaf made whole first), bit for bit."""
    from codedance_jax.rollout import placement

    _, state = nnx.split(model)
    host = [np.asarray(x) for x in jax.tree.leaves(state)]
    trainer = jax.device_put(state, sharding.param_shardings(state, sharding.make_mesh(2, 2, 2))[0])
    d = jax.local_devices()
    mesh = sampling_mesh(1, 4, devices=[d[0], d[1], d[4], d[5]])
    plan = placement._plan(trainer, mesh, None)
    assert plan.rest == [] and len(plan.direct) == 1  # before: every split leaf in `rest` (gathered whole)
    cover = next(iter(plan.direct))
    assert dict(cover.shape) == {"tile0": 2, "c1": 2, "tile2": 2}
    programs = placement.placement_programs(trainer, mesh)
    assert len(programs) == 1
    with jax.transfer_guard("disallow"):
        out = sampling_params(trainer, mesh)
    for (path, var), want in zip(_variables(out), host, strict=True):
        x = var.get_value()
        assert x.sharding.mesh == mesh, path
        for s in x.addressable_shards:
            np.testing.assert_array_equal(np.asarray(s.data), want[s.index], err_msg=jax.tree_util.keystr(path))
    q = out["layers"][0]["attn"]["q_kernel"].get_value()
    assert not q.is_fully_replicated and q.sharding.spec[1] == "tensor"


def test_the_placement_moves_bounded_chunks_of_leaves_in_separate_programs(model, monkeypatch):
    """`placement.PLACEMENT_CHUNK_BYTES` bounds the whole-leaf bytes one program moves (XLA gathers a
    leaf whole to move it to `tensor` on another dimension; one program for a 7B policy held many at
    once): smaller chunks, more programs, the same shards bit for bit."""
    from codedance_jax.rollout import placement

    _, state = nnx.split(model)
    trainer = jax.device_put(state, sharding.param_shardings(state, sharding.make_mesh(2, 2, 2))[0])
    mesh = sampling_mesh(4, 2)
    whole = sampling_params(trainer, mesh)
    assert len(placement.placement_programs(trainer, mesh)) == 1
    monkeypatch.setattr(placement, "PLACEMENT_CHUNK_BYTES", 64 * 1024)
    largest = max(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(trainer))
    programs = placement.placement_programs(trainer, mesh)
    assert len(programs) > 3 and largest > 64 * 1024  # a leaf over the bound goes alone
    with jax.transfer_guard("disallow"):
        parts = sampling_params(trainer, mesh)
    for a, b in zip(jax.tree.leaves(parts), jax.tree.leaves(whole), strict=True):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
