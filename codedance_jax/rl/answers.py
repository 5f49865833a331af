"""R_acc: extract the final answer of a response and decide whether it matches the gold answer.

The reward path (training) is this module; the benchmark scorers that reproduce VLMEvalKit's rules
live in `eval/` and are deliberately *looser or stricter* in VLMEvalKit's own ways. Here the goal
is a fair 0/1 training signal:

- extraction: the content of the last `<answer>…</answer>`; if it holds `\\boxed{…}`, the last boxed
  content (braces balanced);
- numbers: ints, decimals, scientific notation, fractions (`3/4`, `\\frac{3}{4}`), percentages,
  with currency signs, units and thousands separators stripped; exact or within `rel_tol`;
  "50%" matches 50 and 0.5;
- multiple choice: a letter ("B", "(B)", "B.", "Option B") or the option's text, when the item
  gives its options;
- yes/no, and otherwise normalized free text (case, punctuation, articles, whitespace);
- math: `math-verify` (symbolic equivalence via sympy) when installed, tried after the rules;
- a pluggable `Verifier` protocol; `JudgeVerifier` asks an OpenAI-compatible endpoint (what the
  authors used), off by default, stdlib HTTP only. `CascadeVerifier` chains them as the release
  does: rules first, the judge only when the rules say no.

A verifier returns True/False, or None to abstain. An empty or missing answer is never correct.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import string
import threading
import urllib.request
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Protocol

# The answer is read by the turn protocol, so the engine records the answer this module scores;
# both names stay importable from here.
from codedance_jax.protocol import extract_answer, extract_boxed  # noqa: F401

# --- numbers ---------------------------------------------------------------------------------

_FRAC_RE = re.compile(r"^\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")
_UNIT_TAIL = re.compile(r"(?<=[\d.])\s*(?:[a-zA-Zµ°²³/]+[a-zA-Z²³]*\.?|degrees?|°[CF]?)\s*$")
_NUM = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"


def parse_number(text: str) -> tuple[float, bool] | None:
    """(value, is_percent) if `text` is one number (with optional sign, currency, thousands
    separators, %, unit, fraction, LaTeX wrappers); None otherwise."""
    s = text.strip().strip("$").strip()
    s = s.replace("\\%", "%").replace("\\$", "").replace("\\!", "").replace("\\,", "").replace("−", "-")
    s = re.sub(r"\\(?:text|mathrm|mbox)\{([^{}]*)\}", r" \1", s).strip()
    s = s.rstrip(".").strip()
    s = re.sub(r"^(?:[$€£¥]|USD|EUR)\s*", "", s)
    neg = False
    if s.startswith("-") and len(s) > 1 and not s[1].isdigit() and s[1] not in ".\\":
        return None
    m = _FRAC_RE.match(s.lstrip("-+"))
    if m:
        neg = s.startswith("-")
        try:
            v = float(Fraction(m.group(1).strip()) / Fraction(m.group(2).strip()))
        except (ValueError, ZeroDivisionError):
            return None
        return (-v if neg else v), False
    percent = s.endswith("%") or s.lower().endswith(" percent")
    s = re.sub(r"\s*(?:%|percent)$", "", s, flags=re.IGNORECASE)
    s = _UNIT_TAIL.sub("", s).strip()
    # Thousands separators only in their canonical 3-digit grouping, so "1,2" is not 12.
    if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    s = re.sub(r"(?<=\d) (?=\d{3}\b)", "", s)  # "1 000"
    if re.fullmatch(_NUM, s):
        return float(s), percent
    fm = re.fullmatch(r"([-+]?\d+)\s*/\s*(\d+)", s)
    if fm and int(fm.group(2)) != 0:
        return int(fm.group(1)) / int(fm.group(2)), percent
    return None


def numbers_match(pred: str, gold: str, *, rel_tol: float = 0.0, abs_tol: float = 1e-9) -> bool | None:
    """None when either side is not a number; else equality within tolerance. A percentage on
    one side also matches its fraction form on the other ("50%" ~ 0.5 ~ 50)."""
    p, g = parse_number(pred), parse_number(gold)
    if p is None or g is None:
        return None
    pv, ppct = p
    gv, gpct = g
    cands = [pv] + ([pv / 100.0] if ppct and not gpct else []) + ([pv * 100.0] if gpct and not ppct else [])
    return any(math.isclose(c, gv, rel_tol=rel_tol, abs_tol=abs_tol) for c in cands)


# --- text, options, yes/no -------------------------------------------------------------------

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_text(text: str) -> str:
    """Lowercase, drop LaTeX text wrappers, punctuation, articles and extra whitespace."""
    s = re.sub(r"\\(?:text|mathrm|textbf|mbox)\{([^{}]*)\}", r"\1", text)
    s = s.lower().translate(_PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def yes_no(text: str) -> str | None:
    """'yes' / 'no' when the answer starts with one of them (or true/false); None otherwise."""
    words = normalize_text(text).split()
    if not words:
        return None
    return {"yes": "yes", "true": "yes", "no": "no", "false": "no"}.get(words[0])


# A leading uppercase letter, optionally after "Option"/"Choice"/"Answer" (any case) and in
# parentheses, followed by punctuation, space or the end: "B", "(B)", "B.", "option b" is not one.
_LETTER_RE = re.compile(r"^\s*(?:(?i:option|choice|answer)\s*:?\s*)?\(?([A-Z])\)?(?:[.:)\s]|$)")


def option_letter(text: str, choices: Mapping[str, str] | None = None) -> str | None:
    """The option letter a reply picks: a leading letter ("B", "(B)", "B.", "Option B: ...") or,
    with `choices`, the unique option whose text the reply equals or starts with."""
    s = text.strip()
    m = _LETTER_RE.match(s)
    if m and (choices is None or m.group(1) in choices):
        return m.group(1)
    if choices:
        norm = normalize_text(s)
        hits = [k for k, v in choices.items() if normalize_text(str(v)) == norm]
        if len(hits) == 1:
            return hits[0]
    return None


# --- verifiers -------------------------------------------------------------------------------


class Verifier(Protocol):
    """Decides whether `prediction` (the extracted answer) matches `gold`; None = abstain."""

    def __call__(
        self, prediction: str, gold: str, *, question: str = "", choices: Mapping[str, str] | None = None
    ) -> bool | None: ...


_PLAIN_WORDS = re.compile(r"[A-Za-z][A-Za-z\s]*")


def _math_verify(pred: str, gold: str) -> bool | None:
    """Symbolic equivalence of two answers (math-verify), None when it cannot tell.

    Two plain words are not asked: math-verify reads a word as the product of its letters, so it
    called anagrams equal ("listen" = "silent", "no" = "on", "ab" = "ba"); words are compared as
    text by the caller. Results are memoised per pair: the same wrong answer recurs across a
    group's rollouts, and one math-verify call costs ~0.1 s (1.1 s of a demo GRPO step's scoring)."""
    if _PLAIN_WORDS.fullmatch(pred.strip()) and _PLAIN_WORDS.fullmatch(gold.strip()):
        return None
    return _math_verify_cached(pred, gold)


@functools.lru_cache(maxsize=1 << 14)
def _math_verify_cached(pred: str, gold: str) -> bool | None:
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    # math-verify's timeouts use SIGALRM, which only works on the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    try:
        # Bare LaTeX without $ delimiters is not extracted; wrap what is not already delimited.
        g = parse(gold if "$" in gold else f"${gold}$", parsing_timeout=timeout)
        p = parse(pred if "$" in pred else f"${pred}$", parsing_timeout=timeout)
        if not g or not p:
            return None
        return bool(verify(g, p, timeout_seconds=timeout))
    except Exception:  # a parser crash on hostile model output is an abstention, not a failure
        return None


@dataclasses.dataclass(frozen=True)
class RuleVerifier:
    """Deterministic rules: options, yes/no, numbers, math-verify, normalized text."""

    rel_tol: float = 0.0
    """Relative tolerance for numbers (0 = exact; ChartQA-style relaxed accuracy uses 0.05)."""
    use_math_verify: bool = True
    """Try symbolic equivalence (math-verify) when the simpler rules fail."""

    def __call__(
        self, prediction: str, gold: str, *, question: str = "", choices: Mapping[str, str] | None = None
    ) -> bool | None:
        pred, gold = prediction.strip(), str(gold).strip()
        if not pred:
            return False
        if choices:
            gold_letter = option_letter(gold, choices)
            if gold_letter is not None:
                pred_letter = option_letter(pred, choices)
                if pred_letter is not None:
                    return pred_letter == gold_letter
        gold_yn = yes_no(gold)
        if gold_yn is not None and len(normalize_text(gold).split()) <= 3:
            pred_yn = yes_no(pred)
            if pred_yn is not None:
                return pred_yn == gold_yn
        num = numbers_match(pred, gold, rel_tol=self.rel_tol)
        if num is not None:
            return num
        if normalize_text(pred) == normalize_text(gold):
            return True
        if self.use_math_verify and _math_verify(pred, gold):
            return True
        return False


JUDGE_PROMPT = """Below are two answers to a question. [Question] is the question, [Standard Answer] is the standard answer, and [Model Answer] is the answer extracted from a model's output. Determine whether these two answers are consistent: they are consistent whenever they are essentially the same, for example 'pink' and 'it is pink'. If they are consistent the judgement is 1, otherwise 0. Output only the judgement.

[Question]: {question}
[Standard Answer]: {gold}
[Model Answer]: {prediction}
Judgement:"""


@dataclasses.dataclass(frozen=True)
class JudgeVerifier:
    """An LLM judge behind an OpenAI-compatible `/chat/completions` endpoint (the authors' setup).

    url: the API base, e.g. "http://host:18901/v1". Off unless constructed. Network errors and
    unparseable replies abstain (None) after `retries` attempts, so a flaky judge never crashes a
    training step; count abstentions in the caller.
    """

    url: str
    model: str = "judge"
    api_key: str | None = None
    timeout_s: float = 30.0
    retries: int = 2
    temperature: float = 0.0
    prompt: str = JUDGE_PROMPT

    def __call__(
        self, prediction: str, gold: str, *, question: str = "", choices: Mapping[str, str] | None = None
    ) -> bool | None:
        if not prediction.strip():
            return False
        body = {
            "model": self.model,
            "messages": [
                {"role": "user", "content": self.prompt.format(question=question, gold=gold, prediction=prediction)}
            ],
            "temperature": self.temperature,
        }
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(
            self.url.rstrip("/") + "/chat/completions", data=json.dumps(body).encode(), headers=headers, method="POST"
        )
        for _ in range(max(1, self.retries)):
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    reply = json.loads(resp.read().decode())["choices"][0]["message"]["content"]
            except (OSError, ValueError, KeyError, IndexError, TypeError):
                continue
            verdict = parse_judgement(str(reply))
            if verdict is not None:
                return verdict
        return None


def parse_judgement(reply: str) -> bool | None:
    """1/0 or true/false after the last 'Judgement:' (the release's two prompt styles)."""
    tail = reply.split("Judgement:")[-1].split("Equivalence Judgement")[-1].strip().lower()
    has_yes = "1" in tail or "true" in tail
    has_no = "0" in tail or "false" in tail
    if has_yes != has_no:
        return has_yes
    return None


@dataclasses.dataclass(frozen=True)
class CascadeVerifier:
    """First True wins; else False if any verifier said False; else None (all abstained)."""

    verifiers: Sequence[Verifier]

    def __call__(
        self, prediction: str, gold: str, *, question: str = "", choices: Mapping[str, str] | None = None
    ) -> bool | None:
        verdict = None
        for v in self.verifiers:
            out = v(prediction, gold, question=question, choices=choices)
            if out:
                return True
            if out is False:
                verdict = False
        return verdict


DEFAULT_VERIFIER = RuleVerifier()


def accuracy_reward(
    response: str,
    gold: str,
    *,
    question: str = "",
    choices: Mapping[str, str] | None = None,
    verifier: Verifier = DEFAULT_VERIFIER,
    max_answer_chars: int | None = None,
) -> float:
    """R_acc ∈ {0, 1} of a full response: extract the final answer and verify it.

    max_answer_chars: the release scores answers of ≥ 1000 characters as wrong; None = no limit.
    """
    return answer_reward(extract_answer(response), gold, question=question, choices=choices, verifier=verifier,
                         max_answer_chars=max_answer_chars)


def answer_reward(
    answer: str | None,
    gold: str,
    *,
    question: str = "",
    choices: Mapping[str, str] | None = None,
    verifier: Verifier = DEFAULT_VERIFIER,
    max_answer_chars: int | None = None,
) -> float:
    """R_acc ∈ {0, 1} of an answer already extracted (`extract_answer`; the rollout engine records it)."""
    if not answer:
        return 0.0
    if max_answer_chars is not None and len(answer) >= max_answer_chars:
        return 0.0
    return 1.0 if verifier(answer, gold, question=question, choices=choices) else 0.0
