"""The metrics row of one GRPO step (metrics.jsonl / TensorBoard), built from the stages' results.

Names (WORKSPACE.md, GRPO): the rollout summary (`accuracy avg_turns exec_success tool_calls
tool_rate`, per `metric_keys` value), `reward/*` (R_BAT parts over the global batch), `a_seq_abs
a_turn_abs groups_mixed format_ok`, `filter/*` (only with `config.filter` on), `train/*`,
`logprob_mismatch`, `time/*_s`, throughput and MFU.
`compilations`, `step_time_s`, `time/trajectories_s` (trajectories and the policy's host copy; the
policy is written from a thread) and `time/checkpoint_s` are added by the loop; the row is written before
the step's checkpoint, so `time/checkpoint_s` is the save after the previous step (0 after a start).
With several processes `accuracy reward/* a_seq_abs a_turn_abs groups_mixed format_ok train/*` are
over the global batch; the other rollout figures are process 0's share.
"""

from __future__ import annotations

import jax
import numpy as np

from codedance_jax.model.config import ModelConfig
from codedance_jax.rl import scoring
from codedance_jax.train import flops
from runs.grpo_stages import GRPOBatch, Rollouts, Scores, StepPrompts, Update


def metrics_row(sp: StepPrompts, ro: Rollouts, sc: Scores, b: GRPOBatch, up: Update, *, cfg: ModelConfig,
                group_size: int, keys=(), peak_flops: float, hosts: int | None = None,
                devices: int | None = None, local_devices: int | None = None) -> dict[str, float]:
    """One step's metrics. `peak_flops`: the whole mesh's peak (MFU's denominator); `hosts`,
    `devices`, `local_devices` default to this JAX runtime's."""
    hosts = jax.process_count() if hosts is None else hosts
    devices = jax.device_count() if devices is None else devices
    local_devices = jax.local_device_count() if local_devices is None else local_devices
    trajs, rstats, local = ro.trajectories, ro.stats, b.local
    summ = scoring.summarize(trajs, sc.acc, sp.metas, keys)
    gen_tok = float(rstats.generated_tokens)
    trained_tok = float(local["loss_mask"].sum())
    seq = int(local["input_ids"].shape[1])
    patches = float((local["unit_src"] >= 0).sum() * cfg.vision.merge_unit)
    fl = flops.train_flops(cfg, trained_tok * hosts, seq, patches * hosts)
    # Advantages, accuracy and format over the global batch (all hosts' rows): a multi-host run logs
    # what a one-process run on the same prompts logs. The rollout summary is this host's trajectories.
    g = sc.glob or {"acc": sc.acc, "fmt_ok": sc.fmt_ok, "a_seq": sc.a_seq, "a_turn": sc.a_turn}
    groups = np.asarray(g["acc"]).reshape(-1, group_size)
    return {
        **{k: v for k, v in summ.items() if k != "n"},
        **{f"reward/{k}": float(np.mean(v)) for k, v in sc.parts.items()},
        "accuracy": float(np.mean(g["acc"])),
        "a_seq_abs": float(np.mean(np.abs(g["a_seq"]))),
        "a_turn_abs": float(np.abs(g["a_turn"]).sum() / max(1, (g["a_turn"] != 0).sum())),
        "groups_mixed": float(np.mean(groups.min(axis=1) != groups.max(axis=1))),
        "format_ok": float(np.mean(g["fmt_ok"])),
        **{f"train/{k}": v for k, v in up.metrics.items()},
        **sc.counts,  # filter/* (config.filter): groups dropped, trajectories masked, trajectories trained
        "logprob_mismatch": b.logprob_mismatch if up.logprob_mismatch is None else up.logprob_mismatch,
        "time/rollout_s": ro.time_s, "time/decode_s": rstats.decode_s, "time/prefill_s": rstats.prefill_s,
        "time/append_s": rstats.append_s, "time/vision_s": rstats.vision_s,
        "time/sandbox_wait_s": rstats.device_wait_s, "time/scoring_s": sc.time_s, "time/batch_s": b.time_s,
        "time/logprob_s": b.logprob_s, "time/update_s": up.time_s,
        "gen_tokens_per_s_per_device": gen_tok / max(ro.time_s, 1e-9) / local_devices,
        "trained_tokens_per_s_per_device": trained_tok * hosts / max(up.time_s, 1e-9) / devices,
        "update_mfu": fl / max(up.time_s, 1e-9) / peak_flops,
        "sandbox_idle_frac": rstats.sandbox_idle_frac,
        "device_idle_frac": rstats.device_idle_frac,
        "tokens_per_traj": float(np.mean([len(t.tokens) for t in trajs])),
    }
