"""The toy world's three task families, each drawn easy (answerable by sight) or hard (needs code).

Every image is drawn with PIL `ImageDraw` on a white background, without anti-aliasing, in the exact
RGB values of `PALETTE` (CSS colour names, each drawn at its `PIL.ImageColor.getrgb` value), greys
r == g == b for clutter and pure black only for the `find` marker,
so that a pixel-equality mask recovers each object exactly. The answer is computed from the object
list while drawing (ground truth by construction); `verify_item` re-derives it from the pixels with
different code (contours and per-column profiles, where the expert uses component fill ratios and
bounding boxes), which the tests compare.

| family | easy (112 px) | hard (168 px) |
|---|---|---|
| count | 1-3 big one-colour shapes, one filling most of each occupied quadrant: "How many shapes are in the image?" | 6-14 small shapes of 4 colours x 3 kinds: "How many red shapes are in the image?" or "How many red circles ...?" (0-6) |
| bars | a red and a blue bar, heights far apart: "Which bar is taller, the red one or the blue one?" | 5-7 bars of distinct colours, the tallest 1-3 px above the next: its colour, or its height in pixels |
| find | a large shape in a black box filling the image: "What colour is the shape inside the marked box?" | a 14-18 px box with a 6-10 px shape among grey clutter and differently coloured decoys: same question |

Image sides are multiples of 28 px (the processor's 14 px patches merged 2x2): 112 px -> 16 image
tokens, 168 px -> 36 (within `max_pixels` = 168 * 168, so nothing is resized).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import cv2
import numpy as np
from PIL import Image, ImageDraw

FAMILIES = ("count", "bars", "find")
DIFFICULTIES = ("easy", "hard")
EASY_SIZE = 112
HARD_SIZE = 168
WHITE = (255, 255, 255)
BLACK = (0, 0, 0)

# CSS / PIL named colours at their exact `ImageColor.getrgb(name)` values, so that code can write
# `ImageColor.getrgb('red')` instead of an RGB literal. None is grey (r == g == b), white or black,
# so neither clutter nor the marker ever matches a colour mask.
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (255, 0, 0),
    "green": (0, 128, 0),
    "blue": (0, 0, 255),
    "yellow": (255, 255, 0),
    "purple": (128, 0, 128),
    "orange": (255, 165, 0),
    "cyan": (0, 255, 255),
}
ANSWER_COLORS = ("red", "green", "blue", "yellow")  # colours asked about in count and find
KINDS = ("circle", "square", "triangle")
EASY_COUNT_MAX = 3

QUESTIONS = {
    "count_all": "How many shapes are in the image?",
    "count_target": "How many {color} {kind}s are in the image?",
    "count_color": "How many {color} shapes are in the image?",
    "bars_taller": "Which bar is taller, the red one or the blue one?",
    "bars_color": "Which colour is the tallest bar?",
    "bars_height": "How many pixels tall is the tallest bar?",
    "find_color": "What colour is the shape inside the marked box?",
}


@dataclasses.dataclass
class Item:
    """One task instance. `meta` (JSON-able) holds the drawn objects and the question kind."""

    id: str
    family: str
    difficulty: str
    question: str
    answer: str
    image: Image.Image
    meta: dict[str, Any]


def _rng(rng_or_seed) -> np.random.Generator:
    return rng_or_seed if isinstance(rng_or_seed, np.random.Generator) else np.random.default_rng(rng_or_seed)


def _ri(rng: np.random.Generator, lo: int, hi: int) -> int:
    """Uniform integer in [lo, hi] (inclusive)."""
    return int(rng.integers(lo, hi + 1))


def draw_shape(d: ImageDraw.ImageDraw, kind: str, x: int, y: int, s: int, rgb) -> None:
    """A filled `kind` in the s x s square at (x, y): exactly that bounding box, no anti-aliasing."""
    box = [x, y, x + s - 1, y + s - 1]
    if kind == "circle":
        d.ellipse(box, fill=rgb)
    elif kind == "square":
        d.rectangle(box, fill=rgb)
    elif kind == "triangle":
        d.polygon([(x, y + s - 1), (x + s - 1, y + s - 1), (x + (s - 1) / 2, y)], fill=rgb)
    else:
        raise ValueError(f"unknown shape kind {kind!r}; expected one of {KINDS}")


# ------------------------------------------------------------------------------------- count


def _count_easy(rng, colors=ANSWER_COLORS):
    img = Image.new("RGB", (EASY_SIZE,) * 2, WHITE)
    d = ImageDraw.Draw(img)
    color = colors[_ri(rng, 0, len(colors) - 1)]
    n = _ri(rng, 1, EASY_COUNT_MAX)
    quads = sorted(rng.choice(4, size=n, replace=False).tolist())
    shapes = []
    half = EASY_SIZE // 2
    for q in quads:
        # Each shape fills most of its quadrant, so it covers all four merged image tokens (28 px) of
        # that quadrant and the count by eye is the number of occupied quadrants. Shapes of 28-40 px at
        # random offsets covered 1-4 tokens, and the SFT policy counted them 57-78% right (issue 35).
        s = _ri(rng, 44, 50)
        x = (q % 2) * half + _ri(rng, 3, half - 3 - s)
        y = (q // 2) * half + _ri(rng, 3, half - 3 - s)
        kind = KINDS[_ri(rng, 0, 2)]
        draw_shape(d, kind, x, y, s, PALETTE[color])
        shapes.append({"kind": kind, "color": color, "x": x, "y": y, "size": s})
    return img, QUESTIONS["count_all"], str(n), {"question_kind": "count_all", "shapes": shapes}


COUNT_HARD_QUESTIONS = ("count_color", "count_target")


def _count_hard(rng, questions=("count_target",), target_rate=None, touch_rate=0.0):
    """`count_target` asks for one colour and kind ("How many red circles"), `count_color` for one
    colour of any kind ("How many red shapes"); with both, each item draws one (at `target_rate` for
    `count_target`, or uniformly when it is None).

    `touch_rate`: share of `count_color` items where one more shape of the asked colour is drawn
    touching another one (two shapes, one connected blob): a colour mask's connected components
    count one too few there, so the tool path is imperfect by construction (sight is worse still).
    Drawn last, so a rate of 0 leaves every other draw as it was."""
    img = Image.new("RGB", (HARD_SIZE,) * 2, WHITE)
    d = ImageDraw.Draw(img)
    color = ANSWER_COLORS[_ri(rng, 0, len(ANSWER_COLORS) - 1)]
    kind = KINDS[_ri(rng, 0, 2)]
    if len(questions) == 1:
        qk = questions[0]
    elif target_rate is None:
        qk = questions[_ri(rng, 0, len(questions) - 1)]
    else:
        qk = "count_target" if rng.random() < target_rate else "count_color"
    k = int(rng.choice(7, p=np.array([1, 2, 2, 2, 2, 2, 1]) / 12))
    n = max(k, _ri(rng, 6, 14))
    if qk == "count_target":
        others = [(c, t) for c in ANSWER_COLORS for t in KINDS if (c, t) != (color, kind)]
        targets = [(color, kind)] * k
    else:  # the target colour in any kind; the other shapes in the other colours
        others = [(c, t) for c in ANSWER_COLORS if c != color for t in KINDS]
        targets = [(color, KINDS[int(i)]) for i in rng.integers(0, len(KINDS), k)]
    picks = targets + [others[i] for i in rng.integers(0, len(others), n - k)]
    # One shape per 21 px cell of an 8 x 8 grid, >= 1 px inside its cell: shapes never touch.
    cell = HARD_SIZE // 8
    cells = rng.choice(64, size=n, replace=False)
    order = rng.permutation(n)
    shapes = []
    for j, c in zip(order, cells, strict=True):
        col, kd = picks[j]
        s = _ri(rng, 10, 15)
        x = int(c % 8) * cell + _ri(rng, 1, cell - 1 - s)
        y = int(c // 8) * cell + _ri(rng, 1, cell - 1 - s)
        draw_shape(d, kd, x, y, s, PALETTE[col])
        shapes.append({"kind": kd, "color": col, "x": x, "y": y, "size": s})
    touching = False
    if touch_rate > 0 and qk == "count_color" and rng.random() < touch_rate:
        touching = _add_touching(img, d, rng, shapes, color)
        k += touching
    if qk == "count_target":
        q = QUESTIONS["count_target"].format(color=color, kind=kind)
        meta = {"question_kind": "count_target", "color": color, "kind": kind, "shapes": shapes}
    else:
        q = QUESTIONS["count_color"].format(color=color)
        meta = {"question_kind": "count_color", "color": color, "shapes": shapes, "touching": touching}
    return img, q, str(k), meta


def _components(img: Image.Image, color: str) -> int:
    return cv2.connectedComponents(_mask(np.asarray(img), PALETTE[color]), connectivity=8)[0] - 1


def _add_touching(img, d, rng, shapes, color) -> bool:
    """Draw one more `color` shape touching a drawn one (8-connected, so the two are one component),
    clear of every other shape by 2 px; appends it to `shapes`. False when no placement fits."""
    targets = [i for i, sh in enumerate(shapes) if sh["color"] == color]
    before = _components(img, color)
    for i in [targets[int(j)] for j in rng.permutation(len(targets))]:
        a = shapes[i]
        kind, s = KINDS[_ri(rng, 0, 2)], _ri(rng, 8, 12)
        ca = a["size"] // 2
        for dx, dy in ((0, 1), (1, 0), (0, -1), (-1, 0)):  # below, right, above, left: centred on the side
            x = a["x"] + (a["size"] if dx > 0 else -s if dx < 0 else ca - s // 2)
            y = a["y"] + (a["size"] if dy > 0 else -s if dy < 0 else ca - s // 2)
            box = [x, y, x + s - 1, y + s - 1]
            if x < 1 or y < 1 or box[2] > HARD_SIZE - 2 or box[3] > HARD_SIZE - 2:
                continue
            others = [o for j, o in enumerate(shapes) if j != i]
            if any(_overlaps(box, [o["x"], o["y"], o["x"] + o["size"] - 1, o["y"] + o["size"] - 1], 2)
                   for o in others):
                continue
            trial = img.copy()
            draw_shape(ImageDraw.Draw(trial), kind, x, y, s, PALETTE[color])
            if _components(trial, color) != before:  # not touching: try the next side
                continue
            draw_shape(d, kind, x, y, s, PALETTE[color])
            shapes.append({"kind": kind, "color": color, "x": x, "y": y, "size": s, "touches": i})
            return True
    return False


# -------------------------------------------------------------------------------------- bars


def _bars(d, bars, base):
    for b in bars:
        d.rectangle([b["x"], base - b["height"] + 1, b["x"] + b["width"] - 1, base], fill=PALETTE[b["color"]])


def _bars_easy(rng):
    img = Image.new("RGB", (EASY_SIZE,) * 2, WHITE)
    tall, short = _ri(rng, 70, 92), _ri(rng, 20, 45)
    winner = ("red", "blue")[_ri(rng, 0, 1)]
    heights = {winner: tall, ("blue" if winner == "red" else "red"): short}
    left = ("red", "blue")[_ri(rng, 0, 1)]
    base = EASY_SIZE - 9
    bars = []
    for i, c in enumerate((left, "blue" if left == "red" else "red")):
        w = _ri(rng, 20, 28)
        bars.append({"color": c, "x": 12 + 52 * i + _ri(rng, 0, 4), "width": w, "height": heights[c]})
    _bars(ImageDraw.Draw(img), bars, base)
    return img, QUESTIONS["bars_taller"], winner, {"question_kind": "bars_taller", "base": base, "bars": bars}


BARS_HARD_QUESTIONS = ("bars_color", "bars_height")


def _bars_hard(rng, questions=BARS_HARD_QUESTIONS):
    img = Image.new("RGB", (HARD_SIZE,) * 2, WHITE)
    n = _ri(rng, 5, 7)
    names = list(PALETTE)
    colors = [names[i] for i in rng.choice(len(names), size=n, replace=False)]
    top = _ri(rng, 80, 150)
    # The runner-up is 1-3 px below the tallest, the rest at most 12 px below: sight cannot rank them.
    heights = [top, top - _ri(rng, 1, 3)] + [top - _ri(rng, 2, 12) for _ in range(n - 2)]
    heights = [heights[i] for i in rng.permutation(n)]
    slot = HARD_SIZE // n
    base = HARD_SIZE - 9
    bars = [
        {"color": c, "x": i * slot + 3, "width": slot - 6 - _ri(rng, 0, 3), "height": h}
        for i, (c, h) in enumerate(zip(colors, heights, strict=True))
    ]
    _bars(ImageDraw.Draw(img), bars, base)
    best = colors[int(np.argmax(heights))]
    qk = BARS_HARD_QUESTIONS[_ri(rng, 0, 1)]  # drawn always, so `questions` changes no other draw
    if qk not in questions:
        qk = questions[0]
    answer = best if qk == "bars_color" else str(top)
    return img, QUESTIONS[qk], answer, {"question_kind": qk, "base": base, "bars": bars}


# -------------------------------------------------------------------------------------- find


def _find_easy(rng):
    img = Image.new("RGB", (EASY_SIZE,) * 2, WHITE)
    d = ImageDraw.Draw(img)
    m = _ri(rng, 6, 14)
    box = [m, m, EASY_SIZE - 1 - m, EASY_SIZE - 1 - m]
    d.rectangle(box, outline=BLACK, width=2)
    color = ANSWER_COLORS[_ri(rng, 0, len(ANSWER_COLORS) - 1)]
    kind = KINDS[_ri(rng, 0, 2)]
    s = _ri(rng, 36, 56)
    c = EASY_SIZE // 2 - s // 2
    x, y = c + _ri(rng, -6, 6), c + _ri(rng, -6, 6)
    draw_shape(d, kind, x, y, s, PALETTE[color])
    meta = {
        "question_kind": "find_color",
        "box": box,
        "target": {"kind": kind, "color": color, "x": x, "y": y, "size": s},
    }
    return img, QUESTIONS["find_color"], color, meta


def _overlaps(a, b, gap):
    return not (a[2] + gap < b[0] or b[2] + gap < a[0] or a[3] + gap < b[1] or b[3] + gap < a[1])


def _find_hard(rng, colors=ANSWER_COLORS):
    img = Image.new("RGB", (HARD_SIZE,) * 2, WHITE)
    d = ImageDraw.Draw(img)
    b = _ri(rng, 14, 18)
    bx, by = _ri(rng, 4, HARD_SIZE - 5 - b), _ri(rng, 4, HARD_SIZE - 5 - b)
    box = [bx, by, bx + b - 1, by + b - 1]
    clutter = []
    for _ in range(_ri(rng, 12, 24)):
        while True:  # rejection: clutter stays >= 3 px away from the box
            w, h = _ri(rng, 4, 24), _ri(rng, 4, 24)
            x, y = _ri(rng, 0, HARD_SIZE - w), _ri(rng, 0, HARD_SIZE - h)
            r = [x, y, x + w - 1, y + h - 1]
            if not _overlaps(r, box, 3):
                break
        g = _ri(rng, 100, 225)
        form = ("rect", "ellipse", "line")[_ri(rng, 0, 2)]
        if form == "rect":
            d.rectangle(r, fill=(g, g, g))
        elif form == "ellipse":
            d.ellipse(r, fill=(g, g, g))
        else:
            d.line(r, fill=(g, g, g), width=1)
        clutter.append({"form": form, "grey": g, "box": r})
    color = colors[_ri(rng, 0, len(colors) - 1)]
    # Decoys: one small shape of each of 3-5 other colours, so the image's colours do not give the answer.
    others = [c for c in PALETTE if c != color]
    decoys, taken = [], [box]
    for c in [others[i] for i in rng.choice(len(others), size=_ri(rng, 3, 5), replace=False)]:
        while True:
            s = _ri(rng, 6, 10)
            x, y = _ri(rng, 1, HARD_SIZE - 1 - s), _ri(rng, 1, HARD_SIZE - 1 - s)
            r = [x, y, x + s - 1, y + s - 1]
            if not any(_overlaps(r, t, 3) for t in taken):
                break
        kd = KINDS[_ri(rng, 0, 2)]
        draw_shape(d, kd, x, y, s, PALETTE[c])
        decoys.append({"kind": kd, "color": c, "x": x, "y": y, "size": s})
        taken.append(r)
    d.rectangle(box, fill=WHITE, outline=BLACK, width=1)
    kind = KINDS[_ri(rng, 0, 2)]
    s = b - 8
    draw_shape(d, kind, bx + 4, by + 4, s, PALETTE[color])
    meta = {
        "question_kind": "find_color",
        "box": box,
        "target": {"kind": kind, "color": color, "x": bx + 4, "y": by + 4, "size": s},
        "decoys": decoys,
        "clutter": clutter,
    }
    return img, QUESTIONS["find_color"], color, meta


_MAKERS = {
    ("count", "easy"): _count_easy,
    ("count", "hard"): _count_hard,
    ("bars", "easy"): _bars_easy,
    ("bars", "hard"): _bars_hard,
    ("find", "easy"): _find_easy,
    ("find", "hard"): _find_hard,
}


def make_item(family: str, difficulty: str, rng_or_seed, item_id: str,
              bars_questions: tuple[str, ...] = BARS_HARD_QUESTIONS,
              count_questions: tuple[str, ...] = ("count_target",),
              easy_count_colors: tuple[str, ...] = ANSWER_COLORS,
              count_target_rate: float | None = None,
              count_touch_rate: float = 0.0,
              find_colors: tuple[str, ...] = ANSWER_COLORS) -> Item:
    """Draw one item; the same seed (or generator state) gives the same item.

    `bars_questions`: the question kinds hard `bars` items may ask (`bars_color`, `bars_height`);
    with one of them the other's items ask it instead (the image is the same). `count_questions`:
    the question kinds hard `count` items may ask (`count_color`, `count_target`).
    `easy_count_colors`: the palette colours easy `count` shapes are drawn in. `count_target_rate`:
    with both count questions, the share of `count_target` ones (None: uniform). `count_touch_rate`:
    the share of `count_color` items with two touching shapes of the asked colour (`_count_hard`).
    `find_colors`: the colours a hard `find` target is drawn in.
    """
    if (family, difficulty) not in _MAKERS:
        raise ValueError(f"unknown task {family}/{difficulty}; families {FAMILIES}, difficulties {DIFFICULTIES}")
    bars_questions = tuple(bars_questions)
    if not bars_questions or set(bars_questions) - set(BARS_HARD_QUESTIONS):
        raise ValueError(f"bars_questions={bars_questions}: choose among {BARS_HARD_QUESTIONS}")
    count_questions = tuple(count_questions)
    if not count_questions or set(count_questions) - set(COUNT_HARD_QUESTIONS):
        raise ValueError(f"count_questions={count_questions}: choose among {COUNT_HARD_QUESTIONS}")
    easy_count_colors = tuple(easy_count_colors)
    if not easy_count_colors or set(easy_count_colors) - set(PALETTE):
        raise ValueError(f"easy_count_colors={easy_count_colors}: choose among {tuple(PALETTE)}")
    find_colors = tuple(find_colors)
    if not find_colors or set(find_colors) - set(PALETTE):
        raise ValueError(f"find_colors={find_colors}: choose among {tuple(PALETTE)}")
    for name, rate in (("count_target_rate", count_target_rate), ("count_touch_rate", count_touch_rate)):
        if rate is not None and not 0.0 <= rate <= 1.0:
            raise ValueError(f"{name}={rate}: a share in [0, 1]")
    maker = _MAKERS[family, difficulty]
    if (family, difficulty) == ("bars", "hard"):
        img, question, answer, meta = maker(_rng(rng_or_seed), bars_questions)
    elif (family, difficulty) == ("count", "hard"):
        img, question, answer, meta = maker(_rng(rng_or_seed), count_questions, count_target_rate, count_touch_rate)
    elif (family, difficulty) == ("count", "easy"):
        img, question, answer, meta = maker(_rng(rng_or_seed), easy_count_colors)
    elif (family, difficulty) == ("find", "hard"):
        img, question, answer, meta = maker(_rng(rng_or_seed), find_colors)
    else:
        img, question, answer, meta = maker(_rng(rng_or_seed))
    return Item(item_id, family, difficulty, question, answer, img, meta)


# ------------------------------------------------------------------------------ verification


def _mask(a: np.ndarray, rgb) -> np.ndarray:
    return np.all(a == np.asarray(rgb, np.uint8), axis=-1).astype(np.uint8)


def _classify(comp: np.ndarray) -> str:
    """Kind of one filled shape (bool [h, w] cropped to it) from its row widths: a square's rows are
    all full, a triangle's top row is a point and its bottom row full, a circle's ends are both short."""
    widths = comp.sum(axis=1)
    full = comp.shape[1]
    if widths[0] == full and widths[-1] == full:
        return "square"
    if widths[0] <= 2 and widths[-1] == full:
        return "triangle"
    return "circle"


def color_name(rgb) -> str:
    """The palette name of an exact palette colour."""
    for name, v in PALETTE.items():
        if tuple(int(c) for c in rgb) == v:
            return name
    raise ValueError(f"{tuple(rgb)} is not a palette colour")


def _colored(a: np.ndarray) -> np.ndarray:
    """Pixels that are neither white, black nor grey."""
    return ~((a[..., 0] == a[..., 1]) & (a[..., 1] == a[..., 2]))


def _bar_heights(a: np.ndarray) -> dict[str, int]:
    # Tallest column of each colour (the expert counts rows instead).
    return {c: int(_mask(a, v).sum(axis=0).max()) for c, v in PALETTE.items()}


def question_kind(question: str) -> str:
    """The key of `QUESTIONS` whose template `question` follows."""
    for k, q in QUESTIONS.items():
        if "{" not in q and q == question:
            return k
    m = re.fullmatch(QUESTIONS["count_target"].replace("?", r"\?").format(color=r"(\w+)", kind=r"(\w+)"), question)
    if m and m.group(1) in PALETTE and m.group(2) in KINDS:
        return "count_target"
    m = re.fullmatch(QUESTIONS["count_color"].replace("?", r"\?").format(color=r"(\w+)"), question)
    if m and m.group(1) in PALETTE:
        return "count_color"
    raise ValueError(f"not a toy-world question: {question!r}")


def verify_item(item: Item) -> str:
    """Re-derive the answer from the image's pixels and the question's wording only (not `meta`)."""
    return verify_answer(item.image, item.question)


def verify_answer(image: Image.Image, question: str) -> str:
    """The answer to `question` about `image`, computed from pixels (independently of the expert)."""
    a = np.asarray(image.convert("RGB"))
    qk = question_kind(question)
    if qk == "count_all":
        n, _ = cv2.connectedComponents((~np.all(a == 255, axis=-1)).astype(np.uint8), connectivity=8)
        return str(n - 1)
    if qk == "count_target":
        words = question.split()
        color, kind = words[2], words[3].rstrip("s")
        n, labels = cv2.connectedComponents(_mask(a, PALETTE[color]), connectivity=8)
        hits = 0
        for i in range(1, n):
            ys, xs = np.nonzero(labels == i)
            comp = labels[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1] == i
            hits += _classify(comp) == kind
        return str(hits)
    if qk == "count_color":
        n, _ = cv2.connectedComponents(_mask(a, PALETTE[question.split()[2]]), connectivity=8)
        return str(n - 1)
    if qk in ("bars_taller", "bars_color", "bars_height"):
        h = _bar_heights(a)
        if qk == "bars_taller":
            return "red" if h["red"] > h["blue"] else "blue"
        best = max(h, key=h.get)
        return best if qk == "bars_color" else str(h[best])
    if qk == "find_color":
        contours, _ = cv2.findContours(_mask(a, BLACK), cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_SIMPLE)
        x, y, w, h = cv2.boundingRect(max(contours, key=cv2.contourArea))
        inner = a[y + 1 : y + h - 1, x + 1 : x + w - 1]
        px = inner[_colored(inner)]
        values, counts = np.unique(px, axis=0, return_counts=True)
        return color_name(values[int(np.argmax(counts))])
    raise ValueError(f"unknown question kind {qk!r}")
