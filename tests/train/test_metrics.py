"""metrics.jsonl across a resume: rows past the restored checkpoint are dropped, since the resumed
run writes them again (a kill between a row and its step's checkpoint must not duplicate it)."""

import json
import os

import numpy as np
import pytest

from codedance_jax.errors import DataError
from codedance_jax.train.metrics import MetricWriter, drop_rows_after


def _steps(path):
    return [json.loads(x)["step"] for x in open(path) if x.strip()]


def test_resumed_writer_drops_rows_past_its_start_and_keeps_the_rest(tmp_path):
    rng = np.random.default_rng()
    losses = rng.normal(size=6)
    w = MetricWriter(str(tmp_path), tensorboard=False)
    for step in range(1, 6):
        w.write(step, {"loss": losses[step]})
    w.write(3, {"eval/accuracy": 0.5})  # an evaluation row at a step that stays
    w.close()
    w = MetricWriter(str(tmp_path), tensorboard=False, start=3)  # resumed from the checkpoint at step 3
    w.write(4, {"loss": losses[0]})
    w.close()
    path = os.path.join(tmp_path, "metrics.jsonl")
    assert _steps(path) == [1, 2, 3, 3, 4]
    rows = [json.loads(x) for x in open(path)]
    assert [r["loss"] for r in rows if "loss" in r] == [float(losses[1]), float(losses[2]), float(losses[3]),
                                                       float(losses[0])]
    assert not os.path.exists(path + ".tmp")


def test_drop_rows_after_reads_the_step_through_step_of(tmp_path):
    path = os.path.join(tmp_path, "trajectories.jsonl")
    with open(path, "w") as f:
        for k in range(4):
            f.write(json.dumps({"policy": f"/w/policies/step_{k}"}) + "\n")
    n = drop_rows_after(path, 2, step_of=lambda r: int(r["policy"].rsplit("step_", 1)[1]) + 1)
    assert n == 2
    assert [json.loads(x)["policy"][-6:] for x in open(path)] == ["step_0", "step_1"]
    assert drop_rows_after(path, 2, step_of=lambda r: 0) == 0
    assert drop_rows_after(os.path.join(tmp_path, "absent.jsonl"), 0) == 0


def test_a_torn_last_row_is_dropped_on_resume(tmp_path):
    """A crash in the middle of a row's write leaves half a JSON line without its newline
    (issue 38): the resume drops it and appends after the last whole row; a last row that lost
    only its newline is kept and gets one; a broken row elsewhere is named, file and line."""
    path = os.path.join(tmp_path, "metrics.jsonl")
    rows = [json.dumps({"step": s, "loss": float(x)}) for s, x in enumerate(np.random.default_rng().normal(size=3), 1)]
    with open(path, "w") as f:
        f.write("\n".join(rows) + "\n" + rows[2][: len(rows[2]) // 2].replace('"step": 3', '"step": 4'))
    w = MetricWriter(str(tmp_path), tensorboard=False, start=3)
    w.write(4, {"loss": 1.0})
    w.close()
    assert _steps(path) == [1, 2, 3, 4]
    assert open(path).read().startswith("\n".join(rows) + "\n")

    with open(path, "w") as f:
        f.write("\n".join(rows))  # whole, only the last newline lost
    assert drop_rows_after(path, 3) == 0 and open(path).read() == "\n".join(rows) + "\n"

    with open(path, "w") as f:
        f.write(rows[0] + "\n" + rows[1][:9] + "\n" + rows[2] + "\n")
    with pytest.raises(DataError, match=r"metrics\.jsonl:2: not a JSON row"):
        drop_rows_after(path, 3)
