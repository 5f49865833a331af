"""`sampling_params` with 2 processes x 4 CPU devices (gloo on 127.0.0.1; the worker is
`placement_worker.py`): the trainer's parameters (fsdp x tensor over all 8 devices, fsdp within a
process or across both) placed on each process's own sampling mesh with `tensor` = 2 or 4 are the
trainer's bit for bit, each leaf exactly its target sharding, and the placement is one program
whose output on each device is that device's shards only: no device receives a whole copy of a
leaf that `tensor` splits (as the gather-whole path did, each host holding the full policy)."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from launch_env import launcher_env

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(trainer_mesh: str, sampling: str, seed: int) -> list[dict]:
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "placement_worker.py"), str(port), "2", str(i),
                               trainer_mesh, sampling, str(seed)],
                              cwd=REPO, env=launcher_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
             for i in range(2)]
    try:
        outs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-4000:]
    return [json.loads(line[len("RESULT "):]) for out in outs for line in out.splitlines() if line.startswith("RESULT ")]


@pytest.mark.parametrize("trainer_mesh", ["2,2,2", "1,4,2"])
def test_each_host_receives_only_the_shards_its_sampling_devices_need(trainer_mesh):
    seed = int(np.random.default_rng().integers(1 << 20))
    results = _run(trainer_mesh, "-1x2,-1x4,1x2", seed)  # (data x tensor): 2 x 2, 1 x 4, and 1 x 2 of 4 devices
    assert sorted((r["process"], r["data"], r["tensor"]) for r in results) == [
        (p, d, t) for p in (0, 1) for d, t in ((-1, 2), (-1, 4), (1, 2))]
    for r in results:
        assert r["split"] >= 10, r  # heads, MLP, vocabulary, vision: most leaf shapes split
        assert r["whole_split"] == [] and r["whole_in_hlo"] == [] and r["programs"] == 1, r
        # each device's output is its shards (plus the output tuple's pointer table)
        assert r["output_bytes"] <= r["shard_bytes"] + 8 * r["leaves"], r
