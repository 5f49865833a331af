"""`launch.serve`'s server on a sampling mesh (`ServeConfig.mesh_data` / `mesh_tensor`), in this
process on the session's 8 CPU devices, behind uvicorn on 127.0.0.1 and called over HTTP by the
`openai` client: three concurrent greedy completions are token for token the same on one device,
on 4 devices (rows split over `data`) and on 2 x 2 (rows over 2, weights and KV cache split by
heads over 2), with the parameters and the batcher's cache laid out as the mesh asks and row
buckets that are multiples of `data`. Agent mode (code run in the sandbox, its image appended) gives
one device's trajectory on 2 x 2, its engine's rows over `data`."""

import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

QUESTIONS = ("What is a prime number?", "Name three colours of the sea, please.", "Why do we sleep?")


def _serve(model, processor, agent=False, **mesh):
    import uvicorn

    from codedance_jax.serve import ServeConfig, Server
    from codedance_jax.serve.server import bind

    server = Server(model, processor, ServeConfig(agent=agent, max_batch=8, max_context=512, decode_chunk=8, **mesh))
    server.start()
    sock = bind("127.0.0.1", 0)
    uv = uvicorn.Server(uvicorn.Config(server.app, log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not uv.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert uv.started

    def close():
        uv.should_exit = True
        thread.join(timeout=30)
        server.close()
        sock.close()

    return server, f"http://127.0.0.1:{sock.getsockname()[1]}/v1", close


def _complete(url: str) -> list[tuple[str, list[str], list[float]]]:
    """The three questions at once (one thread each): (text, tokens, log-probs) per question."""
    import openai

    client = openai.OpenAI(base_url=url, api_key="unused", timeout=600, max_retries=0)
    out: list = [None] * len(QUESTIONS)

    def ask(i):
        r = client.chat.completions.create(model="codedance", messages=[{"role": "user", "content": QUESTIONS[i]}],
                                           temperature=0, max_tokens=20, logprobs=True)
        ch = r.choices[0]
        out[i] = (ch.message.content, [t.token for t in ch.logprobs.content], [t.logprob for t in ch.logprobs.content])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(QUESTIONS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=900)
    assert all(o is not None for o in out)
    return out


def test_greedy_completions_are_the_same_on_every_sampling_mesh(tiny_ckpt):
    from codedance_jax.errors import ConfigError
    from codedance_jax.serve import ServeConfig, Server
    from codedance_jax.serve.server import load

    assert jax.local_device_count() == 8
    model, processor = load(tiny_ckpt)
    runs = {}
    for d, t in ((1, 1), (4, 1), (2, 2)):
        server, url, close = _serve(model, processor, mesh_data=d, mesh_tensor=t)
        try:
            runs[d, t] = _complete(url)
            b = server.batcher
            q = server.model.layers[0].attn.q_kernel.get_value()
            if d * t == 1:  # as before: no mesh, the model where it was loaded
                assert server.mesh is None and b.multiple == 1 and len(q.sharding.device_set) == 1
            else:
                assert dict(server.mesh.shape) == {"data": d, "fsdp": 1, "tensor": t}
                assert q.sharding.device_set == set(jax.local_devices()[: d * t])
                assert ("tensor" in tuple(q.sharding.spec)) == (t > 1)  # heads split over `tensor`
                assert b.multiple == d and b._rows_in_use(1) == d and b._rows_in_use(d + 1) == 2 * d
                k = b.batch.cache.k[0].sharding.spec  # rows over `data`, KV heads over `tensor`
                assert k == PartitionSpec("data", "tensor" if t > 1 else None, None, None)
            assert b.stats["generated_tokens"] > 0 and b.error is None
        finally:
            close()
    base = runs[1, 1]
    assert all(len(toks) > 5 for _, toks, _ in base) and len({text for text, _, _ in base}) == 3
    for n, got in runs.items():
        for (text, toks, lps), (want_text, want_toks, want_lps) in zip(got, base, strict=True):
            assert (text, toks) == (want_text, want_toks), n
            np.testing.assert_allclose(lps, want_lps, atol=1e-4, err_msg=str(n))
    with pytest.raises(ConfigError, match="max_batch=6 does not split over the sampling mesh's 4 data slices"):
        Server(model, processor, ServeConfig(agent=False, max_batch=6, mesh_data=4))
    with pytest.raises(ConfigError, match="--mesh_tensor=3"):
        Server(model, processor, ServeConfig(agent=False, mesh_data=-1, mesh_tensor=3))


def test_agent_mode_gives_one_devices_trajectory_on_a_tensor_mesh(tiny_ckpt):
    import base64
    import io
    import os

    import openai
    from PIL import Image

    from codedance_jax.serve.server import load

    if os.geteuid() != 0:
        pytest.skip("the sandbox needs root")
    model, processor = load(tiny_ckpt)
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(5).integers(0, 255, (60, 80, 3), dtype=np.uint8)).save(buf, format="PNG")
    image = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    code = ("<think>crop</think>\n<code>\n```python\nfrom PIL import Image\nim = Image.open('image.png')\n"
            "print(im.size[0] * im.size[1])\nim.crop((0, 0, 40, 30)).save('crop.png')\n```\n</code>")
    runs = {}
    for d, t in ((1, 1), (2, 2)):
        server, url, close = _serve(model, processor, agent=True, mesh_data=d, mesh_tensor=t)
        try:
            client = openai.OpenAI(base_url=url, api_key="unused", timeout=600, max_retries=0)
            r = client.chat.completions.create(
                model="codedance-agent", temperature=0, max_tokens=120, logprobs=True,
                messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                                       {"type": "text", "text": "How many pixels?"}]}],
                extra_body={"agent_script": [code], "max_turns": 2})
            runs[d, t] = r.choices[0].trajectory
            engines = list(server.agent._engines.values())
            assert len(engines) == 1 and (engines[0].mesh is None) == (d * t == 1)
            if d * t > 1:
                assert dict(engines[0].mesh.shape) == {"data": d, "fsdp": 1, "tensor": t}
        finally:
            close()
    base = runs[1, 1]
    assert base["turns"][0]["status"] == "ok" and "4800" in base["turns"][0]["observation"]
    assert len(base["turns"][0]["images"]) == 1 and len(base["turns"]) == 2  # the second turn was sampled
    got = runs[2, 2]
    assert got["turn_status"] == base["turn_status"]
    assert [u["observation"] for u in got["turns"]] == [u["observation"] for u in base["turns"]]
    assert got["turns"][1] == base["turns"][1]  # the policy's own turn after the image, token for token
