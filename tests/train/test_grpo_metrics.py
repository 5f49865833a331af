"""The GRPO metrics row, built from the stages' typed results alone (no model, no sandbox)."""

import numpy as np
import pytest

from codedance_jax.model.config import ModelConfig
from codedance_jax.rollout import RolloutStats, Trajectory
from codedance_jax.train import flops
from runs.grpo_metrics import metrics_row
from runs.grpo_stages import GRPOBatch, Rollouts, Scores, StepPrompts, Update


def _traj(rng, i, statuses):
    n = int(rng.integers(5, 20))
    return Trajectory(id=f"t{i}", prompt_id=f"p{i // 4}", group=i % 4, prompt_len=3, tokens=list(range(n)),
                      loss_mask=[0] * n, turn_ids=[-1] * n, logprobs=[0.0] * n, temperature=1.0, images=[],
                      image_grid_thw=[], turn_status=statuses, turns=[{"status": s} for s in statuses])


def test_metrics_row_from_stage_results():
    rng = np.random.default_rng()
    g, n_prompts, m_turns = 4, 2, 3
    b = g * n_prompts
    choices = [["no_code"], ["ok", "no_code"], ["error", "ok", "no_code"], ["timeout", "no_code"]]
    statuses = [choices[int(k)] for k in rng.integers(0, len(choices), b)]
    statuses[int(rng.integers(b))] = choices[int(rng.integers(1, len(choices)))]  # >= 1 executed cell
    trajs = [_traj(rng, i, s) for i, s in enumerate(statuses)]
    acc = rng.integers(0, 2, b).astype(np.float32)
    acc[:g] = [1, 1, 1, 1]  # group 0: all correct (not mixed)
    acc[g:] = [0, 1, 0, 0]  # group 1: mixed
    a_turn = rng.normal(size=(b, m_turns)).astype(np.float32) * (rng.random((b, m_turns)) < 0.5)
    parts = {k: rng.normal(size=b).astype(np.float32) for k in ("r_acc", "r_format", "r_seq", "total")}
    sc = Scores(acc, rng.random(b) < 0.7, rng.normal(size=b).astype(np.float32), a_turn, parts, time_s=0.25)
    metas = [{"difficulty": "easy" if i < g else "hard"} for i in range(b)]
    sp = StepPrompts([], ["1"] * b, ["q"] * b, metas)
    stats = RolloutStats(wall_s=2.0, decode_s=1.0, generated_tokens=int(rng.integers(100, 1000)), device_wait_s=0.5,
                         sandbox_busy_s=1.5)
    ro = Rollouts(trajs, stats, None, time_s=2.0)
    t = 32
    loss_mask = (rng.random((b, t)) < 0.4).astype(np.float32)
    unit_src = np.where(rng.random((b, 8)) < 0.5, 1, -1).astype(np.int32)
    local = {"loss_mask": loss_mask, "input_ids": np.zeros((b, t), np.int32), "unit_src": unit_src}
    batch = GRPOBatch(local, {}, {}, (), time_s=0.125, logprob_mismatch=1e-5, logprob_s=0.0625)
    up = Update(None, {"loss": 0.5, "pg_loss": 0.25}, time_s=0.5)
    cfg = ModelConfig.tiny()

    row = metrics_row(sp, ro, sc, batch, up, cfg=cfg, group_size=g, keys=("difficulty",), peak_flops=1e12,
                      hosts=1, devices=8, local_devices=8)

    assert row["accuracy"] == pytest.approx(acc.mean())
    assert row["groups_mixed"] == 0.5
    executed = [s for st in statuses for s in st if s != "no_code"]
    assert row["exec_success"] == pytest.approx(np.mean([s == "ok" for s in executed]))
    assert row["tool_rate"] == pytest.approx(np.mean([len(s) > 1 for s in statuses]))
    assert row["difficulty=hard/accuracy"] == pytest.approx(acc[g:].mean())
    for k, v in parts.items():
        assert row[f"reward/{k}"] == pytest.approx(v.mean())
    assert row["a_seq_abs"] == pytest.approx(np.abs(sc.a_seq).mean())
    assert row["a_turn_abs"] == pytest.approx(np.abs(a_turn).sum() / max(1, (a_turn != 0).sum()))
    assert row["format_ok"] == pytest.approx(sc.fmt_ok.mean())
    assert row["train/pg_loss"] == 0.25 and row["logprob_mismatch"] == 1e-5
    assert row["time/scoring_s"] == 0.25 and row["time/batch_s"] == 0.125 and row["time/logprob_s"] == 0.0625
    assert row["gen_tokens_per_s_per_device"] == pytest.approx(stats.generated_tokens / 2.0 / 8)
    assert row["trained_tokens_per_s_per_device"] == pytest.approx(loss_mask.sum() / 0.5 / 8)
    fl = flops.train_flops(cfg, float(loss_mask.sum()), t, float((unit_src >= 0).sum() * cfg.vision.merge_unit))
    assert row["update_mfu"] == pytest.approx(fl / 0.5 / 1e12)
    assert row["sandbox_idle_frac"] == pytest.approx(0.25) and row["device_idle_frac"] == pytest.approx(0.25)
    assert row["tokens_per_traj"] == pytest.approx(np.mean([len(x.tokens) for x in trajs]))
    assert "n" not in row


def test_rbat_block_picks_the_named_preset_and_refuses_an_unknown_one():
    from codedance_jax.errors import ConfigError
    from codedance_jax.rl import RBATConfig
    from configs import grpo as grpo_configs
    from runs.grpo import rbat_config

    c = grpo_configs.get_config("tiny").rbat
    for name, build in (("paper", RBATConfig.paper), ("release", RBATConfig.release)):
        c.preset = name
        assert rbat_config(c) == build(mode=c.mode, gamma=float(c.gamma), delta=float(c.delta), beta=float(c.beta))
    c.preset = "relase"
    with pytest.raises(ConfigError, match=r"config.rbat.preset='relase'.*paper.*release"):
        rbat_config(c)
