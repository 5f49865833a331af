"""An optional judge model behind any OpenAI-compatible endpoint (off by default), through the `openai` client.

    judge = Judge("http://127.0.0.1:8000/v1", "codedance", benchmark="MathVista")   # e.g. launch.serve
    judge(question, answer, prediction, row) -> True | False | None

It is asked only about items whose rule verdict is None (where VLMEvalKit would ask its own judge)
and follows VLMEvalKit's per-benchmark procedure (`judge_prompts.py`): extract the answer from the
reply, then score the extraction with the benchmark's own rule; MathVerse adds a consistency call,
the multiple-choice benchmarks map the reply onto an option letter, CharXiv grades. Its verdict
is reported in its own column (`judge_hit`) and accuracy ("rule + judge"), beside the rule-based one.

Transport: `openai.OpenAI(base_url=url, api_key=$api_key_env, timeout=timeout_s, max_retries=retries)`:
the client retries connection errors, 408/409/429 and 5xx with backoff. On top of that, as
VLMEvalKit does, an unusable reply is asked again (up to `attempts` times) at temperatures 0, 0.5,
1.0, ... Judge failures abstain: the verdict stays None, counted in `failures`.
"""

from __future__ import annotations

import json
import os
import re

from eval import judge_prompts as prompts
from eval.matching import build_choices, can_infer
from eval.scoring import mathverse_post_check, mathvision_post_check, mathvista_post_check

JUDGED = ("MathVista", "MathVision", "MathVerse", "WeMath", "CharXiv", "VStarBench", "HRBench4K", "HRBench8K")


class Judge:
    """See the module docstring. `benchmark` picks the procedure (VLMEvalKit's names)."""

    def __init__(self, url: str, model: str, benchmark: str | None = None, api_key_env: str = "OPENAI_API_KEY",
                 timeout_s: float = 60.0, retries: int = 2, attempts: int = 5, max_tokens: int = 128, client=None):
        if not url and client is None:
            raise ValueError("judge.url is empty: give an OpenAI-compatible base URL, e.g. http://localhost:8000/v1")
        import openai

        self.openai = openai
        base = (url or "").rstrip("/")
        base = base[: -len("/chat/completions")] if base.endswith("/chat/completions") else base
        # A local server needs no key; the client insists on one being set.
        key = os.environ.get(api_key_env) or "EMPTY"
        self.client = client or openai.OpenAI(base_url=base, api_key=key, timeout=timeout_s, max_retries=retries)
        self.model, self.benchmark = model, benchmark
        self.attempts, self.max_tokens = attempts, max_tokens
        self.calls = self.failures = 0

    # ------------------------------------------------------------------ transport
    def complete(self, prompt: str, temperature: float = 0.0, max_tokens: int | None = None) -> str | None:
        """The judge's reply text, or None after the client's own retries failed."""
        self.calls += 1
        try:
            r = self.client.chat.completions.create(
                model=self.model, messages=[{"role": "user", "content": prompt}], temperature=temperature,
                max_tokens=max_tokens or self.max_tokens)
            return r.choices[0].message.content or ""
        except (self.openai.OpenAIError, IndexError, AttributeError):
            return None

    def _ask(self, prompt: str, accept, max_tokens: int | None = None):
        """Ask until `accept(reply)` is not None (VLMEvalKit raises the temperature by 0.5 per try)."""
        for k in range(self.attempts):
            reply = self.complete(prompt, temperature=0.5 * k, max_tokens=max_tokens)
            if reply is None:
                continue
            v = accept(reply)
            if v is not None:
                return v
        return None

    # ------------------------------------------------------------------ procedures
    def __call__(self, question: str, answer, prediction: str, row: dict) -> bool | None:
        bench = self.benchmark or row.get("benchmark")
        prediction = "" if prediction is None else str(prediction)
        if bench in ("MathVista", "MathVision"):
            ext = self._ask(prompts.extraction_prompt(bench, question, prediction), lambda r: r.strip())
            verdict = None if ext is None else (mathvista_post_check if bench == "MathVista" else
                                                mathvision_post_check)(ext, row)
        elif bench == "MathVerse":
            verdict = self._mathverse(row.get("question_for_eval", question), answer, prediction)
        elif bench == "CharXiv":
            verdict = self._ask(prompts.charxiv_prompt(question, answer, prediction), _charxiv_score)
        else:  # multiple choice: map the reply onto an option, compare letters
            options = build_choices(row)
            # The judge's letter goes through `can_infer` as in VLMEvalKit; "Z" (no option fits) is wrong.
            letter = self._ask(prompts.option_match_prompt(question, options, prediction),
                               lambda r: can_infer(r, options))
            verdict = None if letter is None else letter == str(answer)
        if verdict is None:
            self.failures += 1
        return verdict

    def _mathverse(self, question: str, answer, prediction: str) -> bool | None:
        ext = self._ask(prompts.mathverse_extract_prompt(prediction), lambda r: r.strip())
        if ext is None:
            return None
        if mathverse_post_check(ext, answer):
            return True
        return self._ask(prompts.mathverse_score_prompt(question, str(answer), ext),
                         lambda r: {"0": False, "1": True}.get(r.strip()))


def _charxiv_score(reply: str) -> bool | None:
    m = re.search(r"\{.*\}", reply, re.DOTALL)
    if not m:
        return None
    try:
        score = json.loads(m.group(0)).get("score")
    except (json.JSONDecodeError, AttributeError):
        return None
    return {0: False, 1: True, "0": False, "1": True}.get(score)
