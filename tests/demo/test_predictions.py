"""Issue 47's predictions P1-P7 judged from ablation files (runs/demo/predictions.py), on hand-built
runs whose verdicts are known: each prediction passes on one set of numbers and fails when one of its
figures crosses its threshold."""

import json
import os

import pytest

from runs.demo import predictions
from runs.demo.predictions import CELLS

WORLDS, SEEDS = (2, 3, 4), (0, 1, 2)


def _summary(acc_cells: dict, easy_tool: float, hard_tool: float, turns: float) -> dict:
    s = {f"{c}/accuracy": a for c, a in acc_cells.items()}
    s.update({"accuracy": sum(acc_cells.values()) / len(acc_cells), "avg_turns": turns,
              "difficulty=easy/tool_rate": easy_tool, "difficulty=hard/tool_rate": hard_tool})
    return s


def _write(d, summary, items, steps=None):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "summary.json"), "w") as f:
        json.dump(summary, f)
    with open(os.path.join(d, "trajectories.jsonl"), "w") as f:
        for pid, (ok, probe) in items.items():
            f.write(json.dumps({"prompt_id": pid, "correct": bool(ok), "meta": {"probe": probe}}) + "\n")


def _items(n_right: int, n: int = 60) -> dict:
    """n items, the first n_right correct; every tenth a probe."""
    return {f"i{k}": (k < n_right, "touching" if k % 10 == 0 else "") for k in range(n)}


def _metrics(d, first_hard_step: int):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        for s in range(1, 11):
            f.write(json.dumps({"step": s, "difficulty=hard/tool_rate": 0.95 if s >= first_hard_step else 0.5}) + "\n")


def build(tmp_path, *, rbat_easy=0.05, rbat_gain=0.10, out_gain=0.09, cell_loss=0.0, rbat_first=3):
    base = {c: 0.8 for c in CELLS}
    for w in WORLDS:
        wd = tmp_path / f"world{w}"
        _write(wd / "eval_sft", _summary(base, 0.66, 0.70, 1.67), _items(48))
        for row, gain, easy, turns, first in (("outcome", out_gain, 0.60, 1.80, 6), ("full", rbat_gain, rbat_easy, 1.50,
                                                                                         rbat_first)):
            for s in SEEDS:
                cells = {c: a + gain for c, a in base.items()}
                cells[CELLS[0]] = 0.8 + cell_loss if cell_loss else cells[CELLS[0]]
                _write(wd / "ablate" / f"eval_{row}_seed{s}", _summary(cells, easy, 0.99, turns),
                       _items(48 + round(60 * gain)))
                _metrics(wd / "ablate" / row / f"seed{s}", first)
    return predictions.judge(predictions.load(str(tmp_path), WORLDS, SEEDS))


def _verdicts(v):
    return {x["id"]: x["passed"] for x in v}


def test_all_pass_then_each_threshold_fails(tmp_path):
    ok = _verdicts(build(tmp_path / "a"))
    assert ok == {"P1": True, "P2": True, "P3": True, "P4": False, "P5": True, "P6": True, "P7": True}
    assert _verdicts(build(tmp_path / "b", rbat_gain=0.12, out_gain=0.09))["P4"]  # +3 points, 9/9 positive
    assert not _verdicts(build(tmp_path / "c", rbat_easy=0.2))["P2"]  # R_BAT easy tool rate above 10%
    assert not _verdicts(build(tmp_path / "d", out_gain=0.03))["P3"]  # outcome-only below SFT + 5
    assert not _verdicts(build(tmp_path / "e", rbat_gain=0.18, out_gain=0.17))["P3"]  # a row mean above 97%
    assert not _verdicts(build(tmp_path / "f", rbat_first=8))["P5"]  # R_BAT later than outcome-only
    assert not _verdicts(build(tmp_path / "g", cell_loss=-0.1))["P7"]  # one cell 10 points down


def test_markdown_names_failures_and_probes(tmp_path):
    v = build(tmp_path)
    md = predictions.markdown(v)
    assert md.count("\n| P") == 7 and "**fail**" in md  # P4 fails here
    p7 = next(x for x in v if x["id"] == "P7")
    assert "touching: SFT 83.3%" in p7["measured"]  # 5 of the 6 probe items are among the first 48


def test_paired_gain_interval():
    runs = {"w": predictions.Run("w", None, {}, {"a": (0.0, {}), "b": (1.0, {})}, [])}
    after = [predictions.Run("w", 0, {}, {"a": (1.0, {}), "b": (1.0, {})}, [])]
    m, lo, hi = predictions.paired_gain(runs, after, "w")
    assert m == pytest.approx(0.5) and lo < m < hi
