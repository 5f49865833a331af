"""The demo end to end with the miniature preset: every phase runs and the report has finite figures."""

import json
import math
import os
import sys

import pytest


@pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0, reason="the sandbox needs Linux and root")
def test_demo_mini_writes_the_report(tmp_path):
    from codedance_jax.demo.pipeline import run
    from configs import demo

    summary = run(demo.get_config("mini"), str(tmp_path))
    report = tmp_path / "report"
    for name in ("report.md", "report.html", "summary.json"):
        assert (report / name).stat().st_size > 0, name
    assert list((report / "plots").glob("*.png")), "no training-curve plot was drawn"
    for name in ("sft", "grpo"):
        ev = summary["evals"][name]
        assert ev["n"] == 12
        for k in ("accuracy", "avg_turns", "tool_rate", "tool_calls"):
            assert math.isfinite(ev[k]), (name, k)
    rows = [json.loads(x) for x in open(tmp_path / "grpo" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["reward/total"]) for r in rows)
    sft_rows = [json.loads(x) for x in open(tmp_path / "sft" / "metrics.jsonl")]
    assert sft_rows and all(math.isfinite(r["loss"]) for r in sft_rows)
    # The held-out trajectories carry what the report shows, and their images exist.
    rec = json.loads(open(tmp_path / "eval_grpo" / "trajectories.jsonl").readline())
    assert rec["meta"]["family"] in ("count", "bars", "find") and isinstance(rec["text"], str)
    assert all((tmp_path / "eval_grpo" / p).exists() for p in rec["images"])

    # The ablation runner reuses the world and SFT policy and prints Table 3's rows.
    from codedance_jax.demo.pipeline import ablate

    results = ablate(demo.get_config("mini"), str(tmp_path), modes=("outcome",))
    assert list(results) == ["sft", "outcome"]
    table = (tmp_path / "ablation.md").read_text()
    assert "SFT cold start" in table and "GRPO (R_acc + R_format)" in table
    assert (tmp_path / "ablate" / "outcome" / "policy" / "codedance.json").exists()
