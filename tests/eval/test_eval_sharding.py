"""`launch.eval` samples on the host's sampling mesh (the test session's 8 CPU devices): the checkpoint
is loaded as `config.mesh` says (fsdp over all devices), then placed for `config.rollout.mesh_data` x
`mesh_tensor` (every local device by default) with the loaded copy dropped; the predictions are the
same on 1 device, data=8 and data=4 x tensor=2, with the KV cache and logits really laid out by rows.

`evaluate(config, workdir)` in this process on the three sampling meshes; then a scripted rollout on
two of the same meshes and shapes (one compile of each step for both tests) whose rows write code on
turn 0, so that observations are appended to part of the batch and decoding goes on in subsets."""

import gc
import json
import os

import jax
import numpy as np
import pytest
from eval_fixtures import write_tsv
from jax.sharding import NamedSharding, PartitionSpec
from test_launch_eval import tiny_checkpoint  # noqa: F401 - the fixture is used by name

ROLLOUT = dict(max_turn_tokens=24, max_new_tokens=40, max_total_tokens=448, batch_multiple=8, prompt_buckets=(384,),
               obs_buckets=(64,), decode_chunk=12)
# (rollout.mesh_data, rollout.mesh_tensor) -> the sampling mesh's shape; "all" is configs/eval.py's default
MESHES = {"one": ((1, 1), dict(data=1, fsdp=1, tensor=1)), "all": ((-1, 1), dict(data=8, fsdp=1, tensor=1)),
          "tensor": ((4, 2), dict(data=4, fsdp=1, tensor=2))}


@pytest.fixture(scope="module")
def six_items(tmp_path_factory):
    """HRBench4K's three fixture items twice: 6 prompts, 8 rows (batch_multiple 8), 1 or 2 rows per data slice."""
    return write_tsv(str(tmp_path_factory.mktemp("hr6")), "HRBench4K", repeat=2)


def _config(ckpt, data_path, mesh_data=None, mesh_tensor=None, **rollout):
    from configs.eval import get_config

    c = get_config("HRBench4K")
    c.checkpoint, c.data_path, c.dtype = ckpt, data_path, "float32"
    c.batch_size, c.max_turns, c.sandbox.kind = 8, 2, "none"
    c.rollout.update({**ROLLOUT, **rollout})
    if mesh_data is not None:
        c.rollout.mesh_data, c.rollout.mesh_tensor = mesh_data, mesh_tensor
    return c


def _jsonl(path):
    return [json.loads(x) for x in open(path)]


def test_launch_eval_samples_on_every_local_device(tmp_path, tiny_checkpoint, six_items):  # noqa: F811
    from eval.evaluate import evaluate

    assert jax.device_count() == 8
    runs = {}
    for name, ((d, t), _) in MESHES.items():
        wd = str(tmp_path / name)
        evaluate(_config(tiny_checkpoint, six_items, *((None, None) if name == "all" else (d, t))), wd)
        runs[name] = [_jsonl(os.path.join(wd, n)) for n in ("predictions.jsonl", "rollout_stats.jsonl",
                                                            "trajectories.jsonl")]
    p_one, _, t_one = runs["one"]
    assert [p["index"] for p in p_one] == [str(100 + i) for i in range(6)]
    assert all(sum(t["loss_mask"]) > 0 for t in t_one)  # the model did generate
    for name in ("all", "tensor"):
        preds, _, trajs = runs[name]
        assert [p["index"] for p in preds] == [p["index"] for p in p_one], name
        assert [p["prediction"] for p in preds] == [p["prediction"] for p in p_one], name
        assert [t["tokens"] for t in trajs] == [t["tokens"] for t in t_one], name
        np.testing.assert_allclose(sum((t["logprobs"] for t in trajs), []), sum((t["logprobs"] for t in t_one), []),
                                   atol=1e-5, err_msg=name)
    for name, (_, shape) in MESHES.items():  # the placement each batch recorded
        stats = runs[name][1]
        assert stats and all(s["sampling_mesh"] == shape and s["sampling_devices"] == shape["data"] * shape["tensor"]
                             for s in stats), (name, stats[0])
    # the default: rows split over all 8 devices (`RowPlacement.settle`'s one layout per shape), the rest whole
    rows = {"cache.k": str(PartitionSpec("data", None, None, None)), "cache.valid": str(PartitionSpec("data", None)),
            "logits": str(PartitionSpec("data", None))}
    assert all(s["row_shardings"] == rows for s in runs["all"][1])
    assert all("tensor" in json.dumps(s["row_shardings"]) for s in runs["tensor"][1])  # KV heads over tensor


def test_the_loaded_copy_is_dropped(tiny_checkpoint, six_items):  # noqa: F811
    """What `evaluate` does before it rolls out: load on config.mesh (fsdp over 8), place for the
    default sampling mesh. Every parameter then sits replicated on it, and no array on the fsdp
    mesh is left alive (one copy of the policy)."""
    from flax import nnx

    import codedance_jax
    from codedance_jax.sharding import make_mesh
    from eval.evaluate import on_sampling_mesh, sampling_mesh_of

    c = _config(tiny_checkpoint, six_items)
    sm = sampling_mesh_of(c)
    assert dict(sm.shape) == MESHES["all"][1]
    load = make_mesh(c.mesh.data, c.mesh.fsdp, c.mesh.tensor)
    gc.collect()
    before = {id(x) for x in jax.live_arrays()}
    model, _ = codedance_jax.from_pretrained(tiny_checkpoint, dtype="float32", mesh=load)
    assert any(x.sharding.spec != PartitionSpec() for x in jax.tree.leaves(nnx.state(model)))  # fsdp-sharded
    model = on_sampling_mesh(model, sm)
    gc.collect()
    params = jax.tree.leaves(nnx.state(model))
    assert all(x.sharding == NamedSharding(sm, PartitionSpec()) for x in params)
    new = [x for x in jax.live_arrays() if id(x) not in before]
    on_load = [x for x in new if isinstance(x.sharding, NamedSharding) and x.sharding.mesh == load]
    assert not on_load, [(x.shape, x.sharding) for x in on_load[:5]]
    assert sum(x.nbytes for x in new) <= sum(x.nbytes for x in params)


def test_scripted_code_turns_on_a_row_subset_keep_the_split(tiny_checkpoint, six_items):  # noqa: F811
    """Half the rows write code on turn 0: no sandbox, so an error observation, appended to part
    of the batch; the rest decode in subsets. Every array with rows stays split over `data`."""
    import codedance_jax
    from eval import load_benchmark
    from eval.evaluate import on_sampling_mesh, sampling_mesh_of
    from eval.policy import EvalPrompt, RolloutPolicy

    prompts = [EvalPrompt(it.index, it.question, it.pil_images()) for it in load_benchmark("HRBench4K", six_items)]
    code = "<code>```python\nprint(1)\n```</code>"
    out = {}
    for name in ("all", "one"):
        (d, t), _ = MESHES[name]
        c = _config(tiny_checkpoint, six_items, d, t)
        mesh = sampling_mesh_of(c)
        model, processor = codedance_jax.from_pretrained(tiny_checkpoint, dtype="float32")
        model = on_sampling_mesh(model, mesh)
        policy = RolloutPolicy(model, processor, max_turns=2, rollout=dict(c.rollout), mesh=mesh,
                               script=lambda row, turn: code if (turn == 0 and row % 2 == 0) else None)
        out[name] = policy(prompts)
        if name == "all":
            assert policy.stats[-1]["appends"] >= 1
            eng = policy.engine
            for arr in (eng.cache.k[0], eng.cache.v[-1], eng.cache.valid, eng.cache.next_pos, eng.logits):
                assert arr.sharding.spec[0] == "data", arr.sharding
                assert {s.data.shape[0] for s in arr.addressable_shards} == {arr.shape[0] // 8}
            again = policy(prompts)  # nothing compiles twice on the split (the cache's creation included)
            assert policy.stats[-1]["compiles"] == 0 and [t.tokens for t in again] == [t.tokens for t in out[name]]
    split, whole = out["all"], out["one"]
    assert [t.turn_status[0] for t in split[::2]] == ["crashed"] * 3  # code without a sandbox: an error observation
    assert all(len(t.turn_status) == 2 for t in split[::2])  # ... appended, then a second turn
    assert [t.turn_status for t in split] == [t.turn_status for t in whole]
    assert [t.tokens for t in split] == [t.tokens for t in whole]
    for a, b in zip(split, whole, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_batch_multiple_must_split_over_the_sampling_mesh(tiny_checkpoint, six_items):  # noqa: F811
    from codedance_jax.errors import ConfigError
    from eval.evaluate import evaluate

    with pytest.raises(ConfigError, match=r"batch_multiple=4 is not a multiple of the sampling mesh's 8 data slices "
                                          r"\(config.rollout.mesh_data=-1"):
        evaluate(_config(tiny_checkpoint, six_items, batch_multiple=4), "/nonexistent/never_written")
