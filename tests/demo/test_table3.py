"""Table 3's rows and its mean ± std over seeds (runs/demo/table3.py)."""

import math
import random
import re

import numpy as np
import pytest

from runs.demo import table3


def test_rows_split_the_rbat_modes_by_preset_only():
    rows = table3.rows(("outcome", "tool_bonus", "no_turn", "full"), ("paper", "release"))
    assert [r.key for r in rows] == ["outcome", "tool_bonus", "no_turn@paper", "no_turn@release", "full@paper",
                                     "full@release"]
    assert rows[-1].label == "R_BAT (full), release preset" and rows[0].label == "GRPO (R_acc + R_format)"
    assert [r.key for r in table3.rows(("full", "outcome"))] == ["full", "outcome"]
    assert table3.run_name(rows[2], None) == "no_turn@paper" and table3.run_name(rows[2], 3) == "no_turn@paper/seed3"
    with pytest.raises(ValueError, match="unknown reward variants.*fulll"):
        table3.rows(("fulll",))


def _summary(rng):
    return {col: rng.uniform(0, 3) if col == "avg_turns" else rng.random() for col, _ in table3.COLUMNS}


def test_mean_and_sample_std_over_seeds_against_the_formula():
    rng = random.Random(7)
    runs = [_summary(rng) for _ in range(rng.randint(2, 5))]
    runs[0]["exec_success"] = float("nan")  # a run without executions does not count for that column
    agg = table3.aggregate(runs)
    for col, _ in table3.COLUMNS:
        vals = [r[col] for r in runs if math.isfinite(r[col])]
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
        assert agg[col]["n"] == len(vals)
        assert agg[col]["mean"] == pytest.approx(mean) and agg[col]["std"] == pytest.approx(std)
    md = table3.markdown([("R_BAT (full)", runs)], title="t")
    row = next(line for line in md.splitlines() if line.startswith("| R_BAT (full) |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == str(len(runs))
    acc = agg["accuracy"]
    assert cells[2] == f"{100 * acc['mean']:.1f} ± {100 * acc['std']:.1f}%"
    turns = agg["avg_turns"]
    assert cells[3] == f"{turns['mean']:.2f} ± {turns['std']:.2f}"


def test_one_run_shows_its_interval_and_zero_std():
    rng = random.Random(11)
    run = _summary(rng)
    run["accuracy_ci95"] = [run["accuracy"] - 0.05, run["accuracy"] + 0.04]
    agg = table3.aggregate([run])
    assert agg["accuracy"]["std"] == 0.0 and agg["accuracy"]["n"] == 1
    md = table3.markdown([("SFT cold start", [run])], title="t")
    assert re.search(r"\| SFT cold start \| 1 \| \d+\.\d% \[\d+\.\d, \d+\.\d\] \|", md)


def test_kl_column_shows_mean_and_std_of_the_runs_that_have_it():
    rng = np.random.default_rng()
    kl = rng.uniform(0.001, 0.1, size=3)
    runs = [{"accuracy": float(rng.uniform()), "kl_to_sft": float(v)} for v in kl]
    md = table3.markdown([("SFT cold start", [{"accuracy": 0.5}]), ("R_BAT (full)", runs)], title="t")
    sft_line, row_line = [x for x in md.splitlines() if x.startswith("| SFT") or x.startswith("| R_BAT")]
    assert sft_line.rstrip(" |").endswith("n/a")
    assert row_line.rstrip(" |").endswith(f"{kl.mean():.4f} ± {kl.std(ddof=1):.4f}")
