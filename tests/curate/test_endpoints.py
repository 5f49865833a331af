"""Endpoints over real HTTP (the scripted server): the on-disk cache, concurrency bound, failures."""

import json
import threading

import pytest

from data.toyworld.expert import png_bytes
from runs.curate.endpoints import Endpoint, EndpointError, ask
from runs.curate.pipeline import toy_items
from runs.curate.scripted import ScriptedModel, ScriptedServer


@pytest.fixture
def server(make_config):
    c = make_config(num_items=6)
    items = toy_items(c.source)
    with ScriptedServer(ScriptedModel(items)) as s:
        yield s, items


def test_cache_pays_nothing_twice_and_survives_a_torn_line(server, tmp_path):
    s, items = server
    path = str(tmp_path / "cache" / "judge.jsonl")
    ep = Endpoint(s.base_url, "scripted", role="judge", cache_path=path)
    png = png_bytes(items[0].image)
    prompt = f"Provided Correct Answer: {items[0].answer}\nevaluate a visual question"
    assert ask(ep, prompt, [png]) == "GOOD"
    assert ask(ep, prompt, [png]) == "GOOD" and s.requests == 1
    assert ask(ep, prompt, [png], sample=1) == "GOOD" and s.requests == 2  # another sample: another request
    with open(path, "a") as f:
        f.write('{"key": "torn')  # a writer killed mid-line
    ep2 = Endpoint(s.base_url, "scripted", role="judge", cache_path=path)
    assert ask(ep2, prompt, [png]) == "GOOD" and s.requests == 2 and ep2.cache.hits == 1
    ask(ep2, prompt + " ", [png])
    assert s.requests == 3
    rows = [json.loads(line) for line in open(path)]
    assert len(rows) == 3 and all(len(r["key"]) == 64 for r in rows)  # torn line cut, new reply appended


def test_concurrency_is_bounded(server, tmp_path):
    s, items = server
    s.delay_s = 0.2
    ep = Endpoint(s.base_url, "scripted", concurrency=2)
    png = png_bytes(items[1].image)
    threads = [threading.Thread(target=ask, args=(ep, f"expert vision-language analyst {i}", [png])) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert s.requests == 6 and s.peak == 2


def test_unreachable_endpoint_raises_and_caches_nothing(tmp_path):
    ep = Endpoint("http://127.0.0.1:9/v1", "m", cache_path=str(tmp_path / "c.jsonl"), timeout_s=2, retries=1)
    with pytest.raises(EndpointError, match="model"):
        ep.chat([{"role": "user", "content": "hi"}])
    assert ep.cache.data == {}
