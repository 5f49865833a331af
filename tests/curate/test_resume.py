"""`python -m launch.curate` killed (SIGKILL) in the middle of a stage, then re-run: no item lost or
decided twice, no request paid twice beyond the few in flight at the kill; a third run (in process,
same config) pays nothing."""

import json
import os
import signal
import subprocess
import sys
import time

from runs.curate import pipeline
from runs.curate.scripted import Faults, ScriptedModel, ScriptedServer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N = 8


def command(url, workdir):
    roles = [f"--config.{r}.url={url}" for r in pipeline.ROLES] + ["--config.weak.model=scripted-weak",
                                                                  "--config.weak.serve="]
    return [sys.executable, "-m", "launch.curate", "--config=configs/curate.py:toy", f"--workdir={workdir}",
            f"--config.source.num_items={N}", "--config.output.tfds=False", "--config.stratify.k=4",
            "--config.workers=4", *roles]


def lines(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n") and line.strip()]


def test_kill_mid_stage_then_resume(make_config, tmp_path):
    c = make_config(num_items=N)
    model = ScriptedModel(pipeline.toy_items(c.source), Faults(bug_rate=0.5))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)
    with ScriptedServer(model, delay_s=0.15) as server:
        cmd = command(server.base_url, tmp_path)
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.time() + 120
        target = tmp_path / "synthesize.jsonl"
        while len(lines(target)) < 2 and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        done_at_kill = len(lines(target))
        assert 2 <= done_at_kill < N  # killed mid-stage
        first = server.requests

        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "already decided" in r.stdout
        repeats = sum(n - 1 for n in server.bodies.values())
        assert repeats <= 4, repeats  # at most the requests in flight when it was killed (4 workers)
        assert server.requests > first

        items = [json.loads(x) for x in open(tmp_path / "items.jsonl")]
        prev = {x["id"] for x in items}
        for name in pipeline.STAGES:
            rows = lines(tmp_path / f"{name}.jsonl")
            ids = [x["id"] for x in rows]
            assert len(ids) == len(set(ids)), name  # nothing decided twice
            assert set(ids) == prev, name  # nothing lost
            prev = {x["id"] for x in rows if not x.get("drop")}
        sft = [json.loads(x) for x in open(tmp_path / "sft.jsonl")]
        assert {x["id"] for x in sft} == prev

        before = server.requests
        for role in pipeline.ROLES:  # the same run, in process: a finished run pays nothing
            c[role].url = server.base_url
        pipeline.run(c, str(tmp_path), log=lambda s: None)
        assert server.requests == before
