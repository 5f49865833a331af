"""An OpenAI-compatible server over the model and the rollout sampler (`python -m launch.serve`).

    from codedance_jax.serve import Server, ServeConfig, serve
    serve("/path/to/checkpoint", port=8000)            # blocks; or build Server(model, processor).app

Files: app.py (routes, responses, SSE), schema.py (request validation), messages.py (chat
template), media.py (which local files are read, image decoding), guard.py (Host, Origin, API key,
body limits), batcher.py (continuous batching on the jitted sampler), agent.py (agent mode:
rollouts with the sandbox), errors.py (OpenAI-style errors), server.py (checks at start, load,
bind, uvicorn with a header deadline). Imports only the library core and the sandbox.

Protected against, and by what (tests/serve/test_serve_hostile.py, real processes and clients):
- reading files for clients: image URLs naming local paths or file:// are refused unless the
  operator lists directories (allowed_local_media_path); then only regular files under them,
  symlinks resolved, that an unprivileged user could read (o+x directories from the listed one
  down, an o+r file), opened by descriptor with O_NOFOLLOW. Missing and forbidden paths get the
  same 400, which never echoes the path.
- strangers: api_key, a Bearer token on every route (401 otherwise, compared in constant time);
  `serve` will not listen beyond loopback without one unless allow_insecure_remote.
- browsers: a Host that does not name this server is a 400 (DNS rebinding); a request with an
  Origin not in allowed_origins, or Sec-Fetch-Site cross-site, is a 403; a POST body must be
  declared application/json (415), so no cross-site "simple" form or text/plain POST runs.
- decoders: only PNG, JPEG, WebP and GIF (first frame) are opened; the pixel count is checked
  from the header before decoding (max_image_pixels); any decoding failure is a 400.
- resources: request bodies are counted as they stream and refused past max_body_bytes (413);
  headers must arrive within header_timeout_s and bodies within body_timeout_s (silent and
  half-sent connections are closed); NaN/Infinity, non-finite or out-of-range numbers, and JSON
  that is malformed, of the wrong shape or nested too deep are a 400, never a 500.

NOT protected against: eavesdropping (no TLS: put a proxy in front beyond a trusted network);
floods of connections or requests, and one client starving others (no rate limits or per-client
quotas: one key for all); timing differences that hint whether a local path exists; what
agent-mode code does inside the sandbox (sandbox/__init__.py says what that stops); an api_key
passed as a flag is visible in `ps` (use CODEDANCE_API_KEY). The in-process server of
runs/curate runs uvicorn itself, without the header deadline.
"""

from codedance_jax.serve.app import ServeConfig, Server
from codedance_jax.serve.errors import APIError
from codedance_jax.serve.server import StartError, serve

__all__ = ["APIError", "ServeConfig", "Server", "StartError", "serve"]
