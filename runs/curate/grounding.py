"""Grounding trajectories: locate the object with Table 6, crop and enlarge it in the sandbox, answer.

The paper's first atomic category (appendix 7.1, Figure 6 (a) and Figure 7: "curating
tool-integrated reasoning trajectories for cropping operations") starts from the box of the object
that best matches the question: the teacher is asked with Table 6 (`templates.BBOX`, a JSON array
of `{"label", "bbox_2d": [x1, y1, x2, y2]}`), and the trajectory is a predefined image operation
on that box:

    assistant   <think>... its box is [x1, y1, x2, y2] ...</think> <code>crop + resize (CROP_CODE)</code>
    observation the sandbox's real output: the box, the sizes, and the enlarged crop as an image
    assistant   the answer

- medium items, single turn: the teacher's box and, as the final turn, its Table 8 step-by-step
  reply (`templates.STEP_BY_STEP`), both written without seeing the crop;
- hard items, multi turn with feedback: the same chat goes on after the box, the real crop (text
  and image) is sent back (`templates.GROUNDING_FEEDBACK`, ours) and the teacher answers having
  seen it.

Which items get this instead of the Table 9 code revision is `config.synthesize.grounding.select`:
`off`, `all`, `meta` (`meta[meta_key]` is one of `meta_values`: the toy world's `find` family, or a
task column of the user's JSONL) or `question` (`question_regex` matches the question). Trivial
items stay direct answers. A reply without a parsable box is dropped here (`no_box`); a box outside
the image, degenerate, or implausibly small or large is dropped by the rule filter (`bad_box`,
which reads the box from the assistant's text), a wrong answer by `answer_mismatch`.

Boxes are taken in the image's own pixels, Qwen2.5-VL's absolute coordinates: exact when the
teacher's server does not resize the image (images under its `max_pixels`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from codedance_jax.errors import UserError

SELECT = ("off", "all", "meta", "question")

CROP_CODE = """from PIL import Image
img = Image.open('image.png').convert('RGB')
box = ({x1}, {y1}, {x2}, {y2})
crop = img.crop(box)
scale = max(1, {zoom_px} // max(crop.size))
crop = crop.resize((crop.width * scale, crop.height * scale), Image.NEAREST)
crop.save('crop.png')
print('crop', box, 'of', img.size, 'enlarged to', crop.size)
"""


def check(g) -> None:
    """A clear error for a bad `config.synthesize.grounding` before any stage runs."""
    if g.select not in SELECT:
        raise UserError(f"config.synthesize.grounding.select={g.select!r} is unknown", f"choose one of {SELECT}")
    if g.select == "question":
        try:
            re.compile(g.question_regex)
        except re.error as e:
            raise UserError(f"config.synthesize.grounding.question_regex does not compile: {e}",
                            "give a Python regular expression") from e


def wanted(row: dict[str, Any], g) -> bool:
    """Does this item get a grounding trajectory (see the module docstring)?"""
    if g.select == "all":
        return True
    if g.select == "meta":
        return str(row.get("meta", {}).get(g.meta_key)) in {str(v) for v in g.meta_values}
    if g.select == "question":
        return re.search(g.question_regex, row["question"]) is not None
    return False


def parse_boxes(reply: str) -> list[tuple[str, list[float]]]:
    """(label, [x1, y1, x2, y2]) of each entry of a Table 6 reply: the first JSON array (or object)
    in it, inside a ```json fence or not; entries without four numbers are skipped."""
    dec = json.JSONDecoder()
    for m in re.finditer(r"[\[{]", reply):
        try:
            obj, _ = dec.raw_decode(reply, m.start())
        except ValueError:
            continue
        entries = obj if isinstance(obj, list) else [obj]
        out = []
        for e in entries:
            b = e.get("bbox_2d") if isinstance(e, dict) else None
            if isinstance(b, list) and len(b) == 4 and all(isinstance(v, (int, float)) for v in b):
                out.append((str(e.get("label", "object")), [float(v) for v in b]))
        if out:
            return out
    return []


def code_turn(label: str, box: list[float], zoom_px: int) -> tuple[str, str]:
    """(the assistant turn that states the box and crops it, its code)."""
    x1, y1, x2, y2 = (int(round(v)) for v in box)
    code = CROP_CODE.format(x1=x1, y1=y1, x2=x2, y2=y2, zoom_px=int(zoom_px))
    turn = (f"<think>The question is about the {label}. It is small in the image, so I locate it and zoom in: "
            f"its box is [{x1}, {y1}, {x2}, {y2}].</think>\n<code>\n```python\n{code}```\n</code>")
    return turn, code
