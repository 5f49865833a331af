"""The scripted expert: SFT trajectories whose code really ran in the sandbox.

Hard items get one fixed code template per family, executed in a real `SandboxPool` session holding
`image.png`; the observation is `codedance_jax.protocol.observation_text` of the result with its images
(at most 4), and the final answer is read back from that observation (the printed number or colour;
for `find`, the colour of the enlarged crop the cell saved). With probability `error_rate` the
expert first writes a buggy variant (a misspelt name or a missing import, `BUGS`) that really
fails, and then the correct code: a recovered error.

Easy items get a direct answer (`<think>..</think>\\n<answer>X</answer>`, no code), except that with
probability `easy_code_rate` (drawn from the item's rng; only for the families in
`easy_code_families`, all by default, so the choice can be cued by the family) they too are solved
with code, like a cold-start policy that over-uses tools: `count` runs `EASY_COUNT_CODE` (all non-white connected
components), `bars` runs `BARS_CODE` and answers the tallest bar's colour, `find` runs `FIND_CODE`
and answers the crop's colour. Easy code never carries a bug, and its think texts are short and
differ from the hard ones ("I will check with code."). This gives RL with the R_BAT reward
something to remove: the SFT policy calls tools on some easy items, and RL should lower that rate
while keeping it high on hard items.

With probability `hard_direct_rate` (default 0: every hard item is solved with code) a hard item
is answered directly, "by sight", with the right answer and no code: the SFT policy then answers
some hard items without looking closer, mostly wrongly, which leaves RL accuracy to gain (R_BAT
rewards a successful tool call where the group's accuracy is low). The draw comes after the bug's,
the item rng's last, so a rate of 0 leaves every other record as it was.

The templates are short and fixed so that a ~1M-parameter model can learn them in a few hundred
steps: one shared 4-line head, no RGB literals (colours are named, `ImageColor.getrgb('red')`, which
is exact because `tasks.PALETTE` holds PIL's values for those names), hardly any digits (digits are
single tokens, and long digit strings are what a tiny model garbles). The only variable parts are
words: the colour (and kind, for `count_target` questions) copied from a hard count question,
and the colour list of `bars` (the seven palette names for hard items, the question's 'red',
'blue' for easy ones). Bugs are chosen whose
traceback stays inside the cell: a wrong file name would print the sandbox machine's
site-packages path (PIL raises it), which would make the data machine-dependent.

The expert is 100 % correct: `ExpertError` is raised when an answer read from an observation
disagrees with the item's ground truth, or when the correct code does not end `ok`.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable
from typing import Any

import numpy as np
from PIL import Image

from codedance_jax.protocol import observation_text, rl_question
from data.toyworld.tasks import PALETTE, Item, color_name

MAX_OBS_IMAGES = 4


class ExpertError(AssertionError):
    """The expert's trajectory would teach a wrong answer or broken code."""


def user_content(question: str) -> str:
    """The SFT user message: rendered, it is exactly `rl_prompt(processor, id, question, [image])`'s user turn."""
    return "<image>" + rl_question(question, "code")


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


_HEAD = (
    "import numpy as np\n"
    "import cv2\n"
    "from PIL import Image, ImageColor\n"
    "img = np.array(Image.open('image.png').convert('RGB'))\n"
)

# Every template starts with the same four lines and contains no RGB literal: colours are named
# (`ImageColor.getrgb('red')`, exact because `PALETTE` holds PIL's values). The only variable parts
# are words copied from the question: COLOR / KIND (count), COLORS (bars: the quoted colour list).
COUNT_CODE = (
    _HEAD
    + "mask = np.all(img == ImageColor.getrgb('COLOR'), axis=-1).astype(np.uint8)\n"
    + "n, labels, stats, _ = cv2.connectedComponentsWithStats(mask)\n"
    + "fill = stats[1:, 4] / (stats[1:, 2] * stats[1:, 3])\n"
    + "kind = np.where(fill > 0.9, 'squares', np.where(fill > 0.65, 'circles', 'triangles'))\n"
    + "print('count:', int((kind == 'KINDs').sum()))\n"
)
# A hard count that names only the colour: the colour's connected components.
COUNT_COLOR_CODE = (
    _HEAD
    + "mask = np.all(img == ImageColor.getrgb('COLOR'), axis=-1).astype(np.uint8)\n"
    + "n, _ = cv2.connectedComponents(mask)\n"
    + "print('count:', n - 1)\n"
)
BARS_CODE = (
    _HEAD
    + "heights = {c: int(np.all(img == ImageColor.getrgb(c), axis=-1).any(axis=1).sum()) for c in [COLORS]}\n"
    + "best = max(heights, key=heights.get)\n"
    + "print('tallest:', best, heights[best])\n"
)
EASY_COUNT_CODE = (
    _HEAD
    + "mask = np.any(img != 255, axis=-1).astype(np.uint8)\n"
    + "n, _ = cv2.connectedComponents(mask)\n"
    + "print('count:', n - 1)\n"
)
FIND_CODE = (
    _HEAD
    + "ys, xs = np.nonzero(np.all(img == 0, axis=-1))\n"
    + "box = img[ys.min():ys.max() + 1, xs.min():xs.max() + 1]\n"
    + "crop = cv2.resize(box, (112, 112), interpolation=cv2.INTER_NEAREST)\n"
    + "Image.fromarray(crop).save('crop.png')\n"
    + "print('box:', xs.min(), ys.min(), xs.max(), ys.max())\n"
)
# The colours BARS_CODE measures: all of them for hard items, the two the easy question names.
BARS_COLORS = {"hard": tuple(PALETTE), "easy": ("red", "blue")}

# family -> bug name -> (right, wrong) substitution applied once to the correct code; every wrong
# variant raises a NameError inside the cell.
BUGS: dict[str, dict[str, tuple[str, str]]] = {
    "count": {
        "name": ("np.all(img ==", "np.all(image =="),
        "import": ("import cv2\n", ""),
    },
    "bars": {
        "name": ("heights[best])", "height[best])"),
        "import": ("from PIL import Image, ImageColor\n", "from PIL import Image\n"),
    },
    "find": {
        "name": ("Image.fromarray(crop)", "Image.fromarray(crops)"),
        "import": ("import cv2\n", ""),
    },
}

# Every cell's think text starts with what the image shows (the same words whatever the choice), then
# ", so" or ", but" carries the choice: a direct answer or code. The choice is made where the model
# already knows the cell, so a per-cell rate above one half is what greedy decoding takes. (With
# the choice at the first token, e.g. "I will check with code." against "The red bar ...", the
# rates of different cells mixed at that token: the issue-35 SFT policy called code on 0% of easy
# bars items greedy, 34% sampled, for an SFT rate of 75%.) On easy items the description already holds
# the answer ("I see 3 large shapes", "The red bar looks much taller"), so every easy item, with code or
# without, teaches the direct answer: with "The shapes are large and far apart, so I count them by eye:
# N." the direct answer was learned from the 25% of easy count items without code, and was right on
# 30.5% of the sampled direct answers on validation (world 0; benchmarks/results/table3_preregistered/).
THINK = {
    ("count", "easy"): "I see {answer} large shapes, far apart, so that is the count.",
    ("bars", "easy"): "The {answer} bar looks much taller, so that is the answer.",
    ("find", "easy"): "The box fills the image and holds a {answer} shape, so that is the answer.",
    ("count", "code"): "The shapes are small and mixed, so I will count the {target} with code.",
    ("bars", "code"): "The bars are almost the same height, so I will measure them with code.",
    ("find", "code"): "The marked box is tiny, so I will crop it and enlarge it with code.",
    ("count", "easy_code"): "I see {answer} large shapes, far apart, but I will count them with code.",
    ("bars", "easy_code"): "The {answer} bar looks much taller, but I will check with code.",
    ("find", "easy_code"): "The box fills the image and holds a {answer} shape, but I will look at it with code.",
    ("count", "sight"): "The shapes are small and mixed, but I count the {target} by eye: {answer}.",
    ("bars", "sight"): "The bars are almost the same height, but I read the tallest from the image: {answer}.",
    ("find", "sight"): "The marked box is tiny, but I can see the shape inside it: it is {answer}.",
    "retry": "The code failed with {error}. I will fix it and run it again.",
    ("count", "final"): "The code counted {answer} {target}.",
    ("bars", "final"): "The tallest bar is {color}, {height} pixels tall.",
    ("find", "final"): "The enlarged box shows a {answer} shape.",
    ("count", "easy_final"): "The code counted {answer} shapes.",
    ("bars", "easy_final"): "The {answer} bar is taller, {height} pixels.",
    ("find", "easy_final"): "The crop shows a {answer} shape.",
}


def _fill_count(template: str, item: Item) -> str:
    return template.replace("COLOR", item.meta["color"]).replace("KIND", item.meta.get("kind", ""))


def count_target(item: Item) -> str | None:
    """What a hard count question counts, as its think texts name it: "red circles" or "red shapes"."""
    if "color" not in item.meta:
        return None
    kind = item.meta.get("kind")
    return f"{item.meta['color']} {kind}s" if kind else f"{item.meta['color']} shapes"


def expert_code(item: Item) -> str:
    """The correct cell for `item` (for easy items: the cell used when the expert chooses code)."""
    if item.family == "count":
        if item.difficulty == "easy":
            return EASY_COUNT_CODE
        return _fill_count(COUNT_CODE if "kind" in item.meta else COUNT_COLOR_CODE, item)
    if item.family == "bars":
        return BARS_CODE.replace("COLORS", ", ".join(f"'{c}'" for c in BARS_COLORS[item.difficulty]))
    if item.family == "find":
        return FIND_CODE
    raise ValueError(f"unknown family {item.family!r}")


def buggy_code(item: Item, bug: str) -> str:
    right, wrong = BUGS[item.family][bug]
    code = expert_code(item)
    assert right in code, (item.family, bug)
    return code.replace(right, wrong, 1)


def code_turn(think: str, code: str) -> str:
    return f"<think>{think}</think>\n<code>\n```python\n{code.rstrip()}\n```\n</code>"


def answer_turn(think: str, answer: str) -> str:
    return f"<think>{think}</think>\n<answer>{answer}</answer>"


def _error_name(stderr: str) -> str:
    found = re.findall(r"^(\w+(?:Error|Exception)):", stderr, flags=re.M)
    return found[-1] if found else "an error"


def _crop_color(png: bytes) -> str:
    """The colour of the shape in an observed crop: its most frequent non-grey pixel value."""
    a = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    colored = ~((a[..., 0] == a[..., 1]) & (a[..., 1] == a[..., 2]))
    values, counts = np.unique(a[colored], axis=0, return_counts=True)
    if not len(values):
        raise ExpertError("the crop shows no coloured pixel")
    return color_name(values[int(np.argmax(counts))])


def _final(item: Item, stdout: str, images: list[bytes]) -> str:
    """The final answer turn, with the answer read from the correct cell's observation."""
    easy = item.difficulty == "easy"
    if item.family == "count":
        m = re.search(r"^count: (\d+)$", stdout, flags=re.M)
        if not m:
            raise ExpertError(f"{item.id}: no count in the output {stdout!r}")
        answer = m.group(1)
        if easy:
            think = THINK["count", "easy_final"].format(answer=answer)
        else:
            think = THINK["count", "final"].format(answer=answer, target=count_target(item))
    elif item.family == "bars":
        m = re.search(r"^tallest: (\w+) (\d+)$", stdout, flags=re.M)
        if not m:
            raise ExpertError(f"{item.id}: no tallest bar in the output {stdout!r}")
        color, height = m.groups()
        if easy:  # "Which bar is taller, the red one or the blue one?"
            answer = color
            think = THINK["bars", "easy_final"].format(answer=color, height=height)
        else:
            answer = color if item.meta["question_kind"] == "bars_color" else height
            think = THINK["bars", "final"].format(color=color, height=height)
    else:
        if len(images) != 1:
            raise ExpertError(f"{item.id}: expected the crop as one image, got {len(images)}")
        answer = _crop_color(images[0])
        think = THINK["find", "easy_final" if easy else "final"].format(answer=answer)
    if answer != item.answer:
        raise ExpertError(f"{item.id}: the observation gives {answer!r}, the ground truth is {item.answer!r}")
    return answer_turn(think, answer)


def expert_trajectory(
    item: Item,
    session_factory: Callable[[dict[str, bytes]], Any],
    rng: np.random.Generator,
    *,
    error_rate: float = 0.15,
    easy_code_rate: float = 0.3,
    hard_direct_rate: float = 0.0,
    easy_code_families: tuple[str, ...] | None = None,
    hard_direct_families: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """One SFT record for `item` (the trajectory JSONL format of `data.trajectory`).

    `session_factory(files)` opens a sandbox session (e.g. `pool.new_session`); it is called for
    the hard items that do not draw a direct answer (`rng.random() < hard_direct_rate`, drawn after
    the bug with `error_rate`) and for the easy items that draw code (`rng.random() <
    easy_code_rate`; only easy items draw it, and only the families in `easy_code_families` (None:
    all) can use code: the others draw too, so the stream is the same, and answer directly); hard
    items of the families in `hard_direct_families` (None: all) answer by sight at `hard_direct_rate`
    (the others draw too and use code). Returned keys: `id`, `images`
    (relative paths `img/{id}.png`, `img/{id}-obs{k}.png`), `messages`, `meta` (family, difficulty,
    question, answer, `error`: the bug name of a recovered error or None, `cells`: 0 for a direct
    answer) — all JSON-able — plus `image_data` (the PNG bytes of `images`, in order) and `timing`
    (`sandbox_s`), which a writer strips.
    """
    image_png = png_bytes(item.image)
    messages: list[dict[str, Any]] = [{"role": "user", "content": user_content(item.question)}]
    images, paths = [image_png], [f"img/{item.id}.png"]
    meta = {
        "family": item.family,
        "difficulty": item.difficulty,
        "question": item.question,
        "answer": item.answer,
        "error": None,
        "cells": 0,
    }
    sandbox_s = 0.0
    easy = item.difficulty == "easy"
    bug = None
    if not easy and rng.random() < error_rate:
        names = sorted(BUGS[item.family])
        bug = names[int(rng.integers(len(names)))]
    # Hard items draw the direct answer last (after the bug), so rate 0 changes no other draw.
    if easy:
        cued = easy_code_families is None or item.family in easy_code_families
        direct = not (rng.random() < easy_code_rate and cued)
    else:
        direct = rng.random() < hard_direct_rate and (hard_direct_families is None or item.family in hard_direct_families)
    if direct:
        key = (item.family, "easy" if easy else "sight")
        think = THINK[key].format(answer=item.answer, target=count_target(item))
        messages.append({"role": "assistant", "content": answer_turn(think, item.answer)})
    else:
        if easy:
            think = THINK[item.family, "easy_code"].format(answer=item.answer)
        elif item.family == "count":
            think = THINK["count", "code"].format(target=count_target(item))
        else:
            think = THINK[item.family, "code"]
        cells = ([buggy_code(item, bug)] if bug else []) + [expert_code(item)]
        with session_factory({"image.png": image_png}) as session:
            for k, code in enumerate(cells):
                r = session.execute(code)
                sandbox_s += r.elapsed_s
                last = k == len(cells) - 1
                if last and r.status != "ok":
                    raise ExpertError(f"{item.id}: the expert's code ended {r.status}: {r.stderr[-500:]}")
                if not last and r.status != "error":
                    raise ExpertError(f"{item.id}: the {bug} bug did not fail (status {r.status})")
                messages.append({"role": "assistant", "content": code_turn(think, code)})
                obs_images = list(r.images[:MAX_OBS_IMAGES])
                messages.append(
                    {
                        "role": "observation",
                        "content": observation_text(r.stdout, r.stderr, r.status),
                        "num_images": len(obs_images),
                    }
                )
                for png in obs_images:
                    paths.append(f"img/{item.id}-obs{len(images)}.png")
                    images.append(png)
                if not last:
                    think = THINK["retry"].format(error=_error_name(r.stderr))
            messages.append({"role": "assistant", "content": _final(item, r.stdout, obs_images)})
        meta["error"], meta["cells"] = bug, len(cells)
    return {
        "id": item.id,
        "images": paths,
        "messages": messages,
        "meta": meta,
        "image_data": images,
        "timing": {"sandbox_s": sandbox_s},
    }
