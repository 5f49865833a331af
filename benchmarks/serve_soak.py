"""Serving soak: N concurrent clients mixing normal and hostile requests against a real `launch.serve`.

    .venv/bin/python benchmarks/serve_soak.py [--seconds 90] [--clients 8] [--hostile 0.4]

The tiny random checkpoint is served by a real `python -m launch.serve` process on 127.0.0.1
(`--max_batch=8 --max_context=1024 --decode_chunk=8 --noagent`, a 1 MiB body limit and 2 s header
and body deadlines, as a careful operator would set them). Each normal prompt (greedy, or sampled
with a seed; one carries an image) is answered once alone before the soak: its first answer.
Then `--clients` threads, each with its own `openai` client and raw sockets, run for `--seconds`;
each request is hostile with probability `--hostile`, picked evenly from:

  disconnect   a long completion (streamed or not) whose client hangs up after 0.05-0.6 s
  oversized    a body over the limit, declared (Content-Length) or streamed (chunked): 413
  bad_json     truncated, 100,000-deep, not an object, wrong types: 400
  nan          NaN / Infinity / negative numbers in the sampling fields: 400
  foreign_host a Host header naming another site (DNS rebinding): 400
  png_bomb     a 20 KB PNG declaring 13000 x 13000 pixels: 400
  half_sent    headers or body stopped halfway: closed after the header deadline, or 408

A hostile request counts as handled when its reply is the one listed. Reported: normal requests
and completion tokens per second, p50 / p99 latency of normal requests, the server's RSS (after
warm-up, peak, at the end, every 10 s), whether every normal reply equalled its first answer (and
each prompt's answer alone after the soak, with its latency), what /health
says after the soak (rows busy, waiting, time to drain), XLA compilations during the soak and
tracebacks in the server's log.
Prints a table; writes benchmarks/results/serve_soak/serve_soak.json.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import io
import json
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "serve"))

HOSTILE = ("disconnect", "oversized", "bad_json", "nan", "foreign_host", "png_bomb", "half_sent")
LIMIT_MB = 1
DEADLINE_S = 2


# ------------------------------------------------------------------------------ requests
def normal_prompts() -> list[dict]:
    """The normal requests: greedy and seeded, one with an image. Each must always get one reply."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 255, (56, 72, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    out = []
    for k in range(3):
        out.append({"messages": [{"role": "user", "content": f"Describe item {k} in a few words."}],
                    "temperature": 0, "max_tokens": 16 + 8 * k})
    for k in range(3):
        out.append({"messages": [{"role": "user", "content": f"Tell me about place {k}."}],
                    "temperature": 0.8, "top_p": 0.9, "seed": 100 + k, "max_tokens": 24})
    out.append({"messages": [{"role": "user", "content": "A story, please."}], "temperature": 1.0, "seed": 7,
                "max_tokens": 16, "n": 2})
    out.append({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                          {"type": "text", "text": "What is in the picture?"}]}],
                "temperature": 0, "max_tokens": 16})
    return out


class Raw:
    """Hostile requests on raw sockets. Each returns (expected, got): status lines as '413', or 'closed'."""

    def __init__(self, port: int, bomb: bytes):
        self.port = port
        self.bomb_url = "data:image/png;base64," + base64.b64encode(bomb).decode()

    def _sock(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=60)
        return s

    @staticmethod
    def _head(body_len: int | None, host: str = "127.0.0.1", extra: str = "") -> bytes:
        length = f"Content-Length: {body_len}\r\n" if body_len is not None else ""
        return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"{length}{extra}\r\n").encode()

    @staticmethod
    def _status(s: socket.socket) -> str:
        data = b""
        try:
            while b"\r\n" not in data:
                got = s.recv(4096)
                if not got:
                    break
                data += got
        except OSError:
            pass
        finally:
            s.close()
        return data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/1.1 ") else "closed"

    def post(self, body: bytes, host: str = "127.0.0.1") -> str:
        s = self._sock()
        s.sendall(self._head(len(body), host) + body)
        return self._status(s)

    def disconnect(self, rng: random.Random):
        body = {"model": "codedance", "messages": [{"role": "user", "content": "a very long story"}],
                "max_tokens": 400, "temperature": 1.0, "stream": rng.random() < 0.5}
        data = json.dumps(body).encode()
        s = self._sock()
        s.sendall(self._head(len(data)) + data)
        time.sleep(rng.uniform(0.05, 0.6))
        s.close()
        return "gone", "gone"

    def oversized(self, rng: random.Random):
        s = self._sock()
        try:
            if rng.random() < 0.5:  # declared: refused from the header
                s.sendall(self._head(2 * (LIMIT_MB << 20)) + b'{"model": "' + b"x" * 65536)
            else:  # chunked: refused once the running total passes the limit
                s.sendall(self._head(None, extra="Transfer-Encoding: chunked\r\n"))
                piece = b"x" * 65536
                for _ in range(2 * 16 * LIMIT_MB):
                    s.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n")
        except OSError:  # the server answered and closed while we were still sending
            pass
        return "413", self._status(s)

    def bad_json(self, rng: random.Random):
        bodies = [b'{"model": "codedance", "messages": [', b"[" * 100_000 + b"]" * 100_000, b'"just a string"',
                  b'{"model": "codedance", "messages": "hi"}', b"\xff\xfe{}",
                  b'{"model": "codedance", "messages": [{"role": "user", "content": "hi"}], "n": "two"}']
        return "400", self.post(rng.choice(bodies))

    def nan(self, rng: random.Random):
        field = rng.choice(['"temperature": NaN', '"top_p": NaN', '"temperature": Infinity', '"max_tokens": -5',
                            '"top_p": -1e309', '"seed": NaN'])
        budget = "" if field.startswith('"max_tokens"') else '"max_tokens": 2, '
        body = '{"model": "codedance", "messages": [{"role": "user", "content": "hi"}], ' + budget + field + "}"
        return "400", self.post(body.encode())

    def foreign_host(self, rng: random.Random):
        body = json.dumps({"model": "codedance", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        host = rng.choice(["attacker.example", f"attacker.example:{self.port}", "127.0.0.1.attacker.example"])
        return "400", self.post(body.encode(), host=host)

    def png_bomb(self, rng: random.Random):
        body = {"model": "codedance", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": self.bomb_url}}, {"type": "text", "text": "describe"}]}]}
        return "400", self.post(json.dumps(body).encode())

    def half_sent(self, rng: random.Random):
        s = self._sock()
        if rng.random() < 0.5:  # headers that never end
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")
            return "closed", self._status(s)
        s.sendall(self._head(1000) + b'{"model": "codedance", "mess')
        return "408", self._status(s)


# ------------------------------------------------------------------------------ the soak
def health(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=60) as r:
        return json.loads(r.read())


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def answer(client, p: dict) -> tuple[list[str], int]:
    r = client.chat.completions.create(model="codedance", **p)
    return [c.message.content for c in r.choices], r.usage.completion_tokens


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration, subprocess.SubprocessError):
        return platform.processor() or "unknown"


def soak(server, prompts, seconds: float, clients: int, hostile: float, seed: int) -> dict:
    import openai
    from serve_helpers import bomb_png

    raw = Raw(server.port, bomb_png())
    first = {}
    ref_client = openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=300, max_retries=0)
    for k, p in enumerate(prompts):  # first answers, each alone (this also compiles their shapes)
        first[k] = answer(ref_client, p)[0]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as ex:  # compile the batch shapes
        list(ex.map(lambda p: answer(ref_client, p), prompts))
    compiles_before = health(server.port)["stats"]["compiles"]
    rss = {"start": rss_mb(server.proc.pid)}
    peak = [rss["start"]]
    series = []  # (seconds into the soak, MB) every 10 s: growth that levels off is not a leak
    stop = threading.Event()

    def monitor():
        t0 = time.perf_counter()
        while not stop.wait(1.0):
            try:
                peak.append(rss_mb(server.proc.pid))
            except OSError:
                return
            if len(peak) % 10 == 0:
                series.append((round(time.perf_counter() - t0), round(peak[-1], 1)))

    threading.Thread(target=monitor, daemon=True).start()
    lock = threading.Lock()
    normal, hostile_log, mismatches, failures = [], [], [], []
    t_start = time.perf_counter()
    end = t_start + seconds

    def worker(w: int):
        rng = random.Random(seed * 1000 + w)
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=300, max_retries=0)
        while time.perf_counter() < end:
            if rng.random() < hostile:
                kind = rng.choice(HOSTILE)
                t0 = time.perf_counter()
                try:
                    expected, got = getattr(raw, kind)(rng)
                except Exception as e:  # noqa: BLE001 - recorded as unexpected
                    expected, got = "?", f"{type(e).__name__}: {e}"
                with lock:
                    hostile_log.append({"kind": kind, "expected": expected, "got": got,
                                        "s": round(time.perf_counter() - t0, 3)})
                continue
            k = rng.randrange(len(prompts))
            t0 = time.perf_counter()
            try:
                texts, toks = answer(client, prompts[k])
            except Exception as e:  # noqa: BLE001 - a normal request that failed is reported
                with lock:
                    failures.append({"prompt": k, "error": f"{type(e).__name__}: {e}"[:300]})
                continue
            dt = time.perf_counter() - t0
            with lock:
                normal.append({"prompt": k, "latency_s": dt, "tokens": toks, "done_at": time.perf_counter()})
                if texts != first[k]:
                    mismatches.append({"prompt": k, "first": first[k], "got": texts})

    with concurrent.futures.ThreadPoolExecutor(clients) as ex:
        list(ex.map(worker, range(clients)))
    wall = time.perf_counter() - t_start
    t_drain = time.perf_counter()
    h = health(server.port)
    while (h["stats"]["busy_rows"] or h["stats"]["waiting"]) and time.perf_counter() - t_drain < 60:
        time.sleep(0.1)
        h = health(server.port)
    drained_s = time.perf_counter() - t_drain
    compiles = h["stats"]["compiles"] - compiles_before
    time.sleep(2.0)
    rss["end"] = rss_mb(server.proc.pid)
    stop.set()
    rss["peak"] = max(peak + [rss["end"]])
    after, alone_s = [], []
    for p in prompts:  # alone again, after the soak: the same answers, and the latency without load
        t0 = time.perf_counter()
        after.append(answer(ref_client, p)[0])
        alone_s.append(time.perf_counter() - t0)

    lat = [r["latency_s"] for r in normal]
    kinds = {}
    for r in hostile_log:
        d = kinds.setdefault(r["kind"], {"sent": 0, "as_expected": 0, "unexpected": []})
        d["sent"] += 1
        if r["got"] == r["expected"]:
            d["as_expected"] += 1
        elif len(d["unexpected"]) < 5:
            d["unexpected"].append(r)
    return {
        "seconds": round(wall, 1), "clients": clients, "hostile_fraction": hostile,
        "normal_requests": len(normal), "normal_failed": len(failures), "normal_failures": failures[:10],
        "normal_requests_per_s": len(normal) / wall,
        "completion_tokens_per_s": sum(r["tokens"] for r in normal) / wall,
        "alone_latency_p50_s": percentile(alone_s, 50), "latency_p50_s": percentile(lat, 50), "latency_p99_s": percentile(lat, 99), "latency_max_s": max(lat, default=0),
        "replies_identical": len(normal) - len(mismatches), "replies_differing": len(mismatches),
        "mismatch_examples": mismatches[:5],
        "normal_log": [(round(r["done_at"] - t_start, 2), round(r["latency_s"], 2), r["prompt"]) for r in normal], "alone_after_equal_first": after == [first[k] for k in range(len(prompts))],
        "hostile_requests": len(hostile_log), "hostile": kinds,
        "hostile_unexpected": sum(d["sent"] - d["as_expected"] for d in kinds.values()),
        "rss_mb": {k: round(v, 1) for k, v in rss.items()}, "rss_growth_mb": round(rss["end"] - rss["start"], 1),
        "rss_series_mb": series,
        "health_after": {"status": h["status"], "busy_rows": h["stats"]["busy_rows"],
                         "waiting": h["stats"]["waiting"], "drained_s": round(drained_s, 2)},
        "compiles_during_soak": compiles,
        "server_tracebacks": sum("Traceback" in line for line in server.lines),
        "server_alive": server.proc.poll() is None,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=90)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--hostile", type=float, default=0.4, help="probability that a request is hostile")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "serve_soak",
                                                  "serve_soak.json"))
    args = ap.parse_args()

    from serve_helpers import ServerProcess, write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(tempfile.mkdtemp(prefix="serve_soak_"))
    server = ServerProcess(ckpt, "--max_batch=8", "--noagent", f"--max_request_mb={LIMIT_MB}",
                           f"--header_timeout_s={DEADLINE_S}", f"--body_timeout_s={DEADLINE_S}")
    load_before = os.getloadavg()
    try:
        res = soak(server, normal_prompts(), args.seconds, args.clients, args.hostile, args.seed)
    finally:
        server.close()
    res.update({"date": time.strftime("%Y-%m-%d"), "cpu": cpu_model(), "cpus": os.cpu_count(),
                "machine": platform.platform(), "load_avg_1m_before_after": [round(load_before[0], 2),
                                                                             round(os.getloadavg()[0], 2)],
                "server_flags": "--max_batch=8 --max_context=1024 --decode_chunk=8 --noagent "
                                f"--max_request_mb={LIMIT_MB} --header_timeout_s={DEADLINE_S} "
                                f"--body_timeout_s={DEADLINE_S}",
                "note": "tiny random model on CPU; figures from a shared machine are only comparable within one run"})

    rows = [
        ("wall (s), clients, hostile share", f"{res['seconds']}, {res['clients']}, {res['hostile_fraction']}"),
        ("normal requests (failed)", f"{res['normal_requests']} ({res['normal_failed']})"),
        ("normal requests/s", f"{res['normal_requests_per_s']:.2f}"),
        ("completion tokens/s", f"{res['completion_tokens_per_s']:.1f}"),
        ("latency p50 / p99 / max (s)",
         f"{res['latency_p50_s']:.2f} / {res['latency_p99_s']:.2f} / {res['latency_max_s']:.2f}"),
        ("one request alone after the soak, p50 (s)", f"{res['alone_latency_p50_s']:.2f}"),
        ("replies equal to the first answer", f"{res['replies_identical']} of {res['normal_requests']}"),
        ("hostile requests (unexpected replies)", f"{res['hostile_requests']} ({res['hostile_unexpected']})"),
        ("server RSS start / peak / end (MB)",
         f"{res['rss_mb']['start']} / {res['rss_mb']['peak']} / {res['rss_mb']['end']}"),
        ("RSS growth (MB)", f"{res['rss_growth_mb']}"),
        ("RSS every 10 s (MB)", " ".join(str(mb) for _, mb in res["rss_series_mb"])),
        ("after: health, busy rows, waiting, drain (s)",
         f"{res['health_after']['status']}, {res['health_after']['busy_rows']}, {res['health_after']['waiting']}, "
         f"{res['health_after']['drained_s']}"),
        ("XLA compilations during the soak", f"{res['compiles_during_soak']}"),
        ("server tracebacks, alive", f"{res['server_tracebacks']}, {res['server_alive']}"),
    ]
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    print(f"{'hostile kind':<14} {'sent':>5} {'as expected':>12}")
    for kind in HOSTILE:
        d = res["hostile"].get(kind, {"sent": 0, "as_expected": 0})
        print(f"{kind:<14} {d['sent']:>5} {d['as_expected']:>12}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
