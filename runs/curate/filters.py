"""The rule filters on a synthesized trajectory (paper appendix 7.1, Figure 7: incorrect answers,
trivial or mismatched boxes; plus broken code and over-long turns). `rule_reason(row, cfg, size)`
returns the first reason that drops it, or None:

- `no_answer`: the last assistant turn has no `<answer>`;
- `answer_mismatch`: the final answer disagrees with the gold answer (`rl.answers.accuracy_reward`);
- `bad_box`: a box written by the assistant (`[x1, y1, x2, y2]`, `(x1, y1, x2, y2)` or
  `bbox_2d`) lies outside the image, is degenerate, or covers less than `min_box_frac` or more
  than `max_box_frac` of the image area;
- `unrecovered_error`: a cell failed and no later cell succeeded;
- `too_long`: an assistant turn longer than `max_turn_chars`, or more than `max_cells` cells.
"""

from __future__ import annotations

import re
from typing import Any

from codedance_jax.protocol import extract_answer
from codedance_jax.rl.answers import accuracy_reward

REASONS = ("malformed", "no_answer", "answer_mismatch", "bad_box", "unrecovered_error", "too_long")
BOX_RE = re.compile(r"[\[(]\s*(-?\d+(?:\.\d+)?)\s*,\s*(-?\d+(?:\.\d+)?)\s*,\s*(-?\d+(?:\.\d+)?)\s*,\s*"
                    r"(-?\d+(?:\.\d+)?)\s*[\])]")


def boxes(text: str) -> list[tuple[float, float, float, float]]:
    return [tuple(float(v) for v in m.groups()) for m in BOX_RE.finditer(text)]


def box_problem(box, width: int, height: int, min_frac: float, max_frac: float) -> str | None:
    x1, y1, x2, y2 = box
    if x2 <= x1 or y2 <= y1:
        return "degenerate"
    if x1 < 0 or y1 < 0 or x2 > width or y2 > height:
        return "outside the image"
    frac = (x2 - x1) * (y2 - y1) / float(width * height)
    if frac < min_frac:
        return "implausibly small"
    if frac > max_frac:
        return "implausibly large"
    return None


def rule_reason(row: dict[str, Any], cfg, size: tuple[int, int]) -> str | None:
    msgs = row["messages"]
    assistant = [m["content"] for m in msgs if m["role"] == "assistant"]
    final = assistant[-1] if assistant else ""
    if extract_answer(final) is None:
        return "no_answer"
    if accuracy_reward(final, row["answer"], question=row["question"]) < 1.0:
        return "answer_mismatch"
    for text in assistant:
        for b in boxes(text):
            if box_problem(b, size[0], size[1], cfg.min_box_frac, cfg.max_box_frac):
                return "bad_box"
    statuses = row.get("cell_status", [])
    for i, s in enumerate(statuses):
        if s != "ok" and "ok" not in statuses[i + 1:]:
            return "unrecovered_error"
    if any(len(t) > cfg.max_turn_chars for t in assistant) or len(statuses) > cfg.max_cells:
        return "too_long"
    return None
