"""`config.async_rollout=1` (runs/grpo_overlap.py): step k+1's rollouts sampled with step k's
pre-update weights while step k's update runs.

One in-process run on a data=8 mesh of the session's 8 devices, the toy world and the loop test's overrides: 2
steps, then resumed to 4 in the same workdir (the resumed step rolls out synchronously). Checked:
staleness per step, the timestamps' overlap, no compilation after the plan, a plausible off-policy
ratio (against the recorded log-probs: not 1 exactly once the sampler is one update behind), and the
trajectories' recorded log-probs reproduced by the exported sampling policy, the pre-update copy
(so the donated update did not touch what the sampler read). Then `launch.grpo` on 2 processes x 4
devices, async: each next rollout starts before the update ends, nothing compiles after the plan.
"""

import os
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_grpo_loop import OVERRIDES, _rows, assert_recorded_logprobs  # noqa: E402

# The parameters replicated over data=8, as the sampling mesh's 8 devices want them: the sampler's
# placement keeps the trainer's very arrays, so without its own copy the donated update deletes
# what the rollout thread reads (on the loop test's (2,2,2) mesh the placement gathers new ones).
ASYNC = {**OVERRIDES, "mesh.data": 8, "mesh.fsdp": 1, "mesh.tensor": 1, "async_rollout": 1,
         "checkpoint.every_steps": 2, "eval.every": 0, "trajectories_every": 1}


def _config(**extra):
    from configs import grpo

    c = grpo.get_config("tiny")
    for k, v in {**ASYNC, **extra}.items():
        node, _, leaf = k.rpartition(".")
        (c[node] if node else c)[leaf] = v
    return c


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("the sandbox needs Linux and root")
    from runs.grpo import train_and_evaluate

    workdir = str(tmp_path_factory.mktemp("grpo_async"))
    train_and_evaluate(_config(total_steps=2), workdir)  # steps 1-2, checkpoint at 2
    out = train_and_evaluate(_config(total_steps=4), workdir)  # resumed: steps 3-4
    return workdir, out


def test_async_rows_staleness_overlap_and_ratio(async_run):
    workdir, out = async_run
    assert out["step"] == 4
    rows = _rows(workdir)
    assert sorted(rows) == [1, 2, 3, 4]
    # First step and first resumed step roll out synchronously; the others one update behind.
    assert [rows[s]["staleness"] for s in (1, 2, 3, 4)] == [0, 1, 0, 1], rows
    assert [rows[s]["compilations"] for s in (1, 2, 3, 4)] == [0, 0, 0, 0], rows
    for s in (1, 3):  # step s + 1's rollout started before step s's update ended, in the same run
        assert rows[s + 1]["time/rollout_start"] < rows[s]["time/update_end"], (s, rows[s], rows[s + 1])
        assert rows[s]["time/update_start"] < rows[s]["time/update_end"]
        assert rows[s]["time/rollout_start"] < rows[s]["time/rollout_end"] <= rows[s]["time/update_start"]
    for r in rows.values():
        for k in ("train/ratio_mean", "train/clip_frac", "train/ppo_kl", "train/loss", "train/grad_norm"):
            assert np.isfinite(r[k]), (k, r)
        assert 0.0 <= r["train/clip_frac"] <= 1.0
        assert abs(r["train/ratio_mean"] - 1.0) < 0.05, r
        assert abs(r["train/ppo_kl"]) < 0.05, r
    # The ratio's denominator is the sampler's recorded log-probs, not a recompute under the update's
    # weights (that would give exactly 1 and 0): one update behind, the two policies differ.
    assert rows[1]["train/grad_norm"] > 0
    assert abs(rows[2]["train/ppo_kl"]) > 1e-6 and abs(rows[2]["train/ratio_mean"] - 1.0) > 1e-6, rows[2]
    # On policy (step 1: the trajectories' own weights) the recorded log-probs equal the forward's.
    assert abs(rows[1]["train/ppo_kl"]) < 1e-5 and abs(rows[1]["train/ratio_mean"] - 1.0) < 1e-5, rows[1]


def test_async_trajectories_carry_their_sampling_policy_log_probs(async_run):
    """Step 2's trajectories were sampled by the pre-update copy of step 1's weights, exported as
    policies/step_1: one forward of it reproduces their recorded log-probs, which are the batch's
    old log-probs (`rl_batch`): the ratio is taken against the sampling policy."""
    from codedance_jax.rollout import load_jsonl

    workdir, _ = async_run
    trajs = [t for t in load_jsonl(os.path.join(workdir, "trajectories.jsonl")) if t.policy.endswith("step_1")]
    assert len(trajs) == 16
    assert_recorded_logprobs(trajs[:6])


def test_async_takes_the_recorded_old_log_probs():
    """async_rollout=1 turns the update's own-forward old log-probs off, whatever
    recompute_old_logprobs says; async_rollout=0 leaves it as it was."""
    from runs.grpo_stages import old_from_forward

    assert old_from_forward(_config(async_rollout=0, recompute_old_logprobs=True))
    assert not old_from_forward(_config(async_rollout=0, recompute_old_logprobs=False))
    assert not old_from_forward(_config(async_rollout=1, recompute_old_logprobs=True))


def test_async_rollout_value_is_checked():
    from codedance_jax.errors import ConfigError
    from runs import grpo_overlap

    assert not grpo_overlap.enabled(_config(async_rollout=0)) and grpo_overlap.enabled(_config(async_rollout=1))
    with pytest.raises(ConfigError, match="async_rollout=2"):
        grpo_overlap.enabled(_config(async_rollout=2))


def test_sampler_copy_shares_no_buffer_with_the_trainer():
    """`own_copy`: the leaves a placement kept from the trainer are copied on their devices (values
    equal, buffers new, nothing compiled), the others left as they are."""
    import jax
    import jax.numpy as jnp

    from codedance_jax.rollout.buckets import CompileCounter
    from runs.grpo_stages import _buffers, own_copy

    rng = np.random.default_rng()
    trainer = {"a": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32), "b": jnp.asarray(rng.normal(size=(3,)), jnp.float32)}
    other = jnp.asarray(rng.normal(size=(5,)), jnp.float32)
    placed = {"a": trainer["a"], "b": other}
    jax.block_until_ready((trainer, placed))
    c0 = CompileCounter.total()
    got = own_copy(placed, trainer)
    assert CompileCounter.total() == c0
    assert not _buffers(got["a"]) & _buffers(trainer["a"]) and got["b"] is other
    np.testing.assert_array_equal(np.asarray(got["a"]), np.asarray(trainer["a"]))


def test_async_two_processes_overlap(tmp_path):
    """`launch.grpo` on 2 processes x 4 CPU devices (gloo on 127.0.0.1), async_rollout=1, 3 steps:
    both finish, nothing compiles after the plan, and (process 0's rows) each step's rollout of the
    next one started before its update ended."""
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("the sandbox needs Linux and root")
    import subprocess

    from launch_env import launcher_env
    from test_grpo_loop import _free_port

    workdir, port = str(tmp_path / "mp"), _free_port()
    over = {**OVERRIDES, "async_rollout": 1, "total_steps": 3, "checkpoint.every_steps": 3, "eval.every": 0}
    cmd = [sys.executable, "-m", "launch.grpo", f"--workdir={workdir}", "--config=configs/grpo.py:tiny",
           *(f"--config.{k}={v}" for k, v in over.items()),
           "--cpu_devices=4", f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2"]
    procs = [subprocess.Popen([*cmd, f"--process_id={i}"], cwd=REPO, env=launcher_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True) for i in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    rows = _rows(workdir)
    assert sorted(rows) == [1, 2, 3]
    assert [rows[s]["staleness"] for s in (1, 2, 3)] == [0, 1, 1], rows
    assert [rows[s]["compilations"] for s in (1, 2, 3)] == [0, 0, 0], rows
    for s in (1, 2):
        assert rows[s + 1]["time/rollout_start"] < rows[s]["time/update_end"], (s, rows[s], rows[s + 1])
    for r in rows.values():
        assert np.isfinite(r["train/ratio_mean"]) and 0.0 <= r["train/clip_frac"] <= 1.0, r
