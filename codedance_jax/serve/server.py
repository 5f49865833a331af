"""Load a checkpoint and serve it: `serve(checkpoint, port=8000)` blocks until interrupted.

The port is bound before the model loads, so a port in use fails at once (`StartError`), and
port 0 picks a free one; the line `codedance serve: listening on http://HOST:PORT/v1` is printed
(flushed) once the server accepts requests, after a warm-up request has compiled the decode path.
"""

from __future__ import annotations

import os
import socket
import sys

from codedance_jax.serve.app import ServeConfig, Server
from codedance_jax.serve.batcher import Choice


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
    """Greedy text requests through the batcher, k at once for every row bucket k = 1, 2, 4, ...:
    compiles the short-prompt prefill and the decode chunk of each bucket before the first client
    (as servers capture one graph per batch size). Longer prompts, images and sampled rows still
    compile on first use."""
    import threading

    ids = server.processor(text=[server.processor.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True)])["input_ids"][0].astype("int32")
    k, top = 1, server.batcher.max_batch
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


def serve(checkpoint: str, host: str = "127.0.0.1", port: int = 8000, cfg: ServeConfig | None = None,
          dtype: str = "float32", warmup: bool = True, log_level: str = "warning") -> None:
    import uvicorn

    sock = bind(host, port)
    model, processor = load(checkpoint, dtype)
    server = Server(model, processor, cfg)
    server.start()
    try:
        if warmup:
            warm_up(server)
        config = uvicorn.Config(server.app, log_level=log_level, timeout_keep_alive=30)
        uv = uvicorn.Server(config)
        real_port = sock.getsockname()[1]
        print(f"codedance serve: listening on http://{host}:{real_port}/v1 (models: {', '.join(server.model_names)})",
              flush=True, file=sys.stdout)
        uv.run(sockets=[sock])
    finally:
        server.close()
        sock.close()
