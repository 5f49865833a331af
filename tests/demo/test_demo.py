"""The demo end to end with the miniature preset, as users run it (`python -m launch.demo`, then
`python -m launch.ablate`, on one CPU device): every phase runs and the report has finite figures."""

import json
import math
import os
import subprocess
import sys

import pytest
from launch_env import REPO, launcher_env


def _launch(module, workdir, *flags):
    cmd = [sys.executable, "-m", f"launch.{module}", "--config=configs/demo.py:mini", f"--workdir={workdir}", *flags]
    out = subprocess.run(cmd, cwd=REPO, env=launcher_env(), capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-4000:])


@pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0, reason="the sandbox needs Linux and root")
def test_demo_mini_writes_the_report(tmp_path):
    _launch("demo", tmp_path)
    report = tmp_path / "report"
    summary = json.loads((report / "summary.json").read_text())
    for name in ("report.md", "report.html", "summary.json"):
        assert (report / name).stat().st_size > 0, name
    assert list((report / "plots").glob("*.png")), "no training-curve plot was drawn"
    for name in ("sft", "grpo"):
        ev = summary["evals"][name]
        assert ev["n"] == 12
        for k in ("accuracy", "avg_turns", "tool_rate", "tool_calls"):
            assert math.isfinite(ev[k]), (name, k)
    # Sampled evaluations (eval.samples = 2 draws per item) beside the greedy ones, every rate with its
    # 95% interval, in summary.json and in the report's tables.
    # The probes (world/eval/probes.jsonl: yellow easy count, colour-and-kind hard count) go greedy beside
    # each evaluation, apart from the test grid (issue 47).
    assert list(summary["evals"]) == ["sft", "sft_sampled", "sft_probes", "grpo", "grpo_sampled", "grpo_probes"]
    for name in ("sft_probes", "grpo_probes"):
        ev = summary["evals"][name]
        assert ev["n"] == 4 and {"probe=yellow_easy_count/accuracy", "probe=color_kind_count/accuracy"} <= set(ev)
    for name in ("sft_sampled", "grpo_sampled"):
        ev = summary["evals"][name]
        assert ev["n"] == 24 and ev["n_items"] == 12 and ev["samples_per_item"] == 2
    for name, ev in summary["evals"].items():
        if name.endswith("_probes"):
            continue
        for k in ("accuracy", "tool_rate", "difficulty=hard/accuracy", "family=find,difficulty=easy/tool_rate"):
            lo, hi = ev[f"{k}_ci95"]
            assert 0 <= lo <= ev[k] <= hi <= 1, k
    md = (report / "report.md").read_text()
    assert "## Changes" in md and "grpo_sampled - sft_sampled" in md and "## Tool use" in md
    lo, hi = summary["evals"]["sft_sampled"]["accuracy_ci95"]
    assert f"[{100 * lo:.1f}, {100 * hi:.1f}]" in md
    # GRPO's rollouts of every step (trajectories_every = 1 here) give per-step rates by difficulty.
    assert [r["step"] for r in summary["grpo_step_rates"]] == [1, 2]
    for r in summary["grpo_step_rates"]:  # 2 prompts a step: easy, hard or both
        rates = [v for k, v in r.items() if k in ("difficulty=easy/tool_rate", "difficulty=hard/tool_rate")]
        assert rates and all(0 <= v <= 1 for v in rates) and r["n"] == 8
    assert (report / "plots" / "grpo_step_rates.png").stat().st_size > 0
    # How far GRPO moved the policy from SFT, per saved step (eval.drift): k3 is >= 0 per token.
    assert [r["step"] for r in summary["policy_drift"]] == [1, 2]
    assert all(r["kl_k3"] >= 0 and math.isfinite(r["kl_k1"]) and r["tokens"] > 0 for r in summary["policy_drift"])
    assert "KL(sampling policy || SFT policy)" in md
    world = json.loads((tmp_path / "world" / "world.json").read_text())
    # world.json records the config's calibration knobs and what they produced.
    from configs import demo as demo_configs

    knobs_c = demo_configs.get_config("mini")
    knobs = knobs_c.world
    for k in ("hard_direct_rate", "error_rate", "easy_code_rate"):
        assert world[k] == knobs[k], k
    for k in ("easy_code_families", "hard_direct_families", "bars_questions",
              "count_questions", "easy_count_colors"):
        assert world[k] == list(knobs[k]), k
    assert set(world["easy_items_with_code_by_family"]) <= set(knobs.easy_code_families)
    assert set(world["hard_items_direct_by_family"]) <= set(knobs.hard_direct_families)
    # The SFT policy per cell, greedy beside sampled (eval.calibration), written before GRPO, on the
    # validation split (eval.calibration_items of it), never the test split (issue 47).
    cal = json.loads((tmp_path / "calibration.json").read_text())
    assert cal["cells"]["all"]["n_items"] == knobs_c.eval.calibration_items == 6 and cal["cells"]["all"]["k"] == 2
    assert "pass@2" in (tmp_path / "calibration.md").read_text()
    assert "validation split" in (tmp_path / "calibration.md").read_text()
    val_ids = {json.loads(x)["prompt_id"] for x in open(tmp_path / "val_sft" / "trajectories.jsonl")}
    assert val_ids and all(i.startswith("val-") for i in val_ids)
    rows = [json.loads(x) for x in open(tmp_path / "grpo" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["reward/total"]) for r in rows)
    sft_rows = [json.loads(x) for x in open(tmp_path / "sft" / "metrics.jsonl")]
    assert sft_rows and all(math.isfinite(r["loss"]) for r in sft_rows)
    # Both loops compiled their shape plan before step 1 (issue 36): no step compiles anything.
    assert [r["compilations"] for r in rows + sft_rows] == [0] * (len(rows) + len(sft_rows))
    assert json.loads((tmp_path / "grpo" / "shape_plan.json").read_text())["compilations"] >= 0
    # The held-out trajectories carry what the report shows, and their images exist.
    rec = json.loads(open(tmp_path / "eval_grpo" / "trajectories.jsonl").readline())
    assert rec["meta"]["family"] in ("count", "bars", "find") and isinstance(rec["text"], str)
    assert all((tmp_path / "eval_grpo" / p).exists() for p in rec["images"])

    # The ablation runner reuses the world and SFT policy and prints Table 3's rows: here one R_BAT
    # row under the release preset at GRPO seed 5 (the presets and seeds of item 4 of issue 18).
    _launch("ablate", tmp_path, "--modes=full", "--presets=release", "--seeds=5")
    results = json.loads((tmp_path / "ablation.json").read_text())
    run = "full@release/seed5"
    assert list(results) == ["sft", "sft_sampled", "sft_probes", run, f"{run}_sampled", f"{run}_probes", f"{run}_drift",
                             "rows", "table", "seconds"]
    assert results["rows"][-1] == ["R_BAT (full), release preset, sampled (k=2)", [f"{run}_sampled"]]
    assert [r["step"] for r in results[f"{run}_drift"]] == [1, 2]
    assert results[run]["kl_to_sft"] == results[f"{run}_drift"][-1]["kl_k3"] >= 0
    assert results["table"]["R_BAT (full), release preset"]["kl_to_sft"]["n"] == 1
    assert results["sft_sampled"]["time_s"] == summary["evals"]["sft_sampled"]["time_s"]  # reused, not re-run
    assert results["table"]["R_BAT (full), release preset"]["accuracy"]["n"] == 1
    assert results["seconds"]["full@release"] > 0
    run_cfg = json.loads((tmp_path / "ablate" / run / "run_config.json").read_text())["config"]
    assert run_cfg["seed"] == 5 and run_cfg["rbat.preset"] == "release" and run_cfg["rbat.mode"] == "full"
    table = (tmp_path / "ablation.md").read_text()
    assert "SFT cold start" in table and "| R_BAT (full), release preset | 1 |" in table
    assert "R_BAT (full), release preset, sampled (k=2)" in table and "seeds 5" in table
    assert (tmp_path / "ablate" / run / "policy" / "codedance.json").exists()
