"""A model role (judge, weak, teacher, verifier) as users run it: an OpenAI-compatible endpoint.

    ep = Endpoint(url="http://127.0.0.1:8000/v1", model="codedance", api_key_env="OPENAI_API_KEY",
                  cache_path=DIR + "/cache/weak.jsonl", concurrency=4, timeout_s=120, retries=4)
    text = ep.chat(messages, temperature=1.0, max_tokens=256, sample=2)

Transport: the `openai` client (`timeout`, `max_retries`: it retries connection errors, 408/409/429
and 5xx with exponential backoff). At most `concurrency` requests of a role are in flight at once
(a semaphore), whatever the number of worker threads of a stage.

The response cache: one JSON line per answered request, appended and flushed as it arrives
(`{"key": sha256, "text": ...}`), keyed by the role's model, the messages, the sampling parameters
and the sample index (so the k samples of pass@k stay distinct). A re-run reads the file and pays
nothing for a request it already made; a run killed mid-write leaves at most one torn last line,
which is ignored. A failed request raises `EndpointError` and is not cached.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from typing import Any

from codedance_jax.errors import UserError


class EndpointError(RuntimeError):
    """A request failed after the client's retries (the item is retried by the next run)."""


def image_part(png: bytes) -> dict[str, Any]:
    import base64

    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}


def read_jsonl_tolerant(path: str) -> list[dict[str, Any]]:
    """The complete JSON lines of `path` ([] if absent); a torn last line (killed writer) is skipped."""
    if not os.path.exists(path):
        return []
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break  # torn write: the rest of the file is garbage
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    break
    return rows


def repair_jsonl(path: str) -> None:
    """Cut a torn last line off `path`, so appends start on a fresh line."""
    if not os.path.exists(path):
        return
    with open(path, "rb+") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end != len(data):
            f.truncate(end)


class ResponseCache:
    """Append-only JSONL map key -> reply text (see the module docstring)."""

    def __init__(self, path: str | None):
        self.path, self.lock = path, threading.Lock()
        self.data: dict[str, str] = {}
        self.hits = self.misses = 0
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            repair_jsonl(path)
            self.data = {r["key"]: r["text"] for r in read_jsonl_tolerant(path)}

    def get(self, key: str) -> str | None:
        with self.lock:
            text = self.data.get(key)
            if text is None:
                self.misses += 1
            else:
                self.hits += 1
            return text

    def put(self, key: str, text: str) -> None:
        with self.lock:
            self.data[key] = text
            if self.path:
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(json.dumps({"key": key, "text": text}) + "\n")
                    f.flush()


class Endpoint:
    """One role's endpoint; see the module docstring."""

    def __init__(self, url, model: str, *, role: str = "model", api_key_env: str = "OPENAI_API_KEY",
                 cache_path: str | None = None, concurrency: int = 4, timeout_s: float = 120.0, retries: int = 4,
                 client=None):
        """`url`: the base URL, or a callable returning it, called on the first cache miss (so a
        server that only this role needs, e.g. `launch.serve` for the weak model, starts only when
        a request has to be sent: a resumed or finished run does not wait for it)."""
        if not url and client is None:
            raise UserError(f"curate: the {role} endpoint has no url",
                            f"set --config.{role}.url=http://HOST:PORT/v1 (any OpenAI-compatible server)")
        import openai

        self.openai, self.role, self.model = openai, role, model
        self._url, self._api_key_env, self._timeout_s, self._retries = url, api_key_env, timeout_s, retries
        self.client, self._start_lock = client, threading.Lock()
        self.slots = threading.BoundedSemaphore(max(1, concurrency))
        self.cache = ResponseCache(cache_path)
        self.requests = 0  # made over the network by this process (cache misses that were sent)

    def _client(self):
        with self._start_lock:
            if self.client is None:
                import logging

                url = self._url() if callable(self._url) else self._url
                # httpx logs one INFO line per request; set here, after whatever start-up reconfigured logging.
                logging.getLogger("httpx").setLevel(logging.WARNING)
                base = url.rstrip("/")
                base = base[: -len("/chat/completions")] if base.endswith("/chat/completions") else base
                key = os.environ.get(self._api_key_env) or "EMPTY"  # a local server needs no key; the client wants one
                self.client = self.openai.OpenAI(base_url=base, api_key=key, timeout=self._timeout_s,
                                                 max_retries=self._retries)
            return self.client

    def key(self, messages: list[dict[str, Any]], params: dict[str, Any], sample: int) -> str:
        blob = json.dumps({"model": self.model, "messages": messages, "params": params, "sample": sample},
                          sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    def chat(self, messages: list[dict[str, Any]], *, temperature: float = 0.0, max_tokens: int = 512,
             stop: list[str] | None = None, sample: int = 0) -> str:
        params = {"temperature": temperature, "max_tokens": max_tokens, "stop": stop or None}
        key = self.key(messages, params, sample)
        text = self.cache.get(key)
        if text is not None:
            return text
        kwargs = dict(model=self.model, messages=messages, temperature=temperature, max_tokens=max_tokens)
        if stop:
            kwargs["stop"] = stop
        if sample:
            kwargs["seed"] = sample  # servers that honour it make the k samples reproducible
        with self.slots:
            self.requests += 1
            try:
                r = self._client().chat.completions.create(**kwargs)
                text = r.choices[0].message.content or ""
            except (self.openai.OpenAIError, IndexError, AttributeError) as e:
                raise EndpointError(f"{self.role} ({self.model}): {type(e).__name__}: {e}") from e
        self.cache.put(key, text)
        return text


def ask(endpoint: Endpoint, prompt: str, images: list[bytes] = (), **kw) -> str:
    """One user turn: the images first, then the prompt text."""
    content = [image_part(p) for p in images] + [{"type": "text", "text": prompt}]
    return endpoint.chat([{"role": "user", "content": content}], **kw)
