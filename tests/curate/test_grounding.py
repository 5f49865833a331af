"""Grounding (crop) trajectories from the Table 6 box: selection by config, the box reply parsed, the
crop run for real in the sandbox (its image is the marked region), single turn for medium items, the
real crop sent back to the teacher for hard ones, and the drops (`no_box`, `bad_box`)."""

import io
import json
import os

import numpy as np
import pytest
from PIL import Image

from codedance_jax.errors import UserError
from configs.curate import get_config
from data.toyworld.tasks import PALETTE
from runs.curate import grounding, pipeline, stages


def _medium_find(c, items):
    rows = [stages.stratify(c, r) for r in items if r["meta"]["family"] == "find" and r["meta"]["difficulty"] == "hard"]
    assert rows and all(r["difficulty"] == "medium" for r in rows)  # the scripted weak persona: pass@k 0.5
    return rows[0]


def _box(c, row):
    """The marked box of a toy item (what the scripted teacher "sees"; the item row does not carry it)."""
    return next(it.meta["box"] for it in pipeline.toy_items(c.cfg.source) if it.id == row["id"])


def _crop_shows_the_answer(c, row, rel):
    """The saved crop is the box enlarged, and holds the colour of the shape inside the box."""
    x1, y1, x2, y2 = _box(c, row)
    with Image.open(os.path.join(c.workdir, rel)) as im:
        crop = np.asarray(im.convert("RGB"))
    scale = max(1, c.cfg.synthesize.grounding.zoom_px // max(x2 - x1, y2 - y1))
    assert crop.shape[:2] == ((y2 - y1) * scale, (x2 - x1) * scale)
    assert np.all(crop == PALETTE[row["meta"]["true_answer"]], axis=-1).sum() > 0


def test_medium_item_single_turn_from_the_table6_box(ctx):
    c, items = ctx()
    row = _medium_find(c, items)
    t = stages.synthesize(c, row)
    assert t["mode"] == "grounding_single_turn" and t["cell_status"] == ["ok"]
    x1, y1, x2, y2 = _box(c, row)
    assert t["bbox"] == [x1, y1, x2, y2] and t["bbox_label"] == "marked box"
    roles = [m["role"] for m in t["messages"]]
    assert roles == ["user", "assistant", "observation", "assistant"]
    assert f"its box is [{x1}, {y1}, {x2}, {y2}]" in t["messages"][1]["content"]
    obs = t["messages"][2]
    assert obs["content"].startswith(f"crop ({x1}, {y1}, {x2}, {y2}) of (") and obs["num_images"] == 1
    assert len(t["images"]) == 2
    _crop_shows_the_answer(c, t, t["images"][1])
    assert t["messages"][3]["content"].endswith(f"<answer>{row['answer']}</answer>")  # the Table 8 reply
    assert stages.rule_filter(c, t).get("drop") is None and stages.cross_validate(c, t).get("drop") is None


def test_hard_item_multi_turn_gets_the_real_crop_back(ctx):
    c, items = ctx()
    row = {**_medium_find(c, items), "difficulty": "hard"}
    t = stages.synthesize(c, row)
    assert t["mode"] == "grounding_multi_turn" and t["cell_status"] == ["ok"]
    # the scripted teacher answers only when the feedback carries an image (the real crop)
    assert t["messages"][-1]["content"] == ("<think>The enlarged crop shows the shape inside the box clearly.</think>\n"
                                            f"<answer>{row['answer']}</answer>")
    _crop_shows_the_answer(c, t, t["images"][1])
    assert stages.rule_filter(c, t).get("drop") is None


def test_wrong_box_and_no_box_are_dropped(ctx):
    c, items = ctx(bad_box_rate=1.0)
    t = stages.synthesize(c, _medium_find(c, items))
    assert t["mode"] == "grounding_single_turn" and stages.rule_filter(c, t)["drop"] == "bad_box"
    c.cfg.synthesize.grounding.select = "all"  # a count item: the teacher finds no box
    count = next(stages.stratify(c, r) for r in items if r["meta"]["family"] == "count" and
                 r["meta"]["difficulty"] == "hard")
    out = stages.synthesize(c, count)
    assert out["drop"] == "no_box" and out["bbox_reply"] == "[]" and "messages" not in out


def test_selection_by_config():
    g = get_config("endpoints").synthesize.grounding
    row = {"question": "What is written on the small sign?", "meta": {"task": "crop"}}
    assert grounding.wanted(row, g)  # default: meta task in (grounding, crop)
    assert not grounding.wanted({**row, "meta": {"task": "math"}}, g)
    g.select = "question"
    assert grounding.wanted(row, g) and not grounding.wanted({**row, "question": "What is 2 + 3?"}, g)
    g.select = "off"
    assert not grounding.wanted(row, g)
    toy = get_config("toy").synthesize.grounding
    assert grounding.wanted({"question": "?", "meta": {"family": "find"}}, toy)
    assert not grounding.wanted({"question": "?", "meta": {"family": "count"}}, toy)
    g.select = "nearby"
    with pytest.raises(UserError, match="grounding.select='nearby' is unknown"):
        grounding.check(g)


@pytest.mark.parametrize("reply, want", [
    ('```json\n[{"label": "cup", "bbox_2d": [10, 20, 30, 40]}]\n```', [("cup", [10.0, 20.0, 30.0, 40.0])]),
    ('The object: {"label": "sign", "bbox_2d": [1.5, 2, 3, 4]}.', [("sign", [1.5, 2.0, 3.0, 4.0])]),
    ('[{"label": "a", "bbox_2d": [1, 2, 3]}, {"bbox_2d": [5, 6, 7, 8]}]', [("object", [5.0, 6.0, 7.0, 8.0])]),
    ("[]", []),
    ("I cannot find it [sorry]", []),
])
def test_parse_boxes(reply, want):
    assert grounding.parse_boxes(reply) == want


def test_crop_code_runs_alone(pool):
    """The cell as written into the SFT data: a 60 x 40 image, box (10, 5, 30, 25), enlarged to 112."""
    img = Image.new("RGB", (60, 40), (255, 255, 255))
    img.paste((255, 0, 0), (10, 5, 30, 25))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    turn, code = grounding.code_turn("red square", [10, 5, 30, 25], 112)
    assert "its box is [10, 5, 30, 25]" in turn and turn.endswith("```\n</code>")
    with pool.new_session(files={"image.png": buf.getvalue()}) as s:
        r = s.execute(code)
    assert r.status == "ok" and "crop (10, 5, 30, 25) of (60, 40) enlarged to (100, 100)" in r.stdout
    crop = np.asarray(Image.open(io.BytesIO(r.images[0])).convert("RGB"))
    assert crop.shape == (100, 100, 3) and np.all(crop == (255, 0, 0))


def test_grounding_trajectory_featurizes_for_sft(ctx, tmp_path):
    """The record as `sft.jsonl` holds it -> `data.featurize` (what `launch.sft` runs): the crop turn and
    the answer are trained tokens, the real observation is not, and the crop is the second image."""
    from codedance_jax.model.config import ModelConfig
    from codedance_jax.processing import Processor, write_qwen25vl_processor_files
    from codedance_jax.train.batching import Bucket
    from data.featurize import featurize
    from data.trajectory import read_jsonl

    c, items = ctx()
    t = stages.synthesize(c, _medium_find(c, items))
    path = os.path.join(c.workdir, "one.jsonl")
    with open(path, "w") as f:
        f.write(json.dumps({"id": t["id"], "images": t["images"], "messages": t["messages"]}) + "\n")
    (traj,) = read_jsonl([path])
    write_qwen25vl_processor_files(tmp_path / "proc", max_pixels=448 * 448)
    proc = Processor.from_pretrained(tmp_path / "proc")
    ex = featurize(traj, proc, ModelConfig.tiny(), [Bucket(1024, 256, 32)])
    assert ex.bucket == 0 and len(ex.grid_thw) == 2
    trained, untrained = proc.decode(ex.input_ids[ex.trained].tolist()), proc.decode(ex.input_ids[~ex.trained].tolist())
    assert "crop = img.crop(box)" in trained and f"<answer>{t['answer']}</answer>" in trained
    real = t["messages"][2]["content"].splitlines()[0]  # "crop (x1, y1, x2, y2) of (W, H) enlarged to (w, h)"
    assert real in untrained and real not in trained
