"""`python -m launch.serve` against hostile and careless clients (issue 38): real server processes,
the `openai` client, http.client and raw sockets.

Two servers over the tiny checkpoint, started together: `plain` with the defaults a user gets, and
`guarded` with an API key, a media directory, an extra Host name and origin, and small body and
time limits (1 MiB, 2 s) so that the limits are reached quickly.
"""

import base64
import concurrent.futures
import http.client
import io
import json
import socket
import struct
import subprocess
import sys
import time
import zlib

import numpy as np
import openai
import pytest
from PIL import Image
from serve_helpers import ROOT, ServerProcess, bomb_png, server_env

KEY = "sk-test-" + "7f3a" * 8


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """The allowed directory (world-searchable) with one world-readable image, and files around it
    that must never be served."""
    base = tmp_path_factory.mktemp("hostile")
    d, outside, private = base / "media", base / "outside", base / "media" / "private"
    for p in (d, outside, private):
        p.mkdir()
    d.chmod(0o755)
    private.chmod(0o700)
    img = _noise(5)
    for path, mode in [(d / "ok.png", 0o644), (d / "secret.png", 0o600), (outside / "other.png", 0o644),
                       (private / "hidden.png", 0o644)]:
        img.save(path)
        path.chmod(mode)
    (d / "link.png").symlink_to(outside / "other.png")
    return {"dir": d, "ok": d / "ok.png", "img": img, "secret": d / "secret.png", "other": outside / "other.png",
            "link": d / "link.png", "hidden": private / "hidden.png"}


@pytest.fixture(scope="module")
def servers(tiny_ckpt, media):
    common = ("--noagent", "--max_batch=1")
    guarded_flags = (*common, f"--api_key={KEY}", f"--allowed_local_media_path={media['dir']}",
                     "--allowed_hosts=served.example", "--allowed_origins=http://app.example", "--max_request_mb=1",
                     "--header_timeout_s=2", "--body_timeout_s=2")
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        plain = ex.submit(ServerProcess, tiny_ckpt, *common)
        guarded = ex.submit(ServerProcess, tiny_ckpt, *guarded_flags)
        s = {"plain": plain.result(), "guarded": guarded.result()}
    yield s
    for v in s.values():
        v.close()


def _client(server, key=KEY):
    return openai.OpenAI(base_url=server.base_url, api_key=key, timeout=120, max_retries=0)


def _noise(seed: int, size=(56, 56)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))


def _data_url(raw: bytes, mime="image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def _encoded(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _image_chat(client, url: str, max_tokens=2):
    return client.chat.completions.create(
        model="codedance", temperature=0, max_tokens=max_tokens, logprobs=True,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                               {"type": "text", "text": "describe"}]}])


def _error(fn) -> tuple[int, dict]:
    with pytest.raises(openai.APIStatusError) as e:
        fn()
    return e.value.status_code, e.value.body


def _raw(server, method, path, body=None, headers=None, key=KEY):
    """(status, headers, JSON body or text) over http.client; headers may override Host."""
    h = {"Host": f"127.0.0.1:{server.port}"}
    if key:
        h["Authorization"] = f"Bearer {key}"
    if body is not None:
        h["Content-Type"] = "application/json"
    h.update(headers or {})
    h = {k: v for k, v in h.items() if v is not None}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=h)
        r = conn.getresponse()
        data = r.read()
        try:
            data = json.loads(data)
        except ValueError:
            data = data.decode(errors="replace")
        return r.status, {k.lower(): v for k, v in r.getheaders()}, data
    finally:
        conn.close()


CHAT = json.dumps({"model": "codedance", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                   "temperature": 0})


# ------------------------------------------------------------------------------ local files
def test_local_files_are_read_only_under_allowed_directories_and_world_readable(servers, media):
    plain, guarded = _client(servers["plain"], "unused"), _client(servers["guarded"])
    # Off by default: a world-readable file is refused like a missing one, by path and by file:// URL.
    refusals = set()
    for url in (str(media["ok"]), f"file://{media['ok']}", str(media["dir"] / "missing.png")):
        code, err = _error(lambda url=url: _image_chat(plain, url))
        assert code == 400 and err["code"] == "invalid_image"
        refusals.add(err["message"])
    assert len(refusals) == 1 and str(media["dir"]) not in refusals.pop()
    # Allowed: the same pixels as a data URL, by path and by file:// URL.
    want = [t.logprob for t in _image_chat(guarded, _data_url(_encoded(media["img"], "PNG"))).choices[0].logprobs.content]
    for url in (str(media["ok"]), f"file://{media['ok']}", f"file://localhost{media['ok']}"):
        got = [t.logprob for t in _image_chat(guarded, url).choices[0].logprobs.content]
        np.testing.assert_allclose(got, want, atol=1e-5)
    # Missing, not world-readable, a symlink out, outside, `..` out, a private subdirectory, a
    # directory, /etc/passwd: one message for all, naming no path.
    messages = set()
    for url in (media["dir"] / "missing.png", media["secret"], media["link"], media["other"],
                f"{media['dir']}/../outside/other.png", media["hidden"], media["dir"], "/etc/passwd",
                f"file://{media['secret']}", f"file://{media['dir']}/nope.png"):
        code, err = _error(lambda url=url: _image_chat(guarded, str(url)))
        assert code == 400 and err["code"] == "invalid_image", (url, err)
        messages.add(err["message"])
    assert len(messages) == 1, messages
    assert str(media["dir"].parent) not in messages.pop()


# ------------------------------------------------------------------------------ API key
def test_an_api_key_is_required_on_every_route(servers):
    s = servers["guarded"]
    for method, path, body in [("GET", "/health", None), ("GET", "/v1/models", None),
                               ("GET", "/v1/models/codedance", None), ("GET", "/nothing", None),
                               ("POST", "/v1/chat/completions", CHAT)]:
        for key in (None, "sk-wrong", KEY + "x"):
            code, headers, err = _raw(s, method, path, body, key=key)
            assert code == 401 and err["error"]["type"] == "authentication_error", (method, path, key)
            assert headers["www-authenticate"] == "Bearer"
    code, _, _ = _raw(s, "GET", "/v1/models", headers={"Authorization": f"Basic {KEY}"}, key=None)
    assert code == 401
    with pytest.raises(openai.AuthenticationError):
        _client(s, "sk-wrong").models.list()
    client = _client(s)
    assert [m.id for m in client.models.list()] == ["codedance"]
    assert _raw(s, "GET", "/health", headers={"Authorization": f"bearer {KEY}"}, key=None)[0] == 200


def test_the_launcher_refuses_a_remote_host_without_a_key(tiny_ckpt, tmp_path):
    """Beyond loopback with no key: exit 2 before anything loads. A key from the environment gets
    past that check (to the media directory that is not there, also refused before the model
    loads), and so does --allow_insecure_remote (to the missing checkpoint)."""
    missing = f"--checkpoint={tmp_path / 'missing'}"
    env = server_env()
    env.pop("CODEDANCE_API_KEY", None)
    no_media = f"--allowed_local_media_path={tmp_path / 'nope'}"
    runs = [((missing, "--host=0.0.0.0"), env),
            ((f"--checkpoint={tiny_ckpt}", "--host=0.0.0.0", no_media), {**env, "CODEDANCE_API_KEY": KEY}),
            ((missing, "--host=0.0.0.0", "--allow_insecure_remote"), env)]
    procs = [subprocess.Popen([sys.executable, "-m", "launch.serve", "--port=0", *a], cwd=ROOT, env=e,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for a, e in runs]
    try:
        outs = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    refused, env_key, insecure = outs
    assert [p.returncode for p in procs] == [2, 2, 2], outs
    assert refused.strip().count("\n") == 0 and "--api_key" in refused and "Traceback" not in refused
    assert "--allowed_local_media_path" in env_key and "--api_key" not in env_key and "Traceback" not in env_key
    assert "--checkpoint" in insecure and "--api_key" not in insecure


# ------------------------------------------------------------------------------ Host and Origin
def test_foreign_hosts_and_cross_site_requests_are_refused(servers):
    g, p = servers["guarded"], servers["plain"]
    # DNS rebinding: a page on attacker.example whose name now points at 127.0.0.1 sends its own Host.
    for s in (p, g):
        for host in ("attacker.example", f"attacker.example:{s.port}", "127.0.0.1.attacker.example", ""):
            code, _, err = _raw(s, "POST", "/v1/chat/completions", CHAT, headers={"Host": host})
            assert code == 400 and "Host" in err["error"]["message"], (host, err)
    for host in (f"localhost:{g.port}", "127.0.0.1", f"[::1]:{g.port}", "served.example", f"Served.Example:{g.port}"):
        assert _raw(g, "GET", "/v1/models", headers={"Host": host})[0] == 200, host
    # A cross-site "simple" POST (text/plain, no preflight) from a page on another site: refused
    # before anything runs, with or without a key; and an Origin on a JSON POST or a GET too.
    for s, key in ((p, None), (g, KEY)):
        code, _, _ = _raw(s, "POST", "/v1/chat/completions", CHAT, key=key,
                          headers={"Content-Type": "text/plain", "Origin": "http://evil.example"})
        assert code == 403
        code, _, _ = _raw(s, "POST", "/v1/chat/completions", CHAT, key=key, headers={"Origin": "null"})
        assert code == 403
        code, _, _ = _raw(s, "GET", "/v1/models", key=key, headers={"Sec-Fetch-Site": "cross-site"})
        assert code == 403
        # Without an Origin (curl, scripts), a body that is not declared JSON is still refused.
        for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
            code, _, _ = _raw(s, "POST", "/v1/chat/completions", CHAT, key=key, headers={"Content-Type": ctype})
            assert code == 415, ctype
    # The operator's origin gets the reply and CORS headers; its preflight passes without a key.
    code, headers, body = _raw(g, "POST", "/v1/chat/completions", CHAT, headers={"Origin": "http://app.example"})
    assert code == 200 and body["choices"][0]["finish_reason"] in ("stop", "length")
    assert headers["access-control-allow-origin"] == "http://app.example"
    code, headers, _ = _raw(g, "OPTIONS", "/v1/chat/completions", key=None,
                            headers={"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                                     "Access-Control-Request-Headers": "authorization,content-type"})
    assert code == 200 and headers["access-control-allow-origin"] == "http://app.example"


# ------------------------------------------------------------------------------ images
def _broken_png(img: Image.Image) -> bytes:
    """A PNG whose image data continues in a chunk with a garbage type (Pillow raises SyntaxError)."""
    raw = _encoded(img, "PNG")
    i = raw.index(b"IDAT")
    n = struct.unpack(">I", raw[i - 4 : i])[0]
    data = raw[i + 4 : i + 4 + n]

    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))

    return raw[: i - 4] + chunk(b"IDAT", data[:100]) + chunk(b"\x00\x01\x02\x03", data[100:]) + raw[i + 8 + n :]


def _peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def test_images_decode_only_vlm_formats_within_pixel_limits(servers):
    s = servers["guarded"]
    client = _client(s)
    img = _noise(6)
    frames = [img, _noise(7)]
    gif = io.BytesIO()
    frames[0].save(gif, format="GIF", save_all=True, append_images=frames[1:], duration=50)
    for raw, mime in [(_encoded(img, "PNG"), "image/png"), (_encoded(img, "JPEG"), "image/jpeg"),
                      (_encoded(img, "WEBP"), "image/webp"), (gif.getvalue(), "image/gif")]:
        assert _image_chat(client, _data_url(raw, mime)).choices[0].finish_reason in ("stop", "length"), mime
    # Other formats Pillow knows are not decoded (EPS would run Ghostscript on client bytes).
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 56 56\nshowpage\n%%EOF\n"
    for raw, mime in [(_encoded(img, "BMP"), "image/bmp"), (_encoded(img, "TIFF"), "image/tiff"),
                      (_encoded(img, "PPM"), "image/x-portable-pixmap"), (eps, "image/png")]:
        code, err = _error(lambda raw=raw, mime=mime: _image_chat(client, _data_url(raw, mime)))
        assert code == 400 and err["code"] == "invalid_image" and "PNG, JPEG, WebP or GIF" in err["message"], mime
    # A 20 KB PNG declaring 169 megapixels is refused from its header, before any pixel is decoded.
    bomb = bomb_png()
    assert len(bomb) < 64 << 10
    before = _peak_rss_mb(s.proc.pid)
    code, err = _error(lambda: _image_chat(client, _data_url(bomb)))
    assert code == 400 and err["code"] == "invalid_image" and "13000x13000" in err["message"]
    assert _peak_rss_mb(s.proc.pid) - before < 200
    # Corrupt images are a 400, never a 500.
    good = _encoded(img, "PNG")
    for raw in (_broken_png(img), good[: len(good) // 2], good[:40], b"\x89PNG\r\n\x1a\n", b"GIF89a" + b"\xff" * 30):
        code, err = _error(lambda raw=raw: _image_chat(client, _data_url(raw)))
        assert code == 400 and err["code"] == "invalid_image", err


# ------------------------------------------------------------------------------ bodies and slow clients
def _connect(port) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=15)
    return sock


def _closed_after(sock, start: float) -> tuple[bytes, float]:
    """What the server sends until it closes the connection, and when it closed (s since start)."""
    got = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, TimeoutError) as e:
            if isinstance(e, TimeoutError):
                pytest.fail(f"the server kept the connection open for 15 s; it sent {got[:200]!r}")
            chunk = b""
        if not chunk:
            return got, time.monotonic() - start
        got += chunk


def test_bodies_are_bounded_and_slow_clients_are_cut_off(servers):
    s = servers["guarded"]
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{s.port}\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\n")
    start = time.monotonic()
    silent = _connect(s.port)
    half_headers = _connect(s.port)
    half_headers.sendall(head.encode())
    half_body = _connect(s.port)
    half_body.sendall((head + "Content-Length: 1000\r\n\r\n" + '{"model": "codedance"').encode())
    # A declared length over the limit: refused at once, nothing read.
    big = _connect(s.port)
    big.sendall((head + f"Content-Length: {50 << 20}\r\n\r\n").encode())
    got, _ = _closed_after(big, start)
    assert got.startswith(b"HTTP/1.1 413")
    # A chunked body with no declared length: refused once it passes 1 MiB, not buffered to the end.
    streamed = _connect(s.port)
    streamed.sendall((head + "Transfer-Encoding: chunked\r\n\r\n").encode())
    piece = b"%x\r\n%s\r\n" % (64 << 10, b" " * (64 << 10))
    sent = 0
    try:
        while sent < 64 << 20:
            streamed.sendall(piece)
            sent += 64 << 10
    except OSError:  # the server answered and closed while we were still sending
        pass
    got, _ = _closed_after(streamed, start)
    assert got.startswith(b"HTTP/1.1 413") and sent < 16 << 20
    # Nothing, half the headers, half the body: each connection is closed within a few seconds
    # (header and body timeouts are 2 s here); the half body gets a 408 first.
    for sock, status in ((silent, b""), (half_headers, b""), (half_body, b"HTTP/1.1 408")):
        got, when = _closed_after(sock, start)
        assert got.startswith(status) and when < 8, (got[:100], when)
    # The server still answers.
    assert _client(s).models.list().data[0].id == "codedance"


# ------------------------------------------------------------------------------ numbers and JSON
def test_bad_numbers_and_malformed_json_of_any_shape_are_400(servers):
    s = servers["guarded"]
    client = _client(s)  # it refuses to send NaN itself: the numbers below go raw
    msg = '[{"role": "user", "content": "hi"}]'

    def chat(extra: str) -> str:
        return '{"model": "codedance", "messages": ' + msg + ", " + extra + "}"

    bodies = [
        # numbers
        chat('"temperature": NaN'),
        chat('"top_p": NaN'),
        chat('"temperature": -Infinity'),
        chat('"temperature": 1e999'),
        chat('"temperature": ' + "9" * 400),
        chat('"max_tokens": 1e999'),
        chat('"n": ' + "9" * 5000),
        chat('"seed": ' + "9" * 30),
        chat('"top_p": 0'),
        chat('"temperature": "hot"'),
        chat('"max_tokens": -1'),
        # nesting
        "[" * 100_000 + "]" * 100_000,
        chat('"x": ' + "[" * 40 + "]" * 40),
        '{"model": "codedance", "messages": [{"role": "user", "content": ' + "[" * 900 + "]" * 900 + "}]}",
        # not JSON, or not an object
        "{not json", '{"model":', "", "\ufeff{}", "[]", '"x"', "null", "1", "true",
        # wrong shapes
        '{"model": 1, "messages": ' + msg + "}",
        '{"model": "codedance", "messages": "hi"}',
        '{"model": "codedance", "messages": [1]}',
        '{"model": "codedance", "messages": [[]]}',
        '{"model": "codedance", "messages": [{"role": ["user"], "content": "hi"}]}',
        '{"model": "codedance", "messages": [{"role": {"a": 1}, "content": "hi"}]}',
        '{"model": "codedance", "messages": [{"role": "user", "content": 5}]}',
        '{"model": "codedance", "messages": [{"role": "user", "content": [1]}]}',
        '{"model": "codedance", "messages": [{"role": "user", "content": [{"type": "text", "text": {"a": [1]}}]}]}',
        '{"model": "codedance", "messages": [{"role": "user", "content": [{"type": "text"}]}]}',
        '{"model": "codedance", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": 5}]}]}',
        '{"model": "codedance", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": [1]}}]}]}',
        '{"model": "codedance", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,!!"}}]}]}',
        '{"model": "codedance", "messages": [{"role": "user", "content": [{"type": ["text"]}]}]}',
        chat('"stream": "yes"'),
        chat('"stream_options": 5'),
        chat('"stream_options": {"include_usage": "yes"}'),
        chat('"stop": [1, 2]'),
        chat('"stop": {"a": 1}'),
        chat('"response_format": [1]'),
    ]
    for body in bodies:
        code, _, err = _raw(s, "POST", "/v1/chat/completions", body.encode())
        assert code == 400 and set(err["error"]) >= {"message", "type", "param", "code"}, (body[:120], code, err)
    code, _, err = _raw(s, "POST", "/v1/chat/completions", b"\xff\xfe{\x00}")
    assert code == 400, err
    # The server still answers.
    r = client.chat.completions.create(model="codedance", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert r.choices[0].finish_reason in ("stop", "length")
