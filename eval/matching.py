"""VLMEvalKit's answer-matching rules, re-implemented from reading its code (open-compass/VLMEvalKit,
`vlmeval/utils/matching_util.py`, `vlmeval/dataset/utils/vqa_eval.py`, `mathv.py`). Nothing here
is copied; the behaviour is reproduced, quirks included, because published numbers depend on them.

- `can_infer(answer, choices)`: the multiple-choice extractor. First `can_infer_option`: the
  characters `.()[],:;!*#{}` become spaces, the text is split on whitespace, and exactly one of the
  (uppercase) option letters must appear as its own token, and within the last five tokens
  (`index > len(tokens) - 5`); a few refusal phrases, or a lone `Z` token with no option letter,
  give `"Z"`. When that settles nothing (no letter, several, or one too early), a last pattern runs on
  the whole reply: `(correct )answer is **X**` with X in A-D, case-insensitive, upper-cased (VLMEvalKit
  PR 1552, 2026). Otherwise `can_infer_text`: a reply longer than twice the total length of the option
  texts is rejected; else exactly one option text (lowercased) must occur in the lowercased reply.
  Returns the letter, or None where VLMEvalKit would ask its judge.
- `relaxed_correctness(target, prediction)`: ChartQA's relaxed accuracy as VLMEvalKit has it: plain
  `float()` after stripping whitespace (so `1,000` and `$45` never parse), a trailing `%` divides by
  100 (`50%` is 0.5, not 50), 5% relative tolerance, and a gold value of 0 (or one that does not
  parse) needs a case-insensitive exact string match.
- `python_equal(a, b)`: MathVision's `is_equal`: lowercased, stripped string equality; then Python
  `eval` of both within 1e-6, with `eval` replaced by a safe arithmetic evaluator (numbers,
  + - * / // % ** and Python's `^` = XOR, parentheses: what `eval` gives for those, nothing else
  runs); then `latex2sympy` (from `latex2sympy2_extended`, default settings) of both, compared by
  `eval(str(sympy))` and by `abs(a - b) < 1e-6` on the sympy values. VLMEvalKit's 30 s timeout is
  not reproduced. `latex_value` is the older approximation, kept for `strict_score`.
"""

from __future__ import annotations

import ast
import math
import operator
import re
import string
from collections.abc import Mapping
from typing import Any

_REFUSALS = (
    "Sorry, I can't help with images of people yet.",
    "I can't process this file.",
    "I'm sorry, but without the image provided",
    "Cannot determine the answer",
)
_SEPARATORS = ".()[],:;!*#{}"
_ANSWER_IS = re.compile(r"(?:correct\s+)?answer\s+is\s+\**([ABCD])\**", re.IGNORECASE)


def is_missing(v: Any) -> bool:
    """pandas' `isna` on a scalar: None or a float NaN (an empty TSV cell is read as NaN)."""
    return v is None or (isinstance(v, float) and math.isnan(v))


def build_choices(item: Mapping[str, Any]) -> dict[str, str]:
    """The option columns `A`, `B`, ... of a row that are present (VLMEvalKit's `build_choices`)."""
    return {ch: item[ch] for ch in string.ascii_uppercase if ch in item and not is_missing(item[ch])}


def can_infer_option(answer: str, choices: Mapping[str, Any]) -> str | None:
    if "Failed to obtain answer via API" in answer:
        return None
    for refusal in _REFUSALS:
        if refusal in answer:
            return "Z"
    text = answer
    for c in _SEPARATORS:
        text = text.replace(c, " ")
    tokens = text.split()
    found = [ch for ch in choices if ch in tokens]
    if len(found) == 1:
        ch = found[0]
        if tokens.index(ch) > len(tokens) - 5:
            return ch
    elif not found and "Z" in tokens:
        return "Z"
    # The last step reads the reply as a whole: an explicit "answer is X" anywhere in it.
    m = _ANSWER_IS.search(answer)
    if m and m.group(1).upper() in choices:
        return m.group(1).upper()
    return None


def can_infer_text(answer: str, choices: Mapping[str, Any]) -> str | None:
    answer = answer.lower()
    if len(answer) > 2 * sum(len(str(v)) for v in choices.values()):
        return None
    hits = [k for k, v in choices.items() if str(v).lower() in answer]
    return hits[0] if len(hits) == 1 else None


def can_infer(answer: Any, choices: Mapping[str, Any]) -> str | None:
    answer = str(answer)
    return can_infer_option(answer, choices) or can_infer_text(answer, choices)


# ----------------------------------------------------------------------------------- ChartQA


def _plain_float(text: str) -> float | None:
    try:
        if text.endswith("%"):
            return float(text.rstrip("%")) / 100.0
        return float(text)
    except ValueError:
        return None


def relaxed_correctness(target: Any, prediction: Any, max_relative_change: float = 0.05) -> bool:
    prediction, target = str(prediction), str(target)
    p, t = _plain_float(prediction), _plain_float(target)
    if p is not None and t:
        return abs(p - t) / abs(t) <= max_relative_change
    return prediction.lower() == target.lower()


# ------------------------------------------------------------------------- safe arithmetic


_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.BitXor: operator.xor,
    ast.BitAnd: operator.and_,
    ast.BitOr: operator.or_,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def safe_eval(text: str) -> Any:
    """What Python's `eval` gives for an arithmetic expression, without running anything else.
    Raises ValueError for anything that is not numbers and operators (names, calls, lists, ...)."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError) as e:
        raise ValueError(str(e)) from e

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, (int, float, complex))
            and not isinstance(node.value, bool)
        ):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 1000:
                raise ValueError("exponent too large")
            return _BINOPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")

    try:
        return ev(tree)
    except (ArithmeticError, TypeError) as e:
        raise ValueError(str(e)) from e


_LATEX_SUBS = [
    (re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}"), r"((\1)/(\2))"),
    (re.compile(r"\\sqrt\{([^{}]*)\}"), r"((\1)**0.5)"),
    (re.compile(r"\^\{([^{}]*)\}"), r"**(\1)"),
    (re.compile(r"\\(?:cdot|times)"), "*"),
    (re.compile(r"\\pi"), f"({math.pi})"),
    (re.compile(r"\\left|\\right|\\!|\\,|\\;|\$"), ""),
]


def latex_value(text: str) -> float:
    """A numeric value for simple LaTeX (an approximation of `latex2sympy` + `eval`)."""
    s = text
    for _ in range(4):  # nested \frac{\frac{..}{..}}{..}
        for pat, rep in _LATEX_SUBS:
            s = pat.sub(rep, s)
    s = s.replace("{", "(").replace("}", ")").replace("^", "**")
    s = re.sub(r"(\d|\))\s*\(", r"\1*(", s)  # 2(3) -> 2*(3), \frac's implicit products
    v = safe_eval(s)
    if isinstance(v, complex):
        raise ValueError("complex")
    return float(v)


def python_equal(asw: Any, gt: Any) -> bool:
    """MathVision's `is_equal` (see the module docstring for the two approximated steps)."""
    asw, gt = str(asw).lower().strip(), str(gt).lower().strip()
    if gt == asw:
        return True
    try:
        if abs(safe_eval(gt) - safe_eval(asw)) < 1e-6:
            return True
    except (ValueError, TypeError, OverflowError):
        pass
    try:
        a, b = latex2sympy(gt), latex2sympy(asw)
        try:
            if abs(safe_eval(str(a)) - safe_eval(str(b))) < 1e-6:
                return True
        except (ValueError, TypeError, OverflowError):
            pass
        if abs(a - b) < 1e-6:
            return True
    except Exception:  # noqa: BLE001 - VLMEvalKit's bare except: any parser or sympy failure is "not equal"
        pass
    return False


def latex2sympy(text: str):
    """`latex2sympy2_extended.latex2sympy` with its default settings (imported on first use: it loads antlr)."""
    from latex2sympy2_extended import latex2sympy as parse

    return parse(text)


def literal_list(text: Any) -> list | None:
    """`eval(text)` when it is a list literal (VLMEvalKit's `istype(x, list)`), else None."""
    if isinstance(text, list):
        return text
    try:
        v = ast.literal_eval(str(text))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    return v if isinstance(v, list) else None
