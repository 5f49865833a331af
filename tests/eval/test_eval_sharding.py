"""Evaluation's batch split over the mesh's data axis (the test session's 8 CPU devices): the same
predictions as the batch on no data axis, with the KV cache and logits really laid out by rows.

`launch.eval`'s `evaluate(config, workdir)` in this process with mesh data=4 x fsdp=2 against the
default mesh (fsdp over all devices, rows not split); then a scripted rollout on the same meshes
and shapes (one compile of each step for both tests) whose rows write code on turn 0, so that
observations are appended to a row subset of the batch and decoding goes on in subsets."""

import json
import os

import jax
import numpy as np
import pytest
from eval_fixtures import write_tsv
from jax.sharding import PartitionSpec
from test_launch_eval import tiny_checkpoint  # noqa: F401 - the fixture is used by name

ROLLOUT = dict(max_turn_tokens=24, max_new_tokens=40, max_total_tokens=448, batch_multiple=4, prompt_buckets=(384,),
               obs_buckets=(64,), decode_chunk=12)
MESHES = {"split": (4, 2), "whole": (1, -1)}  # (data, fsdp); "whole" is configs/eval.py's default


@pytest.fixture(scope="module")
def six_items(tmp_path_factory):
    """HRBench4K's three fixture items twice: 6 prompts, 8 rows (batch_multiple 4), 2 rows per data slice."""
    return write_tsv(str(tmp_path_factory.mktemp("hr6")), "HRBench4K", repeat=2)


def _config(ckpt, data_path, data, fsdp):
    from configs.eval import get_config

    c = get_config("HRBench4K")
    c.checkpoint, c.data_path, c.dtype = ckpt, data_path, "float32"
    c.mesh.data, c.mesh.fsdp = data, fsdp
    c.batch_size, c.max_turns, c.sandbox.kind = 8, 2, "none"
    c.rollout.update(ROLLOUT)
    return c


def _jsonl(path):
    return [json.loads(x) for x in open(path)]


def test_launch_eval_splits_rows_over_the_data_axis(tmp_path, tiny_checkpoint, six_items):  # noqa: F811
    from eval.evaluate import evaluate

    assert jax.device_count() == 8
    runs = {}
    for name, (d, f) in MESHES.items():
        wd = str(tmp_path / name)
        evaluate(_config(tiny_checkpoint, six_items, d, f), wd)
        runs[name] = [_jsonl(os.path.join(wd, n)) for n in ("predictions.jsonl", "rollout_stats.jsonl",
                                                            "trajectories.jsonl")]
    (p_split, st_split, t_split), (p_whole, st_whole, t_whole) = runs["split"], runs["whole"]
    assert [p["index"] for p in p_split] == [p["index"] for p in p_whole] == [str(100 + i) for i in range(6)]
    assert [p["prediction"] for p in p_split] == [p["prediction"] for p in p_whole]
    assert [t["tokens"] for t in t_split] == [t["tokens"] for t in t_whole]
    assert all(sum(t["loss_mask"]) > 0 for t in t_split)  # the model did generate
    np.testing.assert_allclose(sum((t["logprobs"] for t in t_split), []), sum((t["logprobs"] for t in t_whole), []),
                               atol=1e-5)
    # rows split over `data`, the other dimensions whole (`RowPlacement.settle`'s one layout per shape)
    rows = {"cache.k": str(PartitionSpec("data", None, None, None)), "cache.valid": str(PartitionSpec("data", None)),
            "logits": str(PartitionSpec("data", None))}
    assert st_split and all(s["row_shardings"] == rows
                            for s in st_split)
    assert all("data" not in json.dumps(s["row_shardings"]) for s in st_whole)  # default mesh: rows not split


def test_scripted_code_turns_on_a_row_subset_keep_the_split(tiny_checkpoint, six_items):  # noqa: F811
    """Half the rows write code on turn 0: no sandbox, so an error observation, appended to a 4-row
    subset of the 8; the rest decode in subsets. Every array with rows stays split over `data`."""
    import codedance_jax
    from codedance_jax.sharding import make_mesh
    from eval import load_benchmark
    from eval.policy import EvalPrompt, RolloutPolicy

    prompts = [EvalPrompt(it.index, it.question, it.pil_images()) for it in load_benchmark("HRBench4K", six_items)]
    code = "<code>```python\nprint(1)\n```</code>"
    out = {}
    for name, (d, f) in MESHES.items():
        mesh = make_mesh(d, f, 1)
        model, processor = codedance_jax.from_pretrained(tiny_checkpoint, dtype="float32", mesh=mesh)
        policy = RolloutPolicy(model, processor, max_turns=2, rollout=ROLLOUT, mesh=mesh,
                               script=lambda row, turn: code if (turn == 0 and row % 2 == 0) else None)
        out[name] = policy(prompts)
        if name == "split":
            assert policy.stats[-1]["appends"] >= 1
            eng = policy.engine
            for arr in (eng.cache.k[0], eng.cache.v[-1], eng.cache.valid, eng.cache.next_pos, eng.logits):
                assert arr.sharding.spec[0] == "data", arr.sharding
                assert {s.data.shape[0] for s in arr.addressable_shards} == {arr.shape[0] // 4}
            again = policy(prompts)  # nothing compiles twice on the split (the cache's creation included)
            assert policy.stats[-1]["compiles"] == 0 and [t.tokens for t in again] == [t.tokens for t in out[name]]
    split, whole = out["split"], out["whole"]
    assert [t.turn_status[0] for t in split[::2]] == ["crashed"] * 3  # code without a sandbox: an error observation
    assert all(len(t.turn_status) == 2 for t in split[::2])  # ... appended, then a second turn
    assert [t.turn_status for t in split] == [t.turn_status for t in whole]
    assert [t.tokens for t in split] == [t.tokens for t in whole]
    for a, b in zip(split, whole, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_batch_multiple_must_split_over_the_data_axis(tiny_checkpoint):  # noqa: F811
    import codedance_jax
    from codedance_jax.errors import ConfigError
    from codedance_jax.sharding import make_mesh
    from eval.policy import RolloutPolicy

    mesh = make_mesh(8, 1, 1)
    model, processor = codedance_jax.from_pretrained(tiny_checkpoint, mesh=mesh)
    with pytest.raises(ConfigError, match="batch_multiple=4 is not a multiple of the mesh's data axis"):
        RolloutPolicy(model, processor, rollout=ROLLOUT, mesh=mesh)
