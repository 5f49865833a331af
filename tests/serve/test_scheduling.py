"""Scheduling that is fair and frees work (issue 38, part 2), against a real `launch.serve` process:

* a client that hangs up (non-streamed or streamed) frees its row at once: the server stops
  decoding for it (the generated-token counter of /health stops), instead of decoding to
  `max_tokens` for nobody while the next request waits;
* an agent request does not wait behind another agent request whose cell is slow;
* two prompts near the context limit both complete (the second used to stop the decode loop
  with a KV-cache error), and a prompt that can never fit is a 400.

One server with a context that is not a power of two (1200: padded prefills used to overrun the
cache) and two rows.
"""

import http.client
import json
import socket
import threading
import time

import openai
import pytest
from serve_helpers import ServerProcess

CONTEXT = 1200


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    s = ServerProcess(tiny_ckpt, f"--max_context={CONTEXT}", "--max_batch=2")
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=120, max_retries=0)


def _stats(server) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("GET", "/health")
    stats = json.loads(conn.getresponse().read())["stats"]
    conn.close()
    return stats


def _wait_for(cond, timeout=240.0):
    t0 = time.time()
    while not cond():
        assert time.time() - t0 < timeout, "timed out"
        time.sleep(0.05)


def _send(server, body: dict) -> socket.socket:
    """A complete POST on a raw socket; the reply is never read."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return sock


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_hangs_up_frees_its_row(server, stream):
    max_tokens = 1000  # seed 3 draws no end marker before it
    body = {"model": "codedance", "messages": [{"role": "user", "content": "tell me a long story"}],
            "max_tokens": max_tokens, "temperature": 1.0, "seed": 3, "stream": stream}
    before = _stats(server)["generated_tokens"]
    sock = _send(server, body)
    _wait_for(lambda: _stats(server)["generated_tokens"] > before)  # it is decoding
    sock.close()
    _wait_for(lambda: _stats(server)["busy_rows"] == 0)
    decoded = _stats(server)["generated_tokens"] - before
    assert decoded < max_tokens // 2, f"{decoded} tokens decoded for a client that had gone"


def test_an_agent_request_does_not_wait_behind_slow_cells(client):
    slow = ["<code>\n```python\nimport time\ntime.sleep(6)\nprint('slept')\n```\n</code>", "<answer>slow</answer>"]
    quick = ["<code>\n```python\nprint(6 * 7)\n```\n</code>", "<answer>42</answer>"]
    done = {}

    def run(name, script):
        r = client.chat.completions.create(model="codedance-agent", messages=[{"role": "user", "content": name}],
                                           temperature=0, max_tokens=100,
                                           extra_body={"agent_script": script, "max_turns": 2})
        done[name] = (time.time(), r.choices[0])

    t = threading.Thread(target=run, args=("slow", slow))
    t.start()
    time.sleep(1.0)  # the slow rollout has started
    run("quick", quick)
    t.join(timeout=120)
    assert done["quick"][1].trajectory["turns"][0]["observation"].strip() == "42"
    assert "slept" in done["slow"][1].trajectory["turns"][0]["observation"]
    assert done["quick"][0] < done["slow"][0], "the quick agent request waited for the slow one's cell"


def test_prompts_near_the_context_limit_wait_for_room(server, client):
    def messages(words: int):
        return [{"role": "user", "content": " hello" * words}]

    probe = client.chat.completions.create(model="codedance", messages=messages(1000), max_tokens=1)
    words = 1000 + (CONTEXT - 140) - probe.usage.prompt_tokens  # a prompt of CONTEXT - 140 tokens
    # Never fits: refused before it reaches the batcher.
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="codedance", messages=messages(CONTEXT + 10), max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded"

    replies = {}

    def run(seed):
        r = client.chat.completions.create(model="codedance", messages=messages(words), temperature=1.0, seed=seed)
        replies[seed] = r

    before = _stats(server)["generated_tokens"]
    first = threading.Thread(target=run, args=(1,))
    first.start()
    _wait_for(lambda: _stats(server)["generated_tokens"] > before + 16)  # the first one is decoding
    run(2)  # a second long prompt while the first holds most of the cache
    first.join(timeout=120)
    for r in replies.values():
        assert r.usage.prompt_tokens == CONTEXT - 140
        assert r.choices[0].finish_reason in ("length", "stop")
    assert _stats(server)["busy_rows"] == 0 and server.proc.poll() is None
