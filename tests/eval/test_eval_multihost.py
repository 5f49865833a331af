"""`launch.eval` with two processes on localhost (gloo): each evaluates every other item in its own
directory, process 0 merges one predictions file, summary and report; the merged predictions equal
a one-process run's (greedy rollouts, so the same replies)."""

import json
import os
import socket
import subprocess
import sys

from eval_fixtures import write_tsv
from launch_env import launcher_env
from test_launch_eval import ROOT, tiny_checkpoint  # noqa: F401 - the fixture is used by name

ARGS = ["--config=configs/eval.py:HRBench4K", "--config.dtype=float32", "--config.batch_size=4",
        "--config.max_turns=2", "--config.sandbox.kind=none", "--config.rollout.max_turn_tokens=12",
        "--config.rollout.max_new_tokens=24", "--config.rollout.max_total_tokens=448",
        "--config.rollout.batch_multiple=4", "--config.rollout.prompt_buckets=(384,)",
        "--config.rollout.obs_buckets=(64,)", "--config.rollout.decode_chunk=12"]


def _env():
    env = launcher_env()
    env.setdefault("JAX_COMPILATION_CACHE_DIR", "/tmp/jax_cache")
    return env


def _cmd(ckpt, data, wd, *extra):
    return [sys.executable, "-m", "launch.eval", ARGS[0], f"--config.checkpoint={ckpt}", f"--config.data_path={data}",
            f"--workdir={wd}", "--cpu_devices=1", *ARGS[1:], *extra]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _preds(wd):
    return [json.loads(x) for x in open(os.path.join(wd, "predictions.jsonl"))]


def test_two_processes_share_items_and_merge(tmp_path, tiny_checkpoint):  # noqa: F811
    data = write_tsv(str(tmp_path), "HRBench4K")
    mp, single = str(tmp_path / "mp"), str(tmp_path / "single")
    port = _free_port()
    procs = [subprocess.Popen(_cmd(tiny_checkpoint, data, mp, f"--coordinator_address=127.0.0.1:{port}",
                                   "--num_processes=2", f"--process_id={i}"),
                              cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    r = subprocess.run(_cmd(tiny_checkpoint, data, single), cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]

    merged, one = _preds(mp), _preds(single)
    assert [p["index"] for p in merged] == [p["index"] for p in one]  # the benchmark's order
    assert [p["prediction"] for p in merged] == [p["prediction"] for p in one]
    shares = [[p["index"] for p in _preds(os.path.join(mp, "processes", str(i)))] for i in range(2)]
    assert shares == [[one[0]["index"], one[2]["index"]], [one[1]["index"]]]  # every other item
    s = json.load(open(os.path.join(mp, "summary.json")))
    assert s["items"] == 3 and s == json.load(open(os.path.join(single, "summary.json")))
    trajs = [json.loads(x) for x in open(os.path.join(mp, "trajectories.jsonl"))]
    assert len(trajs) == 3 and all(os.path.exists(os.path.join(mp, im)) for t in trajs for im in t["images"])
    assert os.path.exists(os.path.join(mp, "report.html")) and os.path.exists(os.path.join(mp, "predictions.tsv"))
