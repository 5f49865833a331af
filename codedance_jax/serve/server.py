"""Load a checkpoint and serve it: `serve(checkpoint, port=8000)` blocks until interrupted.

The port is bound before the model loads, so a port in use fails at once (`StartError`), and
port 0 picks a free one; the line `codedance serve: listening on http://HOST:PORT/v1` is printed
(flushed) once the server accepts requests, after a warm-up request has compiled the decode path.

Before anything is bound or loaded, `serve` refuses (`StartError`) to listen beyond loopback
without an API key unless `allow_insecure_remote`, and refuses media directories that do not
exist. Connections run on uvicorn's h11 protocol with a header deadline (`_GuardedH11`): a
connection that has not sent a request's complete headers within `header_timeout_s` of opening
(or of its first byte after a response) is closed, so half-sent and silent connections do not
stay open (h11 also refuses a header block still incomplete past 16 KiB). Idle keep-alive
connections close after 30 s.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys

from codedance_jax.serve.app import ServeConfig, Server
from codedance_jax.serve.batcher import Choice
from codedance_jax.serve.guard import is_loopback


class StartError(Exception):
    """A user error at start-up (missing checkpoint, port in use): one line, no traceback."""


def bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise StartError(f"--port={port}: cannot listen on {host}:{port} ({e.strerror}); "
                         "choose a free port (or --port=0 for any)") from e
    sock.listen(256)
    return sock


def load(checkpoint: str, dtype: str = "float32"):
    import codedance_jax

    if not checkpoint:
        raise StartError("--checkpoint is required: a converted checkpoint (launch.convert) or a Hugging Face "
                         "Qwen2.5-VL directory")
    if not os.path.isdir(checkpoint):
        raise StartError(f"--checkpoint={checkpoint}: no such directory; give a converted checkpoint "
                         "(python -m launch.convert) or a Hugging Face Qwen2.5-VL directory")
    try:
        return codedance_jax.from_pretrained(checkpoint, dtype=dtype)
    except FileNotFoundError as e:
        raise StartError(f"--checkpoint={checkpoint}: {e}") from e


def warm_up(server: Server) -> None:
    """Greedy text requests through the batcher, k at once for every row bucket k = d, 2d, 4d, ... (d
    the sampling mesh's data size, 1 without one):
    compiles the short-prompt prefill and the decode chunk of each bucket before the first client
    (as servers capture one graph per batch size). Longer prompts, images and sampled rows still
    compile on first use."""
    import threading

    ids = server.processor(text=[server.processor.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True)])["input_ids"][0].astype("int32")
    k, top = server.batcher.multiple, server.batcher.max_batch  # row buckets: the mesh's data size x 2^i
    while True:
        done = threading.Semaphore(0)
        for _ in range(k):
            ch = Choice(input_ids=ids, pixel_values=None, image_grid_thw=None, max_tokens=2, temperature=1.0,
                        top_p=1.0, greedy=True, uid=0)
            ch.on_event = lambda ev, done=done: done.release() if ev["type"] in ("done", "error") else None
            server.batcher.submit(ch)
        for _ in range(k):
            done.acquire(timeout=600)
        if k >= top:
            break
        k = min(2 * k, top)


def check_exposure(host: str, cfg: ServeConfig, allow_insecure_remote: bool = False) -> None:
    """StartError for a server that anyone on the network could use without a key, or that names a
    media directory that is not there."""
    if not is_loopback(host) and not cfg.api_key and not allow_insecure_remote:
        raise StartError(f"--host={host} listens beyond this machine and no API key is set, so anyone who can reach "
                         "the port could use the model; set --api_key (or CODEDANCE_API_KEY), or pass "
                         "--allow_insecure_remote to serve without one")
    for d in cfg.allowed_local_media_path:
        if not os.path.isdir(d):
            raise StartError(f"--allowed_local_media_path={d}: no such directory")


def guarded_protocol(header_timeout_s: float):
    """uvicorn's h11 protocol with a deadline on each request's headers (see the module docstring)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class _GuardedH11(H11Protocol):
        _header_timer = None

        def _arm(self):
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _disarm(self):
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def data_received(self, data):
            if self._between_requests():
                self._arm()  # the first bytes of the next request start its header deadline
            super().data_received(data)
            if not self._between_requests():
                self._disarm()  # a request's headers are in: its body has the app's own deadline

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

        def _headers_late(self):
            self._header_timer = None
            if self._between_requests() and not self.transport.is_closing():
                self.transport.close()

    return _GuardedH11


def serve(checkpoint: str, host: str = "127.0.0.1", port: int = 8000, cfg: ServeConfig | None = None,
          dtype: str = "float32", warmup: bool = True, log_level: str = "warning",
          allow_insecure_remote: bool = False) -> None:
    import uvicorn

    cfg = dataclasses.replace(cfg or ServeConfig(), host=host)
    check_exposure(host, cfg, allow_insecure_remote)
    sock = bind(host, port)
    model, processor = load(checkpoint, dtype)
    server = Server(model, processor, cfg)
    server.start()
    try:
        if warmup:
            warm_up(server)
        config = uvicorn.Config(server.app, log_level=log_level, timeout_keep_alive=30,
                                http=guarded_protocol(cfg.header_timeout_s), h11_max_incomplete_event_size=16 << 10)
        uv = uvicorn.Server(config)
        real_port = sock.getsockname()[1]
        print(f"codedance serve: listening on http://{host}:{real_port}/v1 (models: {', '.join(server.model_names)})",
              flush=True, file=sys.stdout)
        uv.run(sockets=[sock])
    finally:
        server.close()
        sock.close()
