"""The runner with a scripted policy (no model): predictions, trajectories, resume, and the HTML
report rendered by a real headless Chromium (skipped, with the reason, when chromium is absent)."""

import json
import os
import re
import shutil
import subprocess
import tempfile

import numpy as np
import pytest
from eval_fixtures import write_tsv
from PIL import Image

from codedance_jax.rollout import Trajectory
from eval import load_benchmark, run_eval, write_report

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class TextProcessor:
    """Tokens are character codes: enough for the runner's per-turn decoding."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


class ScriptedPolicy:
    """Item k follows SCRIPTS[k % 3]: (turn text, status, observation, produced image size) per turn."""

    SCRIPTS = [
        [
            ("<think>crop it</think><code>```python\nshow()\n```</code>", "ok", "size 20", (20, 16)),
            ("<think>so</think><answer>45</answer>", "no_code", "", None),
        ],
        [
            ("<think>try</think><code>```python\n1/0\n```</code>", "error", "ZeroDivisionError", None),
            ("<answer>none</answer>", "no_code", "", None),
        ],
        [("<answer>No</answer>", "no_code", "", None)],
    ]

    def __init__(self):
        self.processor = TextProcessor()
        self.calls = []

    def __call__(self, prompts):
        self.calls.append([p.id for p in prompts])
        out = []
        for p in prompts:
            k = (int(p.id) - 100) % 3
            toks = [ord(c) for c in "prompt"]
            mask, tids = [0] * len(toks), [-1] * len(toks)
            images = list(p.images)
            turns, status = [], []
            answer = None
            for m, (text, st, obs, size) in enumerate(self.SCRIPTS[k]):
                ids = [ord(c) for c in text]
                toks += ids
                mask += [1] * len(ids)
                tids += [m] * len(ids)
                n_img = 0
                if size:
                    arr = np.random.default_rng(m).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
                    images.append(Image.fromarray(arr))
                    n_img = 1
                turns.append(
                    dict(
                        status=st,
                        observation=obs,
                        n_images=n_img,
                        code="show()" if st == "ok" else ("1/0" if st == "error" else None),
                    )
                )
                status.append(st)
                if "<answer>" in text:
                    answer = text.split("<answer>")[1].split("</answer>")[0]
            out.append(
                Trajectory(
                    id=f"{p.id}-0",
                    prompt_id=p.id,
                    group=0,
                    prompt_len=6,
                    tokens=toks,
                    loss_mask=mask,
                    turn_ids=tids,
                    logprobs=[0.0] * len(toks),
                    temperature=1.0,
                    images=images,
                    image_grid_thw=[],
                    turn_status=status,
                    turns=turns,
                    answer=answer,
                    finish_reason="answer",
                    policy="scripted",
                )
            )
        return out


def test_run_resume_and_files(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    items = load_benchmark("ChartQA", write_tsv(str(data), "ChartQA"))
    wd = str(tmp_path / "run")
    pol = ScriptedPolicy()
    s = run_eval("ChartQA", items[:2], pol, wd, batch_size=1, log=lambda m: None)
    assert pol.calls == [["100"], ["101"]]
    # Restart with all three items: the two scored ones are skipped.
    pol2 = ScriptedPolicy()
    s = run_eval("ChartQA", items, pol2, wd, batch_size=8, log=lambda m: None)
    assert pol2.calls == [["102"]]
    preds = [json.loads(x) for x in open(os.path.join(wd, "predictions.jsonl"))]
    assert [p["index"] for p in preds] == ["100", "101", "102"]
    assert [p["rule_verdict"] for p in preds] == ["correct", "wrong", "wrong"]
    assert [p["prediction"] for p in preds] == ["45", "none", "No"]
    assert s["accuracy_rule"] == pytest.approx(100 / 3) and s["avg_turns"] == pytest.approx(5 / 3)
    assert s["tool_calls"] == 2 and s["exec_success_rate"] == pytest.approx(50.0)
    assert s["paper_codedance_7b"] == 87.5 and s["paper_qwen25vl_7b"] == 86.3
    trajs = [json.loads(x) for x in open(os.path.join(wd, "trajectories.jsonl"))]
    t0 = trajs[0]
    for k in (
        "id",
        "prompt_id",
        "tokens",
        "loss_mask",
        "turn_ids",
        "logprobs",
        "temperature",
        "images",
        "turn_status",
        "answer",
        "correct",
        "rewards",
        "policy",
    ):
        assert k in t0, k
    assert t0["correct"] is True and t0["turn_texts"][1] == "<think>so</think><answer>45</answer>"
    assert all(os.path.isfile(os.path.join(wd, p)) for t in trajs for p in t["images"])
    assert Image.open(os.path.join(wd, t0["images"][1])).size == (20, 16)
    header = open(os.path.join(wd, "predictions.tsv")).readline().rstrip("\n").split("\t")
    assert header[:5] == ["index", "question", "answer", "prediction", "hit"]
    assert "| ChartQA | 3 |" in open(os.path.join(wd, "summary.md")).read()


def _dump_dom(url: str) -> tuple[str, str]:
    with tempfile.TemporaryDirectory() as profile:
        r = subprocess.run(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={profile}",
                "--enable-logging=stderr",
                "--v=0",
                "--virtual-time-budget=10000",
                "--dump-dom",
                url,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout, r.stderr


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium chromium-driver)")
def test_report_renders_in_headless_chromium(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    items = load_benchmark("ChartQA", write_tsv(str(data), "ChartQA"))
    wd = str(tmp_path / "run")
    summary = run_eval("ChartQA", items, ScriptedPolicy(), wd, batch_size=2, log=lambda m: None)
    path = write_report(wd, summary)
    dom, log = _dump_dom("file://" + path)
    body = re.search(r"<body([^>]*)>", dom).group(1)
    assert 'data-ready="1"' in body, body
    assert "data-js-errors" not in body, body
    assert not re.search(r"CONSOLE.*(Uncaught|Error)", log), log[-2000:]
    # Every item, its question, each turn's code/output and the produced image are there.
    assert dom.count('class="item ') == 3
    assert "What is the peak value?" in dom and "ZeroDivisionError" in dom and "show()" in dom
    assert 'data-shown="3"' in body
    imgs = re.findall(r'<img src="([^"]+)"', dom)
    assert len(imgs) == 4  # three prompt images and one produced by a code cell
    assert 'data-images-ok="4"' in body and 'data-images-broken="0"' in body, body
    assert "87.5" in dom and "86.3" in dom  # the paper's numbers beside ours
    # Filters: the page opened at #filter=wrong shows only the wrong items.
    dom, _ = _dump_dom("file://" + path + "#filter=wrong")
    body = re.search(r"<body([^>]*)>", dom).group(1)
    assert 'data-filter="wrong"' in body and 'data-shown="2"' in body
    shown = re.findall(r'<div class="item (\w+)"[^>]*data-verdict="\w+"[^>]*data-failed-exec="\d"(?![^>]*hidden)', dom)
    assert shown == ["wrong", "wrong"]
    dom, _ = _dump_dom("file://" + path + "#filter=failed")
    assert 'data-shown="1"' in re.search(r"<body([^>]*)>", dom).group(1)
