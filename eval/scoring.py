"""Per-benchmark scoring: VLMEvalKit's rule-based verdict (`rule_score`, the default, SPEC section 7)
and a stricter scorer of ours (`strict_score`, labelled "strict" wherever it is reported).

`rule_score(benchmark, prediction, item, judge=False) -> True | False | None`. None means VLMEvalKit
would hand the item to its judge model at this point; a run without a judge counts None as wrong,
which is exactly VLMEvalKit's `exact_matching` mode for the multiple-choice benchmarks. `judge`
says whether a judge runs, which changes WeMath's rule (as in VLMEvalKit). The `*_post_check`
functions score a judge's *extraction* with the benchmark's rule (`eval.judge`).

How each benchmark follows VLMEvalKit (`vlmeval/dataset/...`, read at its 2025 code):

| benchmark | VLMEvalKit | here |
|---|---|---|
| CountBenchQA, PixmoCount | `str(answer) in str(prediction)` | exact (so "1" is found in "10") |
| VStarBench, HRBench4K/8K | `can_infer`, else judge (`exact_matching`: wrong) | exact; None where the judge would run |
| WeMath | with a judge: `can_infer`, else judge; without: the text after the last `Answer`, `<>:.` removed, stripped, its first character if in A-H, == answer | exact, both paths |
| ChartQA | relaxed accuracy, 5%, plain `float()`, max over answers | exact |
| MathVista | prefetch: `can_infer` for multi_choice; `int()`/`float()` == for integer/float; else judge | exact prefetch, incl. gold 0 (falsy) -> judge, text/list -> judge |
| MathVision | `\\boxed{}` taken; `can_infer` for choices; `is_equal` (eval, latex2sympy) for free form | exact but for `eval`, a safe arithmetic evaluator (same value on arithmetic; nothing else runs); latex2sympy2_extended as VLMEvalKit calls it |
| MathVerse | judge extracts the answer, then exact string == answer, else judge | without a judge the prediction stands for the extraction; with one, VLMEvalKit's two calls |
| CharXiv | judge grades every item | exact: always None |

Aggregates (`eval.summary`) follow VLMEvalKit too: HRBench averages the accuracy of each
`cycle_category`; WeMath's headline is the four-dimensional "Score (Strict)" when the rows carry
`ID`/`key` (the paper's WeMath column is that score).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from eval.matching import (
    build_choices,
    can_infer,
    is_missing,
    literal_list,
    python_equal,
    relaxed_correctness,
    safe_eval,
)

COUNT = ("CountBenchQA", "PixmoCount")
MCQ = ("VStarBench", "HRBench4K", "HRBench8K", "WeMath")
ALL = (
    "CountBenchQA",
    "PixmoCount",
    "VStarBench",
    "HRBench4K",
    "HRBench8K",
    "ChartQA",
    "CharXiv",
    "MathVista",
    "MathVision",
    "MathVerse",
    "WeMath",
)


def _check(benchmark: str) -> None:
    if benchmark not in ALL:
        raise ValueError(f"unknown benchmark {benchmark!r}; expected one of {', '.join(ALL)} (VLMEvalKit's names)")


def _answer_str(v: Any) -> str:
    """str() of a gold answer as pandas would have read it from a TSV (an integer column stays int)."""
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def _eval_list(v: Any) -> list:
    if isinstance(v, (list, tuple)):
        return list(v)
    lst = literal_list(v)
    if lst is None:
        raise ValueError(f"choices {v!r} is not a list literal")
    return lst


def _letters(lst: list) -> dict[str, Any]:
    return {chr(65 + i): x for i, x in enumerate(lst)}


def rule_score(benchmark: str, prediction: Any, item: Mapping[str, Any], judge: bool = False) -> bool | None:
    """VLMEvalKit's rule-based verdict for one prediction (see the module docstring)."""
    _check(benchmark)
    if benchmark == "WeMath" and not judge:
        return wemath_no_judge(prediction, item["answer"])
    prediction = "" if is_missing(prediction) else str(prediction)
    if benchmark in COUNT:
        return _answer_str(item["answer"]) in prediction
    if benchmark in MCQ:
        letter = can_infer(prediction, build_choices(item))
        return None if letter is None else letter == str(item["answer"])
    if benchmark == "ChartQA":
        answers = literal_list(item["answer"]) or [item["answer"]]
        pred = prediction.strip()
        return any(relaxed_correctness(a, pred) for a in answers)
    if benchmark == "MathVista":
        return _mathvista(prediction, item)
    if benchmark == "MathVision":
        return _mathvision(prediction, item)
    if benchmark == "MathVerse":
        return True if prediction.strip() == _answer_str(item["answer"]).strip() else None
    return None  # CharXiv: every item goes to the judge


def _mathvista(prediction: str, item: Mapping[str, Any]) -> bool | None:
    if item.get("question_type") == "multi_choice":
        letter = can_infer(prediction, _letters(_eval_list(item["choices"])))
        return None if letter is None else letter == str(item.get("answer_option"))
    kind = item.get("answer_type")
    try:
        if kind == "integer":
            res, ans = int(prediction), int(item["answer"])
        elif kind == "float":
            res, ans = float(prediction), float(item["answer"])
        else:  # VLMEvalKit compares str(None) with the answer here: only a gold "None" passes
            return True if _answer_str(item["answer"]) == "None" else None
    except ValueError:
        return None
    # A prefetched 0 is falsy, so VLMEvalKit sends a correct "0" to the judge anyway.
    return True if res == ans and res else None


_BOXED = re.compile(r"\\boxed\{([^}]*)\}")
_WEMATH_STRIP = re.compile(r"[><:.]")


def wemath_no_judge(prediction: Any, answer: Any) -> bool:
    """WeMath without a judge (VLMEvalKit's `load_and_process_data` when no `hit` column exists): the
    text after the last "Answer" (case-sensitive), stripped, `> < : .` removed, stripped again; its
    first character if it is one of A-H; equal to the answer letter. "(B)" and "the answer is B" miss."""
    if is_missing(prediction):
        return False
    text = _WEMATH_STRIP.sub("", str(prediction).split("Answer")[-1].strip()).strip()
    letter = text[0] if text and text[0] in "ABCDEFGH" else None
    return letter is not None and letter == str(answer)


def mathvista_post_check(extraction: Any, item: Mapping[str, Any]) -> bool:
    """MathVista's rule on a judge's extraction (`post_check(prefetch=False)`). Text and list answers are
    never right: VLMEvalKit compares `str(None)` with them there."""
    ext = "" if is_missing(extraction) else str(extraction)
    if item.get("question_type") == "multi_choice":
        return can_infer(ext, _letters(_eval_list(item["choices"]))) == str(item.get("answer_option"))
    kind = item.get("answer_type")
    try:
        if kind == "integer":
            return int(ext) == int(item["answer"])
        if kind == "float":
            return float(ext) == float(item["answer"])
    except ValueError:
        return False
    return _answer_str(item["answer"]) == "None"


def mathvision_post_check(extraction: Any, item: Mapping[str, Any]) -> bool:
    """MathVision's rule on a judge's extraction (`post_check(prefetch=False)`)."""
    ext = "" if is_missing(extraction) else str(extraction)
    m = _BOXED.search(ext)
    response = m.group(1) if m else ext
    choices = _eval_list(item.get("choices", "[]") or "[]")
    res = can_infer(response, _letters(choices)) if choices else response
    return python_equal(False if res is None else res, item["answer"])


def mathverse_post_check(extraction: Any, answer: Any) -> bool:
    """MathVerse's first check on the extraction: equal strings after strip (else a judge call decides)."""
    return str(extraction).strip() == str(answer).strip()


def _mathvision(prediction: str, item: Mapping[str, Any]) -> bool | None:
    m = _BOXED.search(prediction)
    response = m.group(1) if m else prediction
    choices = _eval_list(item.get("choices", "[]") or "[]")
    if choices:
        letter = can_infer(response, _letters(choices))
        return None if letter is None else python_equal(letter, item["answer"])
    return True if python_equal(response, item["answer"]) else None


# ------------------------------------------------------------------------------- strict


_NUM = re.compile(r"[-+]?\d[\d,]*\.?\d*(?:[eE][-+]?\d+)?%?|[-+]?\.\d+%?")
_WORDS = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten eleven twelve".split())}


def _numbers(text: str) -> list[float]:
    out = []
    for tok in _NUM.findall(text):
        pct = tok.endswith("%")
        try:
            v = float(tok.rstrip("%").replace(",", ""))
        except ValueError:
            continue
        out.append(v / 100 if pct else v)
    return out


def _norm(text: Any) -> str:
    s = str(text).strip().lower()
    s = re.sub(r"^\\boxed\{(.*)\}$", r"\1", s)
    return re.sub(r"\s+", " ", s).strip(" .;:")


def _option_strict(prediction: str, choices: Mapping[str, Any]) -> str | None:
    p = _norm(prediction)
    m = re.fullmatch(r"\(?([a-z])\)?(?:[.:]\s*(.*))?", p)
    if m and m.group(1).upper() in choices:
        return m.group(1).upper()
    hits = [k for k, v in choices.items() if _norm(v) == p]
    return hits[0] if len(hits) == 1 else None


def _same_value(pred: str, gold: str, rel: float = 0.0) -> bool:
    if _norm(pred) == _norm(gold):
        return True
    pn, gn = _numbers(pred), _numbers(gold)
    if len(pn) != 1 or len(gn) != 1:
        try:
            return abs(safe_eval(_norm(pred)) - safe_eval(_norm(gold))) < 1e-6
        except (ValueError, TypeError, OverflowError):
            return False
    p, g = pn[0], gn[0]
    return abs(p - g) <= max(1e-6, rel * abs(g))


def strict_score(benchmark: str, prediction: Any, item: Mapping[str, Any]) -> bool:
    """Our stricter, judge-free scorer (labelled "strict"): the reply must BE the answer.

    Counting: the only number in the reply equals the count (number words up to twelve count).
    Multiple choice: the reply is one option letter ("B", "(B)", "B. text") or exactly one option's
    text. Numbers: thousands separators, %, currency and units are read consistently; ChartQA keeps
    its 5% tolerance, everything else needs equality. Text: case/space-insensitive equality.
    """
    _check(benchmark)
    pred = "" if is_missing(prediction) else str(prediction)
    gold = _answer_str(item["answer"])
    if benchmark in COUNT:
        nums = _numbers(pred) or [float(_WORDS[w]) for w in re.findall(r"[a-z]+", pred.lower()) if w in _WORDS]
        return len(nums) == 1 and nums[0] == float(gold)
    if benchmark in MCQ:
        return _option_strict(pred, build_choices(item)) == gold
    if benchmark == "MathVista" and item.get("question_type") == "multi_choice":
        return _option_strict(pred, _letters(_eval_list(item["choices"]))) == str(item.get("answer_option"))
    if benchmark == "MathVision":
        choices = _eval_list(item.get("choices", "[]") or "[]")
        if choices:
            return _option_strict(pred, _letters(choices)) == gold.upper()
    if benchmark == "ChartQA":
        return any(_same_value(pred, str(a), rel=0.05) for a in (literal_list(item["answer"]) or [gold]))
    return _same_value(pred, gold)
