"""The toy preset as users run it: the weak model is our tiny policy behind a real `launch.serve`
process (random weights), teacher / judge / verifier the scripted stand-in; the output is SFT data."""

from configs.curate import get_config
from data.trajectory import read_jsonl
from runs.curate import pipeline


def test_toy_preset_with_launch_serve_as_weak_model(tmp_path):
    c = get_config("toy")
    c.source.num_items, c.stratify.k = 4, 1
    c.output.tfds = False
    rep = pipeline.run(c, str(tmp_path), log=lambda s: None)
    assert rep["cache"]["weak"]["requests"] == rep["stages"]["stratify"]["in"] > 0  # k=1: one per item
    # random weights never answer right: every validated item is hard and gets a multi-turn trajectory
    assert rep["difficulty"] == {"hard": rep["stages"]["stratify"]["in"]}
    trajs = list(read_jsonl([tmp_path / "sft.jsonl"]))
    assert len(trajs) == rep["kept"] > 0
    assert all(any(m.role == "observation" for m in t.messages) for t in trajs)
