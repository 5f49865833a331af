"""The GRPO loop end to end on the toy world, one reference run shared by every test here:

- in process, on the session's (2,2,2) mesh of 8 devices: 3 steps, evaluation, trajectories whose
  policy reproduces their log-probs;
- `launch.grpo` on 2 processes x 4 CPU devices (gloo on 127.0.0.1), the same (2,2,2) mesh, killed
  with SIGKILL once step 1's checkpoint exists, then resumed: both steps equal the reference's. Equal
  prompts and seeds give equal trajectories (host h rolls out the h-th contiguous share of the
  step's prompts with the seeds of their global rows), so rewards and advantages match exactly and
  the losses to float32 reduction-order noise. Steps 1-2 of the 3-step reference are what a 2-step
  run does: the schedule is constant, and evaluation uses an engine and seeds of its own.

The multi-process comparison had a launcher reference of its own (1 process x 8 devices), one more
cold GRPO process in the suite (~95 CPU-seconds on 2 cores); it shares the in-process run instead.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from launch_env import launcher_env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The tiny preset (toy model, random init, a generated toy world) shrunk: 8 RL prompts and 4 held-out
# ones, 4 prompts x 4 rollouts a step, 2 short turns. The random-init policy never answers, so A_seq
# is 0; R_BAT's release preset turns a failed tool turn into a raw turn advantage
# (turn_norm="raw_if_constant"), which gives the update a non-zero loss. Seed 2: with the toy
# world's tokenizer (slot words isolated) this random policy runs code in step 1, so the
# two-process comparison below sees a non-zero gradient, and every shape compiles in step 1 (seed
# 0's first tool turn came at step 3 and compiled its observation shapes there).
OVERRIDES = {"seed": 2, "mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2, "rbat.preset": "release",
             "data.toy_sizes": (0, 8, 4), "rollout.max_turns": 2, "rollout.max_new_tokens": 48,
             "rollout.max_turn_tokens": 24}
REFERENCE = {**OVERRIDES, "total_steps": 3, "checkpoint.every_steps": 2, "eval.every": 2, "eval.limit": 4,
             "trajectories_every": 3}
LAUNCHED = {**OVERRIDES, "total_steps": 2, "checkpoint.every_steps": 1, "eval.every": 0}
# Compared per step; exact for what comes from the (identical) trajectories, rtol for the update.
EXACT = ("accuracy", "format_ok", "groups_mixed", "a_seq_abs", "a_turn_abs", "reward/r_acc", "reward/r_format",
         "reward/r_seq", "reward/total", "train/n_tokens")
LOSSES = ("train/loss", "train/pg_loss", "train/entropy", "train/grad_norm")
RTOL = 1e-4


def _config():
    from configs import grpo

    c = grpo.get_config("tiny")
    for k, v in REFERENCE.items():
        node, _, leaf = k.rpartition(".")
        (c[node] if node else c)[leaf] = v
    return c


def _rows(workdir):
    """step -> the last training row written for it (a partly written last line is skipped)."""
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
            if "accuracy" in row:
                out[row["step"]] = row
    return out


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("the sandbox needs Linux and root")
    import jax

    assert jax.device_count() == 8
    from runs import grpo_stages
    from runs.grpo import train_and_evaluate

    workdir = str(tmp_path_factory.mktemp("grpo_ref"))
    held, update = [], grpo_stages.update

    def spy(ctx, run, batch, step):  # what the rollout engine still holds when the update starts
        held.append((ctx.engine.last_batch, ctx.engine.sampler.state))
        return update(ctx, run, batch, step)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(grpo_stages, "update", spy)
        out = train_and_evaluate(_config(), workdir)
    out["held_at_update"] = held
    return workdir, out


def test_grpo_tiny_on_222_mesh(reference_run):
    workdir, out = reference_run
    assert out["step"] == 3
    rows = _rows(workdir)
    assert sorted(rows) == [1, 2, 3]
    for r in rows.values():
        for k in ("accuracy", "avg_turns", "reward/total", "train/loss", "train/entropy", "train/grad_norm",
                  "time/rollout_s", "time/update_s", "gen_tokens_per_s_per_device", "trained_tokens_per_s_per_device"):
            assert np.isfinite(r[k]), (k, r[k])
        assert r["logprob_mismatch"] < 1e-3  # the trainer's recompute agrees with the sampler
        assert r["train/n_tokens"] > 0
    # The shape plan was compiled before step 1 (runs/grpo_plan.py): no step and no evaluation
    # compiles anything, whatever lengths, images and layouts the random policy's steps meet.
    assert [rows[s]["compilations"] for s in (1, 2, 3)] == [0, 0, 0], rows
    plan = json.load(open(os.path.join(workdir, "shape_plan.json")))
    assert plan["compilations"] > 0 and {p["program"] for p in plan["programs"]} >= {"update", "rollout decode"}
    evals = [json.loads(x) for x in open(os.path.join(workdir, "eval.jsonl"))]
    assert [e["step"] for e in evals] == [2, 3] and all(e["eval/n"] == 4 for e in evals)
    assert [e["eval/compilations"] for e in evals] == [0, 0]
    assert os.path.exists(os.path.join(workdir, "policy", "codedance.json"))


def test_the_update_runs_without_the_rollouts_cache_and_weights(reference_run):
    """After its rollout the engine releases its KV cache and its copy of the weights (`release`):
    on a pod they were 31.5 + 3.9 GiB per chip beside the update's own memory."""
    _, out = reference_run
    assert len(out["held_at_update"]) == 3
    assert all(cache is None and weights is None for cache, weights in out["held_at_update"])


def _stats(workdir, name="rollout_stats.jsonl"):
    return [json.loads(x) for x in open(os.path.join(workdir, name))]


def test_rollouts_split_over_every_device(reference_run):
    """config.rollout.mesh_data = -1: each step's rollout splits its rows over all 8 devices, the
    policy replicated on each (WORKDIR/rollout_stats.jsonl, one row per step)."""
    from jax.sharding import PartitionSpec

    workdir, _ = reference_run
    stats = _stats(workdir)
    assert [s["step"] for s in stats] == [1, 2, 3] and all(s["host"] == 0 for s in stats)
    for s in stats:
        assert s["sampling_devices"] == 8 and s["sampling_mesh"] == {"data": 8, "fsdp": 1, "tensor": 1}, s
        # rows split over `data`, the rest whole (the one row layout `RowPlacement.settle` keeps)
        assert s["row_shardings"]["cache.k"] == str(PartitionSpec("data", None, None, None)), s
        assert s["row_shardings"]["logits"] == str(PartitionSpec("data", None)) and s["trajectories"] == 16, s


def test_trajectory_records_reproduce_with_their_policy(reference_run):
    """SPEC section 2: one full forward of `policy` over `tokens` gives `logprobs` on sampled tokens."""
    from codedance_jax.rollout import load_jsonl

    workdir, _ = reference_run
    trajs = load_jsonl(os.path.join(workdir, "trajectories.jsonl"))
    assert len(trajs) == 16 and all(t.policy and t.rewards for t in trajs)
    assert_recorded_logprobs(trajs[:8])


def assert_recorded_logprobs(trajs):
    """One full forward of the trajectories' policy (`trajs[0].policy`) over their tokens gives the
    log-probs they recorded on their sampled tokens."""
    import codedance_jax

    model, processor = codedance_jax.from_pretrained(trajs[0].policy)
    sys.path.insert(0, os.path.join(REPO, "tests", "rollout"))
    from rollout_helpers import full_logprobs

    ref = full_logprobs(model, processor, trajs, length=512)
    for t, lp in zip(trajs, ref, strict=True):
        m = np.asarray(t.loss_mask, bool)
        assert m.sum() > 0
        np.testing.assert_allclose(np.asarray(t.logprobs)[m], lp[m], atol=2e-4)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_processes(workdir):
    port = _free_port()
    env = launcher_env()
    cmd = [sys.executable, "-m", "launch.grpo", f"--workdir={workdir}", "--config=configs/grpo.py:tiny",
           *(f"--config.{k}={v}" for k, v in LAUNCHED.items()),
           "--cpu_devices=4", f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2"]
    return [subprocess.Popen([*cmd, f"--process_id={i}"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
            for i in range(2)]


def _assert_same_step(got, ref, step):
    a, b = got[step], ref[step]
    for k in EXACT:
        assert k in b, f"{k} not logged"
        np.testing.assert_allclose(a[k], b[k], rtol=1e-6, atol=1e-7, err_msg=f"step {step} {k}")
    for k in LOSSES:
        np.testing.assert_allclose(a[k], b[k], rtol=RTOL, atol=1e-6, err_msg=f"step {step} {k}")


def test_two_processes_equal_one_and_resume_after_sigkill(reference_run, tmp_path):
    mp = str(tmp_path / "mp")
    procs = _two_processes(mp)
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

    ref, got = _rows(reference_run[0]), _rows(mp)
    assert sorted(got) == [1, 2]
    # Each process rolled out on its own 4 devices; the resumed run dropped the rows past step 1.
    for host, name in enumerate(("rollout_stats.jsonl", "rollout_stats.host1.jsonl")):
        stats = _stats(mp, name)
        assert [(s["step"], s["host"], s["sampling_devices"], s["trajectories"]) for s in stats] == [
            (1, host, 4, 8), (2, host, 4, 8)], stats
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
