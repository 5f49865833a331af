"""The `/v1/chat/completions` request, validated by hand so that every mistake is a 400 naming its field.

Supported: model, messages, temperature (0 = greedy), top_p, max_tokens / max_completion_tokens,
stop (string or up to 4 strings), n, seed, stream (+ stream_options.include_usage), logprobs.
Extensions (agent mode): `agent` (bool, or use the `<model>-agent` name), `max_turns`,
`agent_template` (false: send the messages as they are, without the RL template) and
`agent_script` (assistant turns forced in order, e.g. to replay a recorded trajectory's code in the
sandbox; the model samples after them).
Not supported (400 rather than silently wrong): top_logprobs > 0, tools / function calling,
response_format other than text. Unknown fields are ignored, as OpenAI-compatible servers do.

The body itself (`parse_json`): UTF-8 JSON, no NaN / Infinity literals, nested at most
`MAX_DEPTH` deep; numbers must be finite and in range. Every failure of any shape is a 400.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from codedance_jax.serve.errors import APIError

MAX_DEPTH = 32  # a chat request nests ~6 deep (messages[].content[].image_url.url)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_json(raw: bytes) -> Any:
    """The request body as JSON (400 if it is not JSON, uses NaN/Infinity, or nests deeper than MAX_DEPTH)."""
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, int digits limit
        why = "it nests too deep" if isinstance(e, RecursionError) else str(e)[:200]
        raise APIError(400, f"the request body is not valid JSON ({why})") from e
    stack = [(body, 1)]
    while stack:  # iterative: the check itself must not recurse
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > MAX_DEPTH:
                raise APIError(400, f"the request body nests deeper than {MAX_DEPTH} levels")
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return body


@dataclasses.dataclass
class ChatRequest:
    model: str
    messages: list
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    n: int = 1
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    agent: bool = False
    max_turns: int = 10

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _num(body, key, kind, lo, hi, default, *, lo_open=False):
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise APIError(400, f"{key} must be {'an integer' if kind is int else 'a number'}; got {v!r}", param=key)
    if isinstance(v, float) and not math.isfinite(v):  # 1e999 parses as inf
        raise APIError(400, f"{key} must be a finite number; got {v!r}", param=key)
    if isinstance(v, float) and kind is int and not v.is_integer():
        raise APIError(400, f"{key} must be an integer; got {v!r}", param=key)
    rng = f"{'(' if lo_open else '['}{lo}, {hi}]"
    if abs(v) > 1 << 62:  # a 4000-digit integer is valid JSON; float() of it would overflow
        raise APIError(400, f"{key} must be in {rng}", param=key)
    v = kind(v)
    if (v <= lo if lo_open else v < lo) or v > hi:
        raise APIError(400, f"{key} must be in {rng}; got {v}", param=key)
    return v


def _bool(body, key, default=False):
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise APIError(400, f"{key} must be true or false; got {v!r}", param=key)
    return v


def parse_chat_request(body: Any, max_n: int = 16) -> ChatRequest:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "model is required (GET /v1/models lists the names)", param="model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", param="messages")
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        stop = tuple(s for s in stop if s)
    else:
        raise APIError(400, "stop must be a string or a list of at most 4 strings", param="stop")
    if body.get("top_logprobs"):
        raise APIError(400, "top_logprobs is not supported by this server (logprobs=true gives each sampled "
                       "token's log-probability)", param="top_logprobs")
    if body.get("tools") or body.get("functions"):
        raise APIError(400, "tools / function calling are not supported; use agent mode for code execution",
                       param="tools")
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise APIError(400, "response_format other than text is not supported", param="response_format")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or abs(seed) >= 1 << 63):
        raise APIError(400, f"seed must be an integer in (-2^63, 2^63); got {seed!r}", param="seed")
    max_tokens = _num(body, "max_completion_tokens", int, 1, 1 << 30, None)
    max_tokens = _num(body, "max_tokens", int, 1, 1 << 30, max_tokens)
    so = body.get("stream_options") or {}
    if not isinstance(so, dict):
        raise APIError(400, "stream_options must be an object", param="stream_options")
    return ChatRequest(
        model=model,
        messages=messages,
        temperature=_num(body, "temperature", float, 0.0, 2.0, 1.0),
        top_p=_num(body, "top_p", float, 0.0, 1.0, 1.0, lo_open=True),
        max_tokens=max_tokens,
        stop=stop,
        n=_num(body, "n", int, 1, max_n, 1),
        seed=seed,
        stream=_bool(body, "stream"),
        include_usage=_bool(so, "include_usage"),
        logprobs=_bool(body, "logprobs"),
        agent=_bool(body, "agent"),
        max_turns=_num(body, "max_turns", int, 1, 32, 10),
    )
