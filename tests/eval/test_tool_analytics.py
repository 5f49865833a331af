"""Tool-use analytics: calls resolved from a cell's AST, per-group statistics, calls not in the SFT
data, per-step curves of GRPO records."""

import json

import numpy as np
import pytest

from eval.tool_analytics import analyze, cell_calls, library, record_step, sft_calls, step_curves

CROP_DRAW = """
from PIL import Image, ImageDraw as D, ImageEnhance
import numpy
import matplotlib.pyplot as plt
im = Image.open('image.png').convert('RGB')
w, h = im.size
part = im.crop((0, 0, w // 2, h // 2)).resize((224, 224))
d = D.Draw(part)
d.rectangle([0, 0, 10, 10], outline='red')
arr = numpy.asarray(ImageEnhance.Contrast(part).enhance(2.0))
print(arr[:, :, 0].max(), (arr > 3).sum())
plt.imshow(arr)
thing.method()
"""
COUNT = """
import numpy as np
import cv2
from PIL import Image
img = np.array(Image.open('image.png'))
n, labels = cv2.connectedComponents(np.any(img != 255, axis=-1).astype(np.uint8))
ys, xs = np.nonzero(labels)
print(n - 1, ys.min())
"""


def test_cell_calls_resolve_imports_and_types():
    c = cell_calls(CROP_DRAW)
    assert c.parsed
    for call in ("PIL.Image.open", "PIL.Image.convert", "PIL.Image.crop", "PIL.Image.resize", "PIL.ImageDraw.Draw",
                 "PIL.ImageDraw.rectangle", "PIL.ImageEnhance.Contrast", "PIL.ImageEnhance.enhance", "numpy.asarray",
                 "numpy.max", "numpy.sum", "matplotlib.pyplot.imshow", "print", "?.method"):
        assert call in c.calls, call
    assert c.libraries == ("PIL.Image", "PIL.ImageDraw", "PIL.ImageEnhance", "builtins", "matplotlib", "numpy")
    k = cell_calls(COUNT)
    assert {"cv2.connectedComponents", "numpy.any", "numpy.astype", "numpy.nonzero", "numpy.min"} <= set(k.calls)
    assert "?.min" not in k.calls  # `ys` came out of np.nonzero: an array
    bad = cell_calls("def f(:\n")
    assert not bad.parsed and bad.calls == ()
    assert library("PIL.Image.crop") == "PIL.Image" and library("print") == "builtins" and library("?.x") is None


def _rec(pid, family, cells, policy=None, status="ok"):
    turns = [{"status": status, "code": code} for code in cells] + [{"status": "no_code", "code": None}]
    return {"prompt_id": pid, "meta": {"family": family}, "turns": turns, "policy": policy}


def test_analyze_groups_and_calls_not_in_sft(tmp_path):
    sft = tmp_path / "sft.jsonl"
    block = "<code>\n```python\n" + COUNT.strip() + "\n```\n</code>"
    with open(sft, "w") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "q"},
                                         {"role": "assistant", "content": "<think>t</think>\n" + block},
                                         {"role": "observation", "content": "3"},
                                         {"role": "assistant", "content": "<answer>3</answer>"}]}) + "\n")
    seen = sft_calls([str(sft)])
    assert seen == set(cell_calls(COUNT).calls)
    rng = np.random.default_rng()
    n_crop, n_count = int(rng.integers(1, 5)), int(rng.integers(1, 5))
    recs = ([_rec(f"f{i}", "find", [CROP_DRAW]) for i in range(n_crop)]
            + [_rec(f"c{i}", "count", [COUNT, COUNT]) for i in range(n_count)]
            + [_rec("x", "count", [])]  # no code
            + [_rec("y", "count", [CROP_DRAW], status="no_code")])  # not executed: not a cell
    a = analyze(recs, ("family",), seen)
    assert a["all"]["with_code"] == n_crop + n_count and a["all"]["cells"] == n_crop + 2 * n_count
    assert a["family=count"]["trajectories"] == n_count + 2 and a["family=count"]["cells"] == 2 * n_count
    find = a["family=find"]
    assert find["behaviour_cell_rate"]["crop"] == 1.0 and find["behaviour_cell_rate"]["draw"] == 1.0
    assert a["family=count"]["behaviour_cell_rate"]["cv2"] == 1.0 and a["family=count"]["behaviour_cell_rate"]["crop"] == 0
    assert a["all"]["behaviour_cell_rate"]["crop"] == pytest.approx(n_crop / (n_crop + 2 * n_count))
    assert a["family=count"]["novel_cell_rate"] == 0 and find["novel_cell_rate"] == 1.0
    novel = dict(map(tuple, a["all"]["novel_calls"]))
    assert novel["PIL.Image.crop"] == n_crop and "numpy.nonzero" not in novel and "?.method" not in novel
    assert dict(map(tuple, a["family=count"]["compositions"])) == pytest.approx({"PIL.Image+cv2+numpy": 1.0})
    assert a["family=find"]["library_cell_rate"]["matplotlib"] == 1.0


def test_step_curves_from_grpo_records():
    recs = [_rec("a", "find", [CROP_DRAW], policy="/w/grpo/policies/step_0"),  # loop index 0 = metrics step 1
            _rec("b", "find", [COUNT], policy="/w/grpo/policies/step_0"),
            _rec("c", "find", [COUNT], policy="/w/grpo/policies/step_1"),
            _rec("d", "find", [], policy="/w/grpo/policies/step_1"),
            _rec("e", "find", [CROP_DRAW], policy="/w/sft/policy")]  # no step: left out
    assert record_step(recs[2]) == 2 and record_step(recs[4]) is None
    rows = step_curves(recs, seen=set(cell_calls(COUNT).calls))
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["behaviour/crop"] == 0.5 and rows[1]["behaviour/crop"] == 0.0
    assert rows[0]["novel_cell_rate"] == 0.5 and rows[1]["novel_cell_rate"] == 0.0
    assert rows[1]["cells_per_traj"] == 0.5 and rows[0]["library/cv2"] == 0.5
