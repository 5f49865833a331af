"""`launch.ablate --variants`: the flag parses, and each recipe variant's overrides reach the GRPO
run config and the library configs built from it (no training)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from launch_env import REPO, launcher_env

from configs import demo as demo_configs
from runs import grpo as grpo_run
from runs.demo import pipeline, variants


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


@pytest.mark.parametrize("name", sorted(variants.VARIANTS))
def test_each_variant_changes_exactly_its_fields(name, tmp_path):
    c = demo_configs.get_config("mini")
    policy = str(tmp_path / "sft" / "policy")
    base = _flat(pipeline.grpo_config(c, str(tmp_path), policy).to_dict())
    row = variants.rows([name])[0]
    g = pipeline.ablation_config(c, str(tmp_path), policy, row, seed=3)
    got = _flat(g.to_dict())
    overrides = variants.VARIANTS[name].overrides
    changed = {k for k in got if got[k] != base[k]}
    assert changed <= set(overrides) | {"seed"} and got["seed"] == 3
    for path, value in overrides.items():
        want = value(g) if callable(value) else value
        assert got[path] == want, path
    assert changed - {"seed"}  # every variant changes something in the demo's GRPO run
    budget = int(g.rollout.max_new_tokens)
    # The run's own translation accepts it, and the library configs carry the switch.
    rb, loss = grpo_run.rbat_config(g.rbat, max_new_tokens=budget), grpo_run.loss_config(g.loss, max_new_tokens=budget)
    fc = grpo_run.filter_config(g)
    library = {"rbat.seq_norm": rb.seq_norm, "rbat.turn_stats": rb.turn_stats, "rbat.turn_baseline": rb.turn_baseline,
               "rbat.mastered": rb.mastered,
               "rbat.overlong_cache": rb.overlong_cache, "loss.aggregation": loss.aggregation, "loss.ratio": loss.ratio,
               "loss.clip_eps_low": loss.eps_low, "loss.clip_eps_high": loss.eps_high, "loss.kl_coef": loss.kl_coef,
               "filter.groups": fc["groups"], "filter.mask_truncated": fc["mask_truncated"],
               "data.filter_pass": fc["filter_pass"], "data.filter_samples": fc["filter_samples"],
               "optim.warmup_ratio": g.optim.warmup_ratio}
    for path in overrides:
        assert library[path] == got[path], path


def test_rows_follow_the_modes_and_unknown_names_are_refused():
    rows = pipeline.ablation_rows(("full",), (), ("drgrpo", "gspo"))
    assert [r.key for r in rows] == ["full", "drgrpo", "gspo"]
    assert rows[1].label.startswith("Dr. GRPO") and rows[1].mode is None
    with pytest.raises(ValueError, match="unknown recipe variants.*dapoo"):
        variants.rows(["dapoo"])
    assert not set(variants.VARIANTS) & {"outcome", "tool_bonus", "no_turn", "full"}  # run folders stay apart


def _ablate(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "launch.ablate", f"--workdir={tmp_path}/wd", "--config=configs/demo.py:mini",
                           "--dry_run", *args], cwd=REPO, env=launcher_env(), capture_output=True, text=True, timeout=300)


def test_the_flag_parses_into_one_run_per_variant(tmp_path):
    out = _ablate(tmp_path, "--variants=drgrpo,dapo,gspo,mask_truncated,turn_loo")
    assert out.returncode == 0, out.stderr[-2000:]
    plan = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [p["run"] for p in plan] == ["drgrpo", "dapo", "gspo", "mask_truncated", "turn_loo"]  # no mode rows
    assert plan[2]["changes"] == {"loss.ratio": "sequence", "loss.clip_eps_low": 3e-4, "loss.clip_eps_high": 4e-4}
    assert not os.path.exists(tmp_path / "wd")  # a dry run writes nothing
    out = _ablate(tmp_path, "--modes=full", "--variants=turn_all", "--seeds=0,1")
    assert [json.loads(x)["run"] for x in out.stdout.splitlines() if x.startswith("{")] == [
        "full/seed0", "turn_all/seed0", "full/seed1", "turn_all/seed1"]
    out = _ablate(tmp_path, "--variants=dapo,drgrpoo")
    assert out.returncode == 2 and "--variants" in out.stderr and "drgrpoo" in out.stderr
    # Every recipe variant is a row of --modes too, mixed with the reward variants.
    names = ",".join(variants.VARIANTS)
    out = _ablate(tmp_path, f"--modes=outcome,{names}")
    assert out.returncode == 0, out.stderr[-2000:]
    assert [json.loads(x)["run"] for x in out.stdout.splitlines() if x.startswith("{")] == ["outcome", *variants.VARIANTS]
    out = _ablate(tmp_path, "--modes=full,gspoo")
    assert out.returncode == 2 and "--modes" in out.stderr and "gspoo" in out.stderr


def test_worlds_flag_plans_each_world_and_the_table_pools_them(tmp_path):
    """--worlds: one workdir per world seed, its runs planned there; the combined table's rows hold
    every world's runs (mean ± std over world x GRPO seeds)."""
    from runs.demo import table3
    from runs.demo.pipeline import world_config, world_entries

    c = world_config(demo_configs.get_config("mini"), 1)  # the seed reaches every run the world feeds
    assert (c.seed, c.world.seed, c.sft.seed, c.grpo.seed, c.eval.seed) == (1, 1, 1, 1, 1)

    out = _ablate(tmp_path, "--worlds=0,1", "--modes=outcome,full", "--seeds=0,1")
    assert out.returncode == 0, out.stderr[-2000:]
    plan = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    assert [(p["world"], p["run"]) for p in plan] == [
        (w, f"{m}/seed{s}") for w in (0, 1) for s in (0, 1) for m in ("outcome", "full")]
    out = _ablate(tmp_path, "--worlds=0,x")
    assert out.returncode == 2 and "--worlds" in out.stderr
    rng = np.random.default_rng()
    acc = rng.uniform(0.5, 1.0, size=(2, 3))  # world x run (SFT, two GRPO seeds)

    def world(w):
        return {"rows": [["SFT cold start", ["sft"]], ["R_BAT (full)", ["full/seed0", "full/seed1"]]],
                "sft": {"accuracy": acc[w, 0]}, "full/seed0": {"accuracy": acc[w, 1]},
                "full/seed1": {"accuracy": acc[w, 2]}}

    entries = world_entries([world(0), world(1)])
    assert [label for label, _ in entries] == ["SFT cold start", "R_BAT (full)"]
    agg = table3.aggregate(entries[1][1])["accuracy"]
    assert agg["n"] == 4 and agg["mean"] == pytest.approx(acc[:, 1:].mean())
    assert agg["std"] == pytest.approx(acc[:, 1:].std(ddof=1))
    assert table3.aggregate(entries[0][1])["accuracy"]["n"] == 2
