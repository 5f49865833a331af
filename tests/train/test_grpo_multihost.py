"""`launch.grpo` on 2 processes x 4 CPU devices (gloo on 127.0.0.1) equals 1 process x 8 devices,
and a kill -9 of both processes after a checkpoint resumes to the same next step. This is the suite's
GRPO kill -9 + resume test (a single-process one in test_grpo_loop.py repeated it for ~50 CPU-seconds).

One reference run (1 process, 8 devices, 2 steps) is shared by both comparisons: the 2-process
run is killed once step 1's checkpoint exists, its step 1 is compared with the reference's, then
it resumes and its step 2 is compared too. Equal prompts and seeds give equal trajectories (host
h rolls out the h-th contiguous share of the step's prompts with the seeds of their global rows),
so rewards and advantages match exactly and the losses to float32 reduction-order noise.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
from launch_env import launcher_env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The tiny preset shrunk: 8 prompts in the world, 4 prompts x 4 rollouts a step, 2 short turns, one bucket each. The
# random-init policy never answers, so A_seq is 0; R_BAT's release preset turns a failed tool turn into
# a raw turn advantage (turn_norm="raw_if_constant"), which gives the update a non-zero loss.
ARGS = ["--config=configs/grpo.py:tiny", "--config.rbat.preset=release", "--config.total_steps=2", "--config.checkpoint.every_steps=1",
        "--config.eval.every=0", "--config.data.toy_sizes=0,8,1", "--config.rollout.max_turns=2",
        "--config.rollout.max_new_tokens=48", "--config.rollout.max_turn_tokens=24",
        # One bucket of each kind (prompt, observation, update batch): each bucket is one more compile of
        # its function in each of the three processes, and one of each exercises the same code.
        "--config.rollout.prompt_buckets=(256,)", "--config.rollout.obs_buckets=(128,)", "--config.buckets=((512,160,40),)"]
# Compared per step; exact for what comes from the (identical) trajectories, rtol for the update.
EXACT = ("accuracy", "format_ok", "groups_mixed", "a_seq_abs", "a_turn_abs", "reward/r_acc", "reward/r_format",
         "reward/r_seq", "reward/total", "train/n_tokens")
LOSSES = ("train/loss", "train/pg_loss", "train/entropy", "train/grad_norm")
RTOL = 1e-4


def _env():
    env = launcher_env()
    env.setdefault("JAX_COMPILATION_CACHE_DIR", "/tmp/jax_cache")
    return env


def _cmd(workdir, *extra):
    return ["nice", "-n", "10", sys.executable, "-m", "launch.grpo", f"--workdir={workdir}", *ARGS, *extra]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_processes(workdir):
    port = _free_port()
    return [subprocess.Popen(_cmd(workdir, "--cpu_devices=4", f"--coordinator_address=127.0.0.1:{port}",
                                  "--num_processes=2", f"--process_id={i}"),
                             cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
            for i in range(2)]


def _rows(workdir):
    """step -> the last metrics row written for it (a partly written last line is skipped)."""
    out = {}
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            out[row["step"]] = row
    return out


def _assert_same_step(got, ref, step):
    a, b = got[step], ref[step]
    for k in EXACT:
        assert k in b, f"{k} not logged"
        np.testing.assert_allclose(a[k], b[k], rtol=1e-6, atol=1e-7, err_msg=f"step {step} {k}")
    for k in LOSSES:
        np.testing.assert_allclose(a[k], b[k], rtol=RTOL, atol=1e-6, err_msg=f"step {step} {k}")


def test_two_processes_equal_one_and_resume_after_sigkill(tmp_path):
    ref_dir, mp = str(tmp_path / "ref"), str(tmp_path / "mp")
    ref_proc = subprocess.Popen(_cmd(ref_dir, "--cpu_devices=8"), cwd=REPO, env=_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    procs = _two_processes(mp)  # alongside the reference: the machine's cores are shared either way
    ckpt1 = os.path.join(mp, "checkpoints", "1")
    deadline = time.time() + 600

    # Killed as soon as step 1's checkpoint is committed (orbax renames its temporary directory to
    # "1" last). A step writes its metrics row before it checkpoints, so row 1 must be there: a loop
    # that saved first would lose the row here, and the resumed run would not write it again.
    while not os.path.isdir(ckpt1) and all(p.poll() is None for p in procs) and time.time() < deadline:
        time.sleep(0.02)
    for p in procs:
        os.killpg(p.pid, signal.SIGKILL)
    outs = [p.communicate()[0] for p in procs]
    assert os.path.isdir(ckpt1), "no checkpoint at step 1 before the kill:\n" + outs[0][-3000:]
    assert not os.path.isdir(os.path.join(mp, "checkpoints", "2")), "step 2 finished before the kill; nothing was resumed"
    assert 1 in _rows(mp), "step 1's checkpoint exists but its metrics row does not"

    procs = _two_processes(mp)
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    assert "step 2/2" in outs[0] and "step 1/2" not in outs[0]  # it resumed at step 2
    out = ref_proc.communicate(timeout=600)[0]
    assert ref_proc.returncode == 0, out[-3000:]

    ref, got = _rows(ref_dir), _rows(mp)
    assert sorted(ref) == sorted(got) == [1, 2]
    for step in (1, 2):
        _assert_same_step(got, ref, step)
    # Something was compared: non-zero advantages and gradients in at least one step.
    assert any(ref[s]["a_turn_abs"] > 0 and ref[s]["train/grad_norm"] > 0 for s in (1, 2)), ref


def test_host_shares_concatenate_to_the_one_process_prompts():
    """Host h's prompts are the h-th contiguous share, so the host-major allgather is the global order."""
    from data.rl_prompts import PromptSchedule

    rng = np.random.default_rng()
    n, per_step, seed = int(rng.integers(5, 40)), 4 * int(rng.integers(1, 4)), int(rng.integers(1000))
    sched = PromptSchedule(n, per_step, seed)
    for step in (0, 1, int(rng.integers(2, 50))):
        one = sched.indices(step)
        for hosts in (2, 4):
            assert sum((sched.indices(step, h, hosts) for h in range(hosts)), []) == one
