"""`eval.calibration`: per cell, greedy beside sampled behaviour, against counts written out by hand."""

import math

import pytest

from eval import calibration


def _rec(pid, fam, diff, correct, calls):
    return {"prompt_id": pid, "correct": correct, "num_tool_calls": calls, "meta": {"family": fam, "difficulty": diff}}


def test_cells_against_hand_counts():
    # find/hard: greedy answers by sight and is wrong on both items; of 4 draws each, the code draws
    # are right and the sight draws wrong. bars/easy: right every time, code in 3 of 8 draws.
    greedy = [_rec("f1", "find", "hard", False, 0), _rec("f2", "find", "hard", False, 0),
              _rec("b1", "bars", "easy", True, 0), _rec("b2", "bars", "easy", True, 1)]
    sampled = [_rec("f1", "find", "hard", c, c) for c in (True, False, False, False)]
    sampled += [_rec("f2", "find", "hard", False, 0) for _ in range(4)]
    sampled += [_rec("b1", "bars", "easy", True, k) for k in (1, 0, 0, 0)]
    sampled += [_rec("b2", "bars", "easy", True, k) for k in (1, 1, 0, 0)]
    sampled += [_rec("x9", "bars", "easy", True, 0)]  # not in the greedy evaluation: left out
    t = calibration.cells(greedy, sampled)
    f, b, a = t["family=find,difficulty=hard"], t["family=bars,difficulty=easy"], t["all"]
    assert f["n_items"] == 2 and f["greedy_acc"] == 0 and f["greedy_tool_rate"] == 0
    assert f["sampled_acc"] == pytest.approx(1 / 8) and f["pass_at_k"] == 0.5 and f["k"] == 4
    assert f["sampled_tool_rate"] == pytest.approx(1 / 8) and f["acc_with_code"] == 1.0
    assert f["acc_without_code"] == 0.0 and f["gap"] == 0.5
    assert b["greedy_tool_rate"] == 0.5 and b["sampled_tool_rate"] == pytest.approx(3 / 8) and b["gap"] == 0
    assert a["n_items"] == 4 and a["sampled_acc"] == pytest.approx(9 / 16) and a["pass_at_k"] == 0.75
    assert calibration.learnable(f) and not calibration.learnable(b)
    assert not calibration.learnable({**f, "acc_with_code": math.nan})  # no code draw: nothing shows code works
    md = calibration.markdown(t)
    assert "| family=find,difficulty=hard | 2 | 0.0 | 0.0 | 12.5 | 50.0 | 12.5 | 100.0 | 0.0 | yes |" in md
    assert "pass@4" in md
