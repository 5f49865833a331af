"""`python -m launch.serve` through the official `openai` client, against a real server process.

Greedy replies (plain and streamed) equal `RolloutEngine`'s greedy rollout of the same chat prompt,
token for token, log-probs included; images reach the model from data URLs (local paths, refused
by default, are tested with hostile clients in test_serve_hostile.py);
concurrent requests all complete with the replies they get alone, and a short request is not held
behind a long one; agent mode executes code in the sandbox; errors are OpenAI-shaped with the right
status codes; launcher user errors exit 2 with one line.
"""

import base64
import concurrent.futures
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest
from PIL import Image
from serve_helpers import MAX_CONTEXT, ROOT, server_env


def _png_url(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _noise_image(seed: int, size=(96, 72)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    """The rollout engine over the same checkpoint, greedy, one turn: what the server must reproduce."""
    from flax import nnx

    import codedance_jax
    from codedance_jax.rollout import Prompt, RolloutConfig, RolloutEngine, SamplingConfig

    model, processor = codedance_jax.from_pretrained(tiny_ckpt)

    rollouts = {}

    def greedy(question: str, images: list, max_tokens: int):
        """The engine's greedy trajectory, once per (question, images, budget): `margin` and `run`
        ask for the same one."""
        key = (question, tuple(map(id, images)), max_tokens)
        if key not in rollouts:
            cfg = RolloutConfig(max_turns=1, max_turn_tokens=max_tokens, max_new_tokens=max_tokens,
                                max_total_tokens=MAX_CONTEXT, decode_chunk=8, prompt_buckets=(256, 512, 1024),
                                batch_multiple=1)
            eng = RolloutEngine(model, processor, cfg, SamplingConfig(greedy=True))
            content = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
            text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
            (rollouts[key],), _ = eng.rollout([Prompt("p", text, images)], group_size=1)
        return rollouts[key]

    def run(question: str, images: list, max_tokens: int):
        traj = greedy(question, images, max_tokens)
        ids = traj.tokens[traj.prompt_len :]
        lps = traj.logprobs[traj.prompt_len :]
        eos = [k for k, t in enumerate(ids) if t in (processor.eos_id, processor.tokenizer.encode("<|endoftext|>")[0])]
        if eos:
            ids, lps = ids[: eos[0]], lps[: eos[0]]
        return processor.decode(ids, skip_special_tokens=True), ids, lps, traj.prompt_len

    forward = nnx.jit(lambda m, *a: m.forward(*a))

    def margin(question: str, images: list, max_tokens: int) -> tuple[float, int]:
        """(smallest top-1 minus top-2 logit over the greedy reply's steps, reply length): a near-tie
        can flip between two programs that agree to float noise (other cache lengths and batches)."""
        traj = greedy(question, images, max_tokens)
        # Right-padded to one length, so every drawn question reuses one compiled forward (causal:
        # padding after the reply does not change its logits).
        n = len(traj.tokens)
        seq = np.full((1, -(-n // 128) * 128), processor.pad_id, np.int64)
        seq[0, :n] = traj.tokens
        mask = (np.arange(seq.shape[1]) < n)[None].astype(np.int64)
        pv, grid = processor.encode_images(traj.images) if traj.images else (None, None)
        p = model.prepare(seq, mask, pv, grid)
        logits = np.asarray(forward(model, p["input_ids"], p["positions"], p["attention_mask"], p["vis"]), np.float32)
        top2 = np.sort(logits[0, traj.prompt_len - 1 : n - 1], axis=-1)[:, -2:]
        return float((top2[:, 1] - top2[:, 0]).min()), len(traj.tokens) - traj.prompt_len

    run.margin = margin
    return run


def _chat(client, content, **kw):
    return client.chat.completions.create(model="codedance", messages=[{"role": "user", "content": content}], **kw)


def test_models_lists_chat_and_agent(client):
    assert [m.id for m in client.models.list()] == ["codedance", "codedance-agent"]
    assert client.models.retrieve("codedance").id == "codedance"


def test_greedy_plain_and_streamed_equal_the_engine(client, reference):
    img = _noise_image(1)
    rng = np.random.default_rng()
    # A fresh question, but not one whose greedy reply has a near-tie (~1 in 1000 would flip between
    # the engine's and the server's programs: equal to float noise, not bitwise) or ends within one
    # decode chunk (then nothing streams in parts).
    for _ in range(20):
        question = f"What is in this picture, item {rng.integers(1000)}?"
        gap, n_reply = reference.margin(question, [img], 24)
        if gap > 1e-3 and n_reply > 8:
            break
    else:
        pytest.fail("20 drawn questions all had a greedy near-tie or a one-chunk reply")
    want_text, want_ids, want_lps, prompt_len = reference(question, [img], 24)
    content = [{"type": "image_url", "image_url": {"url": _png_url(img)}}, {"type": "text", "text": question}]
    r = _chat(client, content, temperature=0, max_tokens=24, logprobs=True)
    ch = r.choices[0]
    assert ch.message.content == want_text
    assert r.usage.prompt_tokens == prompt_len and r.usage.completion_tokens == len(want_ids)
    assert ch.finish_reason == ("length" if len(want_ids) == 24 else "stop")
    got_lps = [t.logprob for t in ch.logprobs.content]
    np.testing.assert_allclose(got_lps, want_lps, atol=2e-4)
    stream = _chat(client, content, temperature=0, max_tokens=24, stream=True, stream_options={"include_usage": True})
    parts, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(parts) == want_text
    assert finish == ch.finish_reason and usage.completion_tokens == len(want_ids)
    assert len([p for p in parts if p]) > 1  # it really streamed (one delta per decode chunk at least)


def test_images_reach_the_model_from_data_urls(client):
    a, b = _noise_image(2), _noise_image(3)

    def first_logprobs(url):
        r = _chat(client, [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "describe"}],
                  temperature=0, max_tokens=4, logprobs=True)
        return [t.logprob for t in r.choices[0].logprobs.content], r.choices[0].message.content

    lp_a, text_a = first_logprobs(_png_url(a))
    lp_a2, text_a2 = first_logprobs(_png_url(a))
    # The same pixels give the same reply (log-probs to float noise: each request lands on other cache slots).
    assert text_a == text_a2
    np.testing.assert_allclose(lp_a2, lp_a, atol=1e-5)
    lp_b, _ = first_logprobs(_png_url(b))
    assert np.max(np.abs(np.subtract(lp_b, lp_a))) > 1e-4  # another image gives the model other pixels


def test_stop_strings_cut_the_reply(client, reference):
    question = "Say something."
    want, _, _, _ = reference(question, [], 40)
    assert len(want) > 12
    stop = want[6:9]
    cut = want[: want.find(stop)]
    r = _chat(client, question, temperature=0, max_tokens=40, stop=[stop])
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    s = _chat(client, question, temperature=0, max_tokens=40, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in s if c.choices) == cut


def test_concurrent_requests_all_complete_with_their_own_replies(client):
    questions = [f"question number {k}" for k in range(16)]
    alone = {q: _chat(client, q, temperature=0, max_tokens=6 + k).choices[0].message.content
             for k, q in enumerate(questions[:3])}
    seeded = _chat(client, "sample me", temperature=0.8, top_p=0.9, seed=7, max_tokens=8, n=2)

    def one(k):
        if k < 3:
            return "greedy", k, _chat(client, questions[k], temperature=0, max_tokens=6 + k).choices[0].message.content
        if k < 5:
            r = _chat(client, "sample me", temperature=0.8, top_p=0.9, seed=7, max_tokens=8, n=2)
            return "seeded", k, [c.message.content for c in r.choices]
        r = _chat(client, questions[k], temperature=1.0, max_tokens=5 + k, n=1 + k % 2)
        return "free", k, [c.finish_reason for c in r.choices]

    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        results = list(ex.map(one, range(16)))
    assert len(results) == 16
    for kind, k, got in results:
        if kind == "greedy":
            assert got == alone[questions[k]]
        elif kind == "seeded":
            assert got == [c.message.content for c in seeded.choices]
        else:
            assert all(f in ("stop", "length") for f in got)
    assert seeded.choices[0].message.content != seeded.choices[1].message.content  # n draws differ


def test_a_short_request_is_not_held_behind_a_long_one(client):
    long_done = threading.Event()
    chunks = []

    def long_stream():
        for _chunk in _chat(client, "a long story", temperature=0, max_tokens=400, stream=True):
            chunks.append(time.time())
        long_done.set()

    t = threading.Thread(target=long_stream)
    t.start()
    t0 = time.time()
    while len(chunks) < 3 and time.time() - t0 < 120:  # the long request is decoding
        time.sleep(0.02)
    r = _chat(client, "short", temperature=0, max_tokens=3)
    short_done_at = time.time()
    t.join(timeout=300)
    assert r.choices[0].finish_reason in ("length", "stop")
    if len(chunks) > 10:  # the long one did not end early on EOS: it was still running
        assert short_done_at < chunks[-1]


def test_agent_mode_runs_code_in_the_sandbox(client):
    if os.geteuid() != 0:
        pytest.skip("the sandbox needs root")
    img = _noise_image(4, size=(80, 60))
    code_turn = ("<think>measure it</think>\n<code>\n```python\nfrom PIL import Image\nim = Image.open('image.png')\n"
                 "print(im.size[0] * im.size[1] + 6 * 7)\nim.crop((0, 0, 40, 30)).save('crop.png')\n```\n</code>")
    r = client.chat.completions.create(
        model="codedance-agent",
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png_url(img)}},
                                               {"type": "text", "text": "How many pixels, plus 42?"}]}],
        temperature=0, max_tokens=200,
        extra_body={"agent_script": [code_turn, "<think>done</think>\n<answer>4842</answer>"], "max_turns": 3})
    ch = r.choices[0]
    traj = ch.trajectory  # the extra field
    assert ch.message.content == "4842" and traj["answer"] == "4842"
    first = traj["turns"][0]
    assert first["status"] == "ok" and "4842" in first["observation"]  # 80*60 + 42, computed in the sandbox
    assert "Image.open('image.png')" in first["code"]
    assert len(first["images"]) == 1 and first["images"][0].startswith("data:image/png;base64,")
    crop = Image.open(io.BytesIO(base64.b64decode(first["images"][0].split(",", 1)[1])))
    assert crop.size[0] > 0
    assert traj["turn_status"] == ["ok", "no_code"] and traj["num_tool_calls"] == 1
    # The same through the request field, with a code error: status "error", the reply goes on.
    r = client.chat.completions.create(
        model="codedance", messages=[{"role": "user", "content": "go"}], temperature=0, max_tokens=100,
        extra_body={"agent": True, "max_turns": 2,
                    "agent_script": ["<code>\n```python\n1/0\n```\n</code>", "<answer>x</answer>"]})
    t = r.choices[0].trajectory
    assert t["turn_status"][0] == "error" and "ZeroDivisionError" in t["turns"][0]["observation"]


def test_errors_are_openai_shaped(client, server):
    def status(fn):
        with pytest.raises(openai.APIStatusError) as e:
            fn()
        err = e.value.body
        assert set(err) >= {"message", "type", "param", "code"} and "Traceback" not in err["message"]
        return e.value.status_code, err

    code, err = status(lambda: client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}]))
    assert code == 404 and err["code"] == "model_not_found"
    code, err = status(lambda: _chat(client, [{"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]))
    assert code == 400 and err["code"] == "invalid_image"
    code, err = status(lambda: _chat(client, [{"type": "image_url", "image_url": {"url": "/no/such/file.png"}}]))
    assert code == 400 and err["code"] == "invalid_image"
    code, err = status(lambda: _chat(client, "word " * (MAX_CONTEXT + 10)))
    assert code == 400 and err["code"] == "context_length_exceeded"
    code, err = status(lambda: _chat(client, "hi", max_tokens=MAX_CONTEXT))
    assert code == 400 and err["code"] == "context_length_exceeded"
    code, err = status(lambda: _chat(client, "hi", temperature=5))
    assert code == 400 and err["param"] == "temperature"
    code, err = status(lambda: _chat(client, "hi", logprobs=True, top_logprobs=3))
    assert code == 400 and err["param"] == "top_logprobs"
    code, err = status(lambda: client.chat.completions.create(model="codedance", messages=[]))
    assert code == 400
    def raw(path, data=None):
        req = urllib.request.Request(server.base_url + path, data=data, method="POST" if data else "GET",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    code, body = raw("/chat/completions", b"{not json")
    assert code == 400 and body["error"]["type"] == "invalid_request_error"
    code, body = raw("/nothing")
    assert code == 404 and "error" in body
    # The server still answers after all that.
    assert _chat(client, "still there?", temperature=0, max_tokens=2).choices[0].finish_reason in ("length", "stop")


def test_launcher_user_errors_exit_2_with_one_line(tiny_ckpt, tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "launch.serve", *args], cwd=ROOT, env=server_env(),
                              capture_output=True, text=True, timeout=300)

    r = run(f"--checkpoint={tmp_path / 'missing'}", "--port=0")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "--checkpoint" in r.stderr
    r = run("--port=0")
    assert r.returncode == 2 and "--checkpoint is required" in r.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        r = run(f"--checkpoint={tiny_ckpt}", f"--port={s.getsockname()[1]}")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--port" in r.stderr
