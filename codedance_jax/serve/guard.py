"""The checks every request passes before a route sees it (an ASGI middleware around the app).

In order, each refusal an OpenAI-shaped error with `Connection: close` (the body is never read):
1. Host (400): the Host header must name this server: a loopback name (localhost, 127.0.0.0/8,
   ::1), the address it is bound to, the machine's hostname when bound beyond loopback, any IP
   literal when bound to every interface, or a name in `allowed_hosts` ("*" allows any). A page
   whose DNS name was rebound to 127.0.0.1 sends its own name, so it is refused.
2. Origin (403): a request with an `Origin` header (browsers send one with every cross-site POST,
   "simple" text/plain ones included) or with `Sec-Fetch-Site: cross-site / same-site` is refused
   unless the origin is in `allowed_origins`, which also get CORS headers. Non-browser clients
   (the `openai` client, curl) send neither.
3. API key (401): when `api_key` is set, `Authorization: Bearer <key>` on every route, /health
   and unknown paths included (compared in constant time). A CORS preflight from an allowed
   origin passes without it, as browsers send none.
4. Body: a POST must be `Content-Type: application/json` (415: no form or text/plain body from a
   page); a declared Content-Length over `max_body_bytes` is refused at once, and a streamed
   (chunked) body once its running total passes it (413), so at most `max_body_bytes` is ever
   buffered; the whole body must arrive within `body_timeout_s` of the headers (408).
The headers themselves must arrive within the server's header timeout (`server.py`).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import socket

from codedance_jax.serve.errors import error_body

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})


class _TooLarge(Exception):
    pass


class _ClientGone(Exception):
    pass


def _split_host(value: str) -> str:
    """'example.com:8000' -> 'example.com', '[::1]:8000' -> '::1'; lower case, no trailing dot."""
    v = value.strip().lower()
    if v.startswith("["):
        v = v[1 : v.find("]")] if "]" in v else ""
    elif v.count(":") == 1:
        v = v.partition(":")[0]
    return v.rstrip(".")


def _ip(name: str):
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def is_loopback(host: str) -> bool:
    """Whether listening on `host` keeps the server on this machine."""
    name = _split_host(host)
    ip = _ip(name)
    return name in LOOPBACK_NAMES or (ip is not None and ip.is_loopback)


class HostPolicy:
    """Which Host header values name this server (see the module docstring)."""

    def __init__(self, bound_host: str, allowed_hosts=()):
        self.any = "*" in allowed_hosts
        self.names = set(LOOPBACK_NAMES) | {_split_host(h) for h in allowed_hosts if h != "*"}
        bound = _split_host(bound_host)
        self.any_ip = bound_host.strip() in WILDCARD_HOSTS
        if not self.any_ip:
            self.names.add(bound)
        if not is_loopback(bound_host):
            self.names.add(socket.gethostname().lower())

    def allows(self, value: str | None) -> bool:
        if self.any:
            return True
        if not value:
            return False
        name = _split_host(value)
        ip = _ip(name)
        if ip is not None and (ip.is_loopback or self.any_ip):
            return True
        return name in self.names


class Guard:
    """ASGI middleware: Host, Origin, API key and body checks in front of `app`."""

    def __init__(self, app, *, bound_host: str = "127.0.0.1", allowed_hosts=(), allowed_origins=(),
                 api_key: str | None = None, max_body_bytes: int = 32 << 20, body_timeout_s: float = 60.0):
        self.app = app
        self.hosts = HostPolicy(bound_host, allowed_hosts)
        self.origins = {o.rstrip("/").lower() for o in allowed_origins}
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes, self.body_timeout_s = max_body_bytes, body_timeout_s

    def _origin_ok(self, origin: str | None, fetch_site: str | None) -> bool:
        if "*" in self.origins:
            return True
        if origin is not None:
            return origin.rstrip("/").lower() in self.origins
        return fetch_site not in ("cross-site", "same-site")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers: dict[str, list[str]] = {}
        for k, v in scope["headers"]:
            headers.setdefault(k.decode("latin-1").lower(), []).append(v.decode("latin-1"))

        def one(name):
            vals = headers.get(name)
            return vals[0] if vals and len(vals) == 1 else None

        if len(headers.get("host", [])) != 1 or not self.hosts.allows(one("host")):
            return await _refuse(send, 400, "the Host header does not name this server (add the name to "
                                 "--allowed_hosts if it should)")
        if len(headers.get("origin", [])) > 1 or not self._origin_ok(one("origin"), one("sec-fetch-site")):
            return await _refuse(send, 403, "cross-site requests are refused (the operator can allow an origin "
                                 "with --allowed_origins)")
        method = scope["method"]
        preflight = method == "OPTIONS" and one("origin") is not None and "access-control-request-method" in headers
        if self.api_key is not None and not preflight and not self._key_ok(one("authorization")):
            return await _refuse(send, 401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                                 extra=[(b"www-authenticate", b"Bearer")])
        if method not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        ctype = (one("content-type") or "").partition(";")[0].strip().lower()
        if ctype != "application/json":
            return await _refuse(send, 415, "the request body must be JSON sent as 'Content-Type: application/json'")
        length = one("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return await _refuse(send, 413, f"the request body is over {self.max_body_bytes} bytes")
        try:
            body = await asyncio.wait_for(self._read(receive), self.body_timeout_s)
        except _ClientGone:
            return None
        except _TooLarge:
            return await _refuse(send, 413, f"the request body is over {self.max_body_bytes} bytes")
        except TimeoutError:
            return await _refuse(send, 408, f"the request body did not arrive within {self.body_timeout_s:g} s")

        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # afterwards: http.disconnect when the client goes away

        return await self.app(scope, replay, send)

    def _key_ok(self, value: str | None) -> bool:
        scheme, _, token = (value or "").strip().partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key)

    async def _read(self, receive) -> bytes:
        chunks, n = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise _ClientGone
            chunk = msg.get("body", b"")
            n += len(chunk)
            if n > self.max_body_bytes:
                raise _TooLarge
            chunks.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(chunks)


async def _refuse(send, status: int, message: str, extra=()) -> None:
    body = json.dumps(error_body(status, message)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *extra]})
    await send({"type": "http.response.body", "body": body})
