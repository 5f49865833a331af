"""An optional judge model behind an OpenAI-compatible `/chat/completions` URL (off by default).

It is asked only about items whose rule verdict is None (where VLMEvalKit would ask its own judge:
a multiple-choice reply with no recognisable option, MathVista/MathVision/MathVerse answers the
prefetch rules cannot settle, every CharXiv item). Its verdict is reported in its own column
(`judge_hit`) and its own accuracy ("rule + judge"); the rule-based accuracy is always reported
beside it. The prompt is ours (one equivalence question), not VLMEvalKit's per-benchmark
extraction prompts, so "rule + judge" approximates VLMEvalKit's judged numbers; it does not
reproduce them. Judge failures (network, unparsable reply) abstain: the verdict stays None.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

from eval.matching import build_choices

PROMPT = """You grade answers to a benchmark question. Decide whether the model's final answer means the same as the reference answer.
For multiple choice, the model must select the reference option (by letter or by its text). For numbers, equal values
with or without units count as the same; rounding to the precision the question asks for is fine.

Question: {question}
{options}Reference answer: {answer}
Model's answer: {prediction}

Reply with a single character: 1 if the model's answer is correct, 0 if not."""


class Judge:
    """`Judge(url, model)(question, answer, prediction, row) -> True | False | None`."""

    def __init__(
        self, url: str, model: str, api_key_env: str = "OPENAI_API_KEY", timeout_s: float = 60.0, retries: int = 2
    ):
        if not url:
            raise ValueError("judge.url is empty: give an OpenAI-compatible base URL, e.g. http://localhost:8000/v1")
        self.url = url.rstrip("/") + ("" if url.rstrip("/").endswith("/chat/completions") else "/chat/completions")
        self.model, self.api_key_env, self.timeout_s, self.retries = model, api_key_env, timeout_s, retries
        self.calls = self.failures = 0

    def __call__(self, question: str, answer, prediction: str, row: dict) -> bool | None:
        options = build_choices(row)
        opt = "".join(f"{k}. {v}\n" for k, v in options.items())
        content = PROMPT.format(
            question=question, options=f"Options:\n{opt}" if opt else "", answer=answer, prediction=prediction
        )
        body = json.dumps(
            {"model": self.model, "temperature": 0, "max_tokens": 4, "messages": [{"role": "user", "content": content}]}
        ).encode()
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.api_key_env)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        for _ in range(self.retries + 1):
            self.calls += 1
            try:
                req = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
                with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                    reply = json.loads(r.read())["choices"][0]["message"]["content"].strip()
            except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError, TypeError):
                continue
            if reply[:1] in ("0", "1"):
                return reply[:1] == "1"
        self.failures += 1
        return None
