"""The GRPO loop end to end on the toy world: a (2,2,2) mesh, trajectories whose policy reproduces
their log-probs, evaluation. Kill -9 + resume continuing exactly is test_grpo_multihost.py's (two
processes, the harder restore), which also checks that a step's row precedes its checkpoint."""

import json
import os
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The tiny preset (toy model, random init, a generated toy world) on a (2,2,2) mesh, 3 steps.
OVERRIDES = {"total_steps": 3, "mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2, "checkpoint.every_steps": 2,
             "eval.every": 2, "eval.limit": 4, "trajectories_every": 3}


def _config():
    from configs import grpo

    c = grpo.get_config("tiny")
    for k, v in OVERRIDES.items():
        node, _, leaf = k.rpartition(".")
        (c[node] if node else c)[leaf] = v
    return c


def _rows(workdir):
    out = {}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if "accuracy" in row:
                out[row["step"]] = row
    return out


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("the sandbox needs Linux and root")
    import jax

    assert jax.device_count() == 8
    from codedance_jax.runs.grpo import train_and_evaluate

    workdir = str(tmp_path_factory.mktemp("grpo_ref"))
    out = train_and_evaluate(_config(), workdir)
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
    # Shapes are bucketed: after step 1 only buckets not seen yet compile (a random policy's lengths vary).
    assert rows[3]["compilations"] < rows[1]["compilations"] / 4
    evals = [json.loads(x) for x in open(os.path.join(workdir, "eval.jsonl"))]
    assert [e["step"] for e in evals] == [2, 3] and all(e["eval/n"] == 4 for e in evals)
    assert os.path.exists(os.path.join(workdir, "policy", "codedance.json"))


def test_trajectory_records_reproduce_with_their_policy(reference_run):
    """SPEC section 2: one full forward of `policy` over `tokens` gives `logprobs` on sampled tokens."""
    import codedance_jax
    from codedance_jax.rollout import load_jsonl

    workdir, _ = reference_run
    trajs = load_jsonl(os.path.join(workdir, "trajectories.jsonl"))
    assert len(trajs) == 16 and all(t.policy and t.rewards for t in trajs)
    model, processor = codedance_jax.from_pretrained(trajs[0].policy)
    sys.path.insert(0, os.path.join(REPO, "tests", "rollout"))
    from rollout_helpers import full_logprobs

    ref = full_logprobs(model, processor, trajs[:8], length=512)
    for t, lp in zip(trajs[:8], ref, strict=True):
        m = np.asarray(t.loss_mask, bool)
        assert m.sum() > 0
        np.testing.assert_allclose(np.asarray(t.logprobs)[m], lp[m], atol=2e-4)
