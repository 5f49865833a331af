"""Generators: ground truth by construction equals an independent re-derivation from the pixels."""

import collections

import numpy as np
import pytest
from PIL import ImageColor

from data.toyworld import ANSWER_COLORS, FAMILIES, PALETTE, make_item, verify_item
from data.toyworld.tasks import EASY_COUNT_MAX, question_kind, verify_answer

CELLS = [(f, d) for f in FAMILIES for d in ("easy", "hard")]


@pytest.mark.parametrize("family,difficulty", CELLS)
def test_verify_matches_ground_truth(family, difficulty):
    answers = collections.Counter()
    allowed = {tuple(v) for v in PALETTE.values()} | {(255, 255, 255), (0, 0, 0)}
    for seed in range(80):
        item = make_item(family, difficulty, seed, f"t{seed}")
        assert verify_item(item) == item.answer, (family, difficulty, seed)
        w, h = item.image.size
        assert w == h and w % 28 == 0 and w == (112 if difficulty == "easy" else 168)
        # No anti-aliasing: every pixel is white, black, a grey (clutter) or an exact palette colour.
        px = {tuple(p) for p in np.asarray(item.image).reshape(-1, 3)}
        assert all(p in allowed or p[0] == p[1] == p[2] for p in px)
        assert question_kind(item.question) == item.meta["question_kind"]
        answers[item.answer] += 1
    if (family, difficulty) == ("count", "easy"):
        assert set(answers) == {str(k) for k in range(1, EASY_COUNT_MAX + 1)}
    elif (family, difficulty) == ("count", "hard"):
        assert set(answers) <= {str(k) for k in range(7)} and len(answers) >= 6
    elif (family, difficulty) == ("bars", "easy"):
        assert set(answers) == {"red", "blue"}
    elif family == "find":
        assert set(answers) == set(ANSWER_COLORS)


@pytest.mark.parametrize("questions", [("count_color",), ("count_target",), ("count_color", "count_target")])
def test_count_questions(questions):
    """A hard count item asks what `count_questions` allows; its answer re-derived from the pixels
    equals the drawn count, and a colour question counts every shape of the colour (all kinds)."""
    asked = collections.Counter()
    for seed in range(60):
        item = make_item("count", "hard", seed, f"q{seed}", count_questions=questions)
        asked[item.meta["question_kind"]] += 1
        assert verify_item(item) == item.answer, (questions, seed)
        if item.meta["question_kind"] == "count_color":
            assert "kind" not in item.meta and item.question == f"How many {item.meta['color']} shapes are in the image?"
            shown = [s for s in item.meta["shapes"] if s["color"] == item.meta["color"]]
            assert int(item.answer) == len(shown)
    assert set(asked) == set(questions)
    with pytest.raises(ValueError, match="count_questions"):
        make_item("count", "hard", 0, "x", count_questions=("count_kind",))


def test_easy_count_colors():
    drawn = {make_item("count", "easy", seed, "e", easy_count_colors=("red", "blue")).meta["shapes"][0]["color"]
             for seed in range(30)}
    assert drawn == {"red", "blue"}
    with pytest.raises(ValueError, match="easy_count_colors"):
        make_item("count", "easy", 0, "e", easy_count_colors=("pink",))


def test_palette_is_pil_named_colours():
    """Every palette name is a CSS/PIL colour name whose `ImageColor.getrgb` value is exactly what is
    drawn, so code may write `ImageColor.getrgb('red')`; no palette colour is grey, black or white."""
    for name, rgb in PALETTE.items():
        assert ImageColor.getrgb(name) == rgb, name
        assert len(set(rgb)) > 1, name  # not grey (clutter), black (marker) or white (background)
    assert len(set(PALETTE.values())) == len(PALETTE)
    assert set(ANSWER_COLORS) <= set(PALETTE)
    for seed in range(10):
        item = make_item("count", "hard", seed, "p")
        for s in item.meta["shapes"]:
            x, y = s["x"], s["y"]
            assert np.asarray(item.image)[y + s["size"] - 1, x + s["size"] // 2].tolist() == list(
                ImageColor.getrgb(s["color"])
            )


def test_deterministic_and_seed_dependent():
    a, b, c = (make_item("count", "hard", s, "x") for s in (5, 5, 6))
    assert np.array_equal(np.asarray(a.image), np.asarray(b.image)) and a.question == b.question
    assert not np.array_equal(np.asarray(a.image), np.asarray(c.image))


def test_hard_bars_are_close():
    for seed in range(40):
        item = make_item("bars", "hard", seed, "b")
        h = sorted(b["height"] for b in item.meta["bars"])
        assert 1 <= h[-1] - h[-2] <= 3 and h[-1] - h[0] <= 12
        assert len({b["color"] for b in item.meta["bars"]}) == len(h) >= 5


def test_verify_detects_a_changed_image():
    """The check can fail: hiding one target shape changes the derived count."""
    item = next(it for s in range(50) if int((it := make_item("count", "hard", s, "c")).answer) > 0)
    shape = next(s for s in item.meta["shapes"] if (s["color"], s["kind"]) == (item.meta["color"], item.meta["kind"]))
    a = np.asarray(item.image).copy()
    a[shape["y"] : shape["y"] + shape["size"], shape["x"] : shape["x"] + shape["size"]] = 255
    from PIL import Image

    assert verify_answer(Image.fromarray(a), item.question) == str(int(item.answer) - 1)


def test_find_hard_decoys_hide_the_answer():
    """The image holds decoys of other colours only: the target colour appears only inside the box."""
    for seed in range(30):
        item = make_item("find", "hard", seed, "f")
        decoys = {d["color"] for d in item.meta["decoys"]}
        assert item.answer not in decoys and len(decoys) >= 3
        x0, y0, x1, y1 = item.meta["box"]
        mask = np.all(np.asarray(item.image) == PALETTE[item.answer], axis=-1)
        ys, xs = np.nonzero(mask)
        assert ys.min() > y0 and ys.max() < y1 and xs.min() > x0 and xs.max() < x1
        assert 14 <= x1 - x0 + 1 <= 18


def test_touching_shapes_make_the_component_count_one_short():
    """count_touch_rate: one more shape of the asked colour touches another, so the answer counts it
    while the connected components (the expert's and the independent check's) merge the two."""
    touched = 0
    for seed in range(40):
        it = make_item("count", "hard", seed, "t", count_questions=("count_color",), count_touch_rate=1.0)
        pixels = int(verify_item(it))
        if it.meta["touching"]:
            touched += 1
            assert pixels == int(it.answer) - 1, seed
            extra = it.meta["shapes"][-1]
            assert extra["color"] == it.meta["color"] and "touches" in extra
        else:  # no placement fitted: an ordinary item
            assert pixels == int(it.answer), seed
    assert touched >= 30
    # Rate 0 draws nothing more: the same item as without the knob.
    a = make_item("count", "hard", 5, "t", count_questions=("count_color",), count_touch_rate=0.0)
    b = make_item("count", "hard", 5, "t", count_questions=("count_color",))
    assert a.question == b.question and a.answer == b.answer and a.image.tobytes() == b.image.tobytes()
    with pytest.raises(ValueError, match="count_touch_rate"):
        make_item("count", "hard", 0, "t", count_touch_rate=1.5)


def test_count_target_rate_and_find_colors():
    kinds = collections.Counter(
        make_item("count", "hard", s, "t", count_questions=("count_color", "count_target"),
                  count_target_rate=0.25).meta["question_kind"] for s in range(200))
    assert 30 <= kinds["count_target"] <= 70, kinds
    colors = {make_item("find", "hard", s, "t", find_colors=tuple(PALETTE)).answer for s in range(200)}
    assert colors == set(PALETTE)
    assert {make_item("find", "hard", s, "t").answer for s in range(100)} <= set(ANSWER_COLORS)
    with pytest.raises(ValueError, match="find_colors"):
        make_item("find", "hard", 0, "t", find_colors=("teal",))
