"""`python -m launch.eval` end to end with the tiny random model (real tokenizer files) on a 3-item fixture,
then a restart: scored items are not rolled out again (partial resume is tested with a scripted policy in
test_report_browser.py; a second rollout here would cost a second compile)."""

import json
import os
import subprocess
import sys

import pytest
from eval_fixtures import write_tsv

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """What `quickstart.make_random_checkpoint(d, ModelConfig.tiny())` writes (HF safetensors + real Qwen
    tokenizer files), with the weights drawn in numpy: its eager NNX init takes ~15 s on 8 CPU devices."""
    import numpy as np

    from codedance_jax.checkpoint import hf
    from codedance_jax.checkpoint.build import model_from_tensors
    from codedance_jax.model.config import ModelConfig
    from codedance_jax.processing.reference_files import write_qwen25vl_processor_files

    rng = np.random.default_rng(0)
    model = model_from_tensors(
        ModelConfig.tiny(),
        lambda r: (0.05 * rng.standard_normal(r.hf_shape)).astype(np.float32) + (1.0 if "norm" in r.hf_name else 0.0),
    )
    d = str(tmp_path_factory.mktemp("tiny_ckpt"))
    hf.export_hf(model, d)
    write_qwen25vl_processor_files(d, max_pixels=448 * 448)
    return d


def _launch(ckpt, data, wd, *extra):
    cmd = [
        sys.executable,
        "-m",
        "launch.eval",
        "--config=configs/eval.py:HRBench4K",
        f"--config.checkpoint={ckpt}",
        f"--config.data_path={data}",
        f"--workdir={wd}",
        "--config.dtype=float32",
        "--config.batch_size=4",
        "--config.max_turns=2",
        "--config.sandbox.kind=none",
        "--config.rollout.max_turn_tokens=12",
        "--config.rollout.max_new_tokens=24",
        "--config.rollout.max_total_tokens=448",
        "--config.rollout.batch_multiple=8",  # the default sampling mesh: every one of the 8 devices
        "--config.rollout.prompt_buckets=(384,)",
        "--config.rollout.obs_buckets=(64,)",
        "--config.rollout.decode_chunk=12",
        *extra,
    ]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    return r


def test_launch_eval_end_to_end_and_resume(tmp_path, tiny_checkpoint):
    data = write_tsv(str(tmp_path), "HRBench4K")
    wd = str(tmp_path / "run")
    _launch(tiny_checkpoint, data, wd)
    preds = [json.loads(x) for x in open(os.path.join(wd, "predictions.jsonl"))]
    assert [p["index"] for p in preds] == ["100", "101", "102"]
    trajs = [json.loads(x) for x in open(os.path.join(wd, "trajectories.jsonl"))]
    for t in trajs:
        assert len(t["tokens"]) == len(t["loss_mask"]) == len(t["turn_ids"]) == len(t["logprobs"])
        assert sum(t["loss_mask"]) > 0 and t["temperature"] == 1.0
        assert t["policy"] == os.path.abspath(tiny_checkpoint)
        assert t["rule_verdict"] in ("correct", "wrong", "deferred") and t["images"]
        assert all(os.path.isfile(os.path.join(wd, p)) for p in t["images"])
    # Restart: every item is already scored, nothing is rolled out, the files are rewritten.
    os.remove(os.path.join(wd, "report.html"))
    r = _launch(tiny_checkpoint, data, wd)
    assert "3 items, 3 already scored, 0 to run" in r.stderr
    preds = [json.loads(x) for x in open(os.path.join(wd, "predictions.jsonl"))]
    assert [p["index"] for p in preds] == ["100", "101", "102"]
    s = json.load(open(os.path.join(wd, "summary.json")))
    assert s["items"] == 3 and s["paper_codedance_7b"] == 75.2 and s["headline_metric"] == "mean over cycle_category"
    assert s["avg_turns"] >= 1
    html = open(os.path.join(wd, "report.html")).read()
    assert html.count('class="item ') == 3 and "75.2" in html
    for name in ("predictions.tsv", "summary.md", "config.json", "rollout_stats.jsonl"):
        assert os.path.isfile(os.path.join(wd, name)), name
    stats = [json.loads(x) for x in open(os.path.join(wd, "rollout_stats.jsonl"))]  # sampled on all 8 devices
    assert stats and all(st["sampling_devices"] == 8 and st["sampling_mesh"] == {"data": 8, "fsdp": 1, "tensor": 1}
                         for st in stats)
    tools = json.load(open(os.path.join(wd, "tool_use.json")))["all"]  # the executed cells' analytics
    assert tools["trajectories"] == 3 and tools["cells"] == sum(  # a malformed block (code None) never ran
        sum(u["status"] in ("ok", "error", "timeout", "crashed") and u["code"] is not None for u in t["turns"])
        for t in trajs)


def test_every_benchmark_format_through_the_rollout_engine(tmp_path, tiny_checkpoint):
    """Each benchmark's TSV and release fixture, rolled out by the tiny model through RolloutEngine
    (one policy, so one compile), scored, summarized and reported."""
    from eval_fixtures import BENCHES, write_released

    import codedance_jax
    from eval import load_benchmark, run_eval, write_report
    from eval.policy import RolloutPolicy

    model, processor = codedance_jax.from_pretrained(tiny_checkpoint)
    rollout = dict(
        max_turn_tokens=8,
        max_new_tokens=16,
        max_total_tokens=448,
        batch_multiple=8,
        prompt_buckets=(384,),
        obs_buckets=(64,),
        decode_chunk=8,
    )
    policy = RolloutPolicy(model, processor, max_turns=2, sandbox=None, rollout=rollout)
    for bench in BENCHES:
        for fmt in ("tsv", "released"):
            d = tmp_path / f"{bench}-{fmt}"
            d.mkdir()
            path = write_tsv(str(d), bench) if fmt == "tsv" else write_released(str(d), bench)
            items = load_benchmark(bench, path)
            wd = str(d / "run")
            s = run_eval(bench, items, policy, wd, batch_size=8, log=lambda m: None)
            assert s["items"] == 3 and s["paper_codedance_7b"] is not None, (bench, fmt)
            trajs = [json.loads(x) for x in open(os.path.join(wd, "trajectories.jsonl"))]
            assert [t["prompt_id"] for t in trajs] == [it.index for it in items]
            assert all(sum(t["loss_mask"]) > 0 for t in trajs)
            assert write_report(wd, s).endswith("report.html")
