"""The FastAPI app: `/v1/models`, `/v1/chat/completions` (plain, streamed, agent), `/health`.

`Server.app` is the FastAPI app behind `guard.Guard` (Host, Origin, API key, body limits), with
CORS headers for the allowed origins. Every error is OpenAI-shaped JSON (`errors.py`): validation and image problems are 400, a prompt
over the context budget is a 400 with code `context_length_exceeded`, an unknown model 404, a bug
500 with the exception's name and message but no traceback. A streamed request that fails after
its headers were sent gets one `data: {"error": ...}` event and `[DONE]`, never a hung connection.

A client that hangs up (streamed or not) cancels its choices at once: a task waits for the
connection's `http.disconnect` beside the reply, so the batcher drops them from its queue or frees
their rows after the running chunk, instead of decoding to `max_tokens` for nobody.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from codedance_jax.rollout import Prompt
from codedance_jax.serve import agent as agent_lib
from codedance_jax.serve import messages as msg_lib
from codedance_jax.serve.batcher import Batcher, Choice, request_uid
from codedance_jax.serve.errors import APIError, error_body
from codedance_jax.serve.guard import Guard
from codedance_jax.serve.media import DEFAULT_MAX_PIXELS, LocalMedia
from codedance_jax.serve.schema import ChatRequest, parse_chat_request, parse_json

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ServeConfig:
    """What the server serves and its budgets.

    model_name: the name `/v1/models` lists (`<model_name>-agent` runs agent mode). max_context:
    prompt + completion tokens per sequence. max_batch: rows decoded together. decode_chunk: decode
    steps per device call (streaming granularity and the most a new request waits to join).

    What clients may do (`guard.py`, `media.py`): host: the address the server listens on (Host
    headers naming it are served). api_key: required as a Bearer token on every route when set.
    allowed_hosts / allowed_origins: more Host names, and browser origins, to serve.
    allowed_local_media_path: directories whose world-readable files image URLs may name (none:
    data URLs only). max_body_bytes, body_timeout_s, header_timeout_s: request size and time
    limits. max_image_pixels: the largest image decoded (checked from its header).

    mesh_data, mesh_tensor: the sampling mesh, over this process's devices
    (`rollout.placement.sampling_mesh`): rows split over `mesh_data` devices (-1: every device that
    `mesh_tensor` leaves; `max_batch` must divide by it), the weights and KV cache split over groups
    of `mesh_tensor` (for a policy larger than one chip). The model's parameters are placed for it
    on device (`placement.sampling_params`). 1 x 1 (the default): one device, as before.
    """

    model_name: str = "codedance"
    max_context: int = 4096
    max_batch: int = 8
    decode_chunk: int = 16
    max_n: int = 16
    agent: bool = True
    sandbox_workers: int = 2
    sandbox_timeout_s: float = 15.0
    turn_format: str = "code"
    host: str = "127.0.0.1"
    api_key: str | None = None
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    allowed_local_media_path: tuple[str, ...] = ()
    max_body_bytes: int = 32 << 20
    body_timeout_s: float = 60.0
    header_timeout_s: float = 10.0
    max_image_pixels: int = DEFAULT_MAX_PIXELS
    mesh_data: int = 1
    mesh_tensor: int = 1


def sampling_layout(model, cfg: ServeConfig):
    """(the sampling mesh or None, `model` placed for it): `cfg.mesh_data` x `mesh_tensor` of this
    process's devices. A one-device mesh (the default) leaves the model where it was loaded (None)."""
    from codedance_jax.errors import ConfigError
    from codedance_jax.rollout.placement import sampling_mesh, sampling_model

    try:
        mesh = sampling_mesh(cfg.mesh_data, cfg.mesh_tensor)
    except ConfigError as e:  # named as launch.serve's flags, not the run configs' fields
        raise ConfigError(e.message.replace("config.rollout.", "--"), e.fix.replace("config.rollout.", "--")) from None
    if mesh.size == 1:
        return None, model
    return mesh, sampling_model(model, mesh)  # the loaded arrays are freed once placed


class Server:
    """Holds the model, the chat batcher and the agent worker; `app` is the ASGI application."""

    def __init__(self, model, processor, cfg: ServeConfig | None = None):
        self.cfg = cfg or ServeConfig()
        c = self.cfg
        self.mesh, model = sampling_layout(model, c)
        self.model, self.processor = model, processor
        self.batcher = Batcher(model, processor, max_batch=c.max_batch, max_context=c.max_context,
                               decode_chunk=c.decode_chunk, mesh=self.mesh)
        self.agent = None
        if c.agent:
            self.agent = agent_lib.AgentWorker(model, processor, max_context=c.max_context, decode_chunk=c.decode_chunk,
                                               sandbox_workers=c.sandbox_workers, sandbox_timeout_s=c.sandbox_timeout_s,
                                               turn_format=c.turn_format, mesh=self.mesh)
        self.created = int(time.time())
        self.local_media = LocalMedia(c.allowed_local_media_path, max_bytes=c.max_body_bytes)
        inner = self._build_app()
        if c.allowed_origins:
            inner = CORSMiddleware(inner, allow_origins=list(c.allowed_origins), allow_methods=["GET", "POST"],
                                   allow_headers=["authorization", "content-type"])
        self.app = Guard(inner, bound_host=c.host, allowed_hosts=c.allowed_hosts, allowed_origins=c.allowed_origins,
                         api_key=c.api_key, max_body_bytes=c.max_body_bytes, body_timeout_s=c.body_timeout_s)

    def start(self):
        self.batcher.start()
        if self.agent is not None:
            self.agent.start()

    def close(self):
        self.batcher.close()
        if self.agent is not None:
            self.agent.close()

    @property
    def model_names(self) -> list[str]:
        names = [self.cfg.model_name]
        if self.agent is not None:
            names.append(self.cfg.model_name + "-agent")
        return names

    # ------------------------------------------------------------------ the app
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="codedance-jax", docs_url=None, redoc_url=None)

        @app.exception_handler(APIError)
        async def _api_error(_req, e: APIError):
            return JSONResponse(e.body(), status_code=e.status)

        @app.exception_handler(RequestValidationError)
        async def _validation(_req, e: RequestValidationError):
            return JSONResponse(error_body(400, f"invalid request: {e.errors()[:3]}"), status_code=400)

        @app.exception_handler(StarletteHTTPException)
        async def _http(_req, e: StarletteHTTPException):
            return JSONResponse(error_body(e.status_code, str(e.detail)), status_code=e.status_code)

        @app.exception_handler(Exception)
        async def _bug(_req, e: Exception):
            log.exception("request failed")
            return JSONResponse(error_body(500, f"internal error: {type(e).__name__}: {e}"), status_code=500)

        @app.get("/health")
        async def health():
            ok = self.batcher.error is None
            return JSONResponse({"status": "ok" if ok else "error", "error": self.batcher.error,
                                 "stats": self.batcher.snapshot()}, status_code=200 if ok else 503)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [self._model_card(n) for n in self.model_names]}

        @app.get("/v1/models/{name}")
        async def model(name: str):
            if name not in self.model_names:
                raise self._unknown_model(name)
            return self._model_card(name)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = parse_json(await request.body())
            req = parse_chat_request(body, self.cfg.max_n)
            if req.model not in self.model_names:
                raise self._unknown_model(req.model)
            agent = req.agent or req.model.endswith("-agent")
            if agent and self.agent is None:
                raise APIError(400, "agent mode is off on this server (start it without --noagent)", param="agent")
            if agent:
                if req.stream:
                    raise APIError(400, "agent mode does not stream: send stream=false", param="stream")
                return await self._agent_chat(req, body)
            return await self._chat(req, request)

        return app

    def _model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "codedance-jax",
                "max_context": self.cfg.max_context}

    def _unknown_model(self, name: str) -> APIError:
        return APIError(404, f"the model {name!r} does not exist; this server serves {', '.join(self.model_names)}",
                        param="model", code="model_not_found")

    # ------------------------------------------------------------------ plain chat
    def _encode(self, req: ChatRequest, rewrite=None):
        text, images = msg_lib.render(self.processor, req.messages, rewrite_last_user=rewrite,
                                      local=self.local_media, max_pixels=self.cfg.max_image_pixels)
        try:
            enc = self.processor(text=[text], images=images or None)
        except ValueError as e:  # e.g. placeholder text typed by the user
            raise APIError(400, f"cannot tokenize the messages: {e}", param="messages") from e
        return text, images, enc

    def _budget(self, req: ChatRequest, prompt_len: int) -> int:
        ctx = self.cfg.max_context
        want = req.max_tokens if req.max_tokens is not None else ctx - prompt_len
        if prompt_len + max(1, want) > ctx:
            asked = f" + max_tokens {req.max_tokens}" if req.max_tokens is not None else ""
            raise APIError(400, f"this model's context is {ctx} tokens; the messages take {prompt_len}{asked}. "
                           "Shorten the messages or lower max_tokens.", param="messages",
                           code="context_length_exceeded")
        return want

    async def _chat(self, req: ChatRequest, request: Request):
        _, _, enc = await asyncio.to_thread(self._encode, req)
        ids = enc["input_ids"][0].astype("int32")
        max_tokens = self._budget(req, len(ids))
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        choices = []
        for i in range(req.n):
            ch = Choice(input_ids=ids, pixel_values=enc.get("pixel_values"), image_grid_thw=enc.get("image_grid_thw"),
                        max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, greedy=req.greedy,
                        uid=request_uid(req.seed, i), stop=req.stop)
            ch.on_event = lambda ev, i=i: loop.call_soon_threadsafe(events.put_nowait, (i, ev))
            choices.append(ch)
        try:
            for ch in choices:
                self.batcher.submit(ch)
        except RuntimeError as e:
            raise APIError(503, str(e)) from e
        rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        watch = asyncio.ensure_future(_hang_up(request, choices, events))
        if req.stream:
            return StreamingResponse(self._sse(req, choices, events, rid, created, len(ids), watch),
                                     media_type="text/event-stream")
        open_ = set(range(req.n))
        try:
            while open_:
                i, ev = await events.get()
                if ev["type"] == "gone":
                    return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
                if ev["type"] == "error":
                    raise APIError(500, f"generation failed: {ev['message']}")
                if ev["type"] == "done":
                    open_.discard(i)
        except BaseException:  # an error, or the request was cancelled: stop decoding for it
            for ch in choices:
                ch.cancelled = True
            raise
        finally:
            watch.cancel()
        out = []
        for i, ch in enumerate(choices):
            c = {"index": i, "message": {"role": "assistant", "content": ch.text}, "finish_reason": ch.finish_reason,
                 "logprobs": self._logprobs(ch) if req.logprobs else None}
            out.append(c)
        completion = sum(len(ch.tokens) for ch in choices)
        return {"id": rid, "object": "chat.completion", "created": created, "model": req.model, "choices": out,
                "usage": _usage(len(ids), completion)}

    def _logprobs(self, ch: Choice) -> dict:
        content = []
        for t, lp in zip(ch.tokens, ch.logprobs, strict=True):
            s = self.processor.decode([t])
            content.append({"token": s, "logprob": float(lp), "bytes": list(s.encode("utf-8")), "top_logprobs": []})
        return {"content": content}

    async def _sse(self, req: ChatRequest, choices, events, rid, created, prompt_len, watch):
        def chunk(payload: dict) -> str:
            base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model}
            return f"data: {json.dumps({**base, **payload})}\n\n"

        try:
            for i in range(req.n):
                yield chunk({"choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                          "finish_reason": None, "logprobs": None}]})
            open_ = set(range(req.n))
            while open_:
                i, ev = await events.get()
                if ev["type"] == "delta":
                    yield chunk({"choices": [{"index": i, "delta": {"content": ev["text"]}, "finish_reason": None,
                                              "logprobs": None}]})
                elif ev["type"] == "gone":
                    return
                elif ev["type"] == "done":
                    open_.discard(i)
                    # Log-probs come whole with the last chunk: deltas are cut on text, not on tokens.
                    lp = self._logprobs(choices[i]) if req.logprobs else None
                    yield chunk({"choices": [{"index": i, "delta": {}, "finish_reason": ev["finish_reason"],
                                              "logprobs": lp}]})
                else:
                    yield f"data: {json.dumps(error_body(500, 'generation failed: ' + ev['message']))}\n\n"
                    break
            else:
                if req.include_usage:
                    yield chunk({"choices": [], "usage": _usage(prompt_len, sum(len(c.tokens) for c in choices))})
            yield "data: [DONE]\n\n"
        finally:  # the client went away or the stream ended: stop decoding what nobody reads
            watch.cancel()
            for ch in choices:
                ch.cancelled = True

    # ------------------------------------------------------------------ agent mode
    async def _agent_chat(self, req: ChatRequest, body: dict):
        rewrite = None
        if body.get("agent_template", True):
            rewrite = lambda t: agent_lib.wrap_question(t, self.cfg.turn_format)  # noqa: E731
        text, images, enc = await asyncio.to_thread(self._encode, req, rewrite)
        ids = enc["input_ids"][0]
        max_tokens = self._budget(req, len(ids))
        settings = agent_lib.AgentSettings(greedy=req.greedy, temperature=req.temperature, top_p=req.top_p,
                                           seed=req.seed or 0, max_turns=req.max_turns, max_tokens=max_tokens)
        script = body.get("agent_script") or []
        if not isinstance(script, list) or not all(isinstance(t, str) for t in script):
            raise APIError(400, "agent_script must be a list of strings (assistant turns to force, in order)",
                           param="agent_script")
        fut = self.agent.submit(Prompt(f"req-{uuid.uuid4().hex[:8]}", text, images), settings, req.n, script)
        try:
            results = await asyncio.wrap_future(fut)
        except Exception as e:  # noqa: BLE001
            raise APIError(500, f"agent rollout failed: {type(e).__name__}: {e}") from e
        choices = [{"index": i, "message": {"role": "assistant", "content": r["content"]},
                    "finish_reason": r["finish_reason"], "logprobs": None, "trajectory": r["trajectory"]}
                   for i, r in enumerate(results)]
        completion = sum(r["completion_tokens"] for r in results)
        return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
                "model": req.model, "choices": choices, "usage": _usage(len(ids), completion)}


async def _hang_up(request: Request, choices: list[Choice], events: asyncio.Queue) -> None:
    """Waits for the client to close the connection, then cancels its choices and wakes the reply
    with a "gone" event. Cancelled when the reply is complete."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for ch in choices:
        ch.cancelled = True
    events.put_nowait((None, {"type": "gone"}))


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
