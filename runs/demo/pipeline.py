"""The demo pipeline: toy world -> SFT -> eval (before) -> GRPO with R_BAT -> eval (after) -> report.

Every phase is the real component a user would launch on a pod, with the toy world's sizes:
`data.toyworld.generate_world` (expert trajectories executed in the sandbox), `runs.sft`
(TFDS + grain + the sharded SFT step; it exports WORKDIR/sft/policy), evaluation = multi-turn
rollouts of the held-out split through `RolloutEngine` + `SandboxPool`, greedy and sampled (the
GRPO rollouts' temperature, `eval.samples` draws per item; 0 turns the sampled one off), with 95%
intervals on every rate (`eval.intervals`), `runs.grpo` (rollouts, R_BAT, GRPO update; exports
WORKDIR/grpo/policy), and `demo.report`.

Workdir layout: world/ (world.json, sft/, rl/, eval/, processor/), sft/ (checkpoints, metrics.jsonl,
policy/), eval_sft/, eval_grpo/, eval_sft_sampled/, eval_grpo_sampled/ (trajectories.jsonl +
images/, summary.json), grpo/ (checkpoints, metrics.jsonl, trajectories.jsonl, policy/), report/
(report.md, report.html, summary.json, plots/). A phase whose
output exists is skipped, so a killed demo continues where it stopped (SFT and GRPO resume from
their checkpoints).

Sizes are data: `configs/demo.py` builds the complete SFT, GRPO and evaluation run configs; this
module fills in paths only (the world's files, the policy a phase starts from).
"""

from __future__ import annotations

import copy
import json
import os
import time

import ml_collections

from runs.demo import table3, variants


def _log(msg: str):
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def world_dir(workdir: str) -> str:
    return os.path.join(workdir, "world")


def make_world(c, workdir: str) -> dict:
    from data.toyworld import generate_world

    path = os.path.join(world_dir(workdir), "world.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return generate_world(world_dir(workdir), **c.world)


def sft_config(c, workdir: str) -> ml_collections.ConfigDict:
    """configs/demo.py's SFT run with the world's paths filled in."""
    s = ml_collections.ConfigDict(c.sft.to_dict())
    s.processor_dir = os.path.join(world_dir(workdir), "processor")
    s.data.jsonl = (os.path.join(world_dir(workdir), "sft", "sft.jsonl"),)
    return s


def grpo_config(c, workdir: str, policy: str, *, mode: str | None = None) -> ml_collections.ConfigDict:
    """configs/demo.py's GRPO run from `policy`, on the world's RL prompts (`mode`: an ablation's reward)."""
    g = ml_collections.ConfigDict(c.grpo.to_dict())
    g.init_from = policy
    g.data.jsonl = (os.path.join(world_dir(workdir), "rl", "prompts.jsonl"),)
    if mode is not None:
        g.rbat.mode = mode
    return g


def eval_phases(c, name: str) -> list[tuple[str, bool]]:
    """The evaluations of phase `name`: (eval name, sampled), greedy first (`{name}_sampled` when
    `eval.samples` > 0)."""
    return [(name, False)] + ([(f"{name}_sampled", True)] if c.eval.samples > 0 else [])


def evaluate_policy(c, workdir: str, policy: str, out_dir: str, pool, *, sampled: bool = False,
                    split: str | None = None, file: str = "prompts.jsonl") -> dict:
    """Rollouts of a held-out split (`split`, default `eval.split`: "eval" = test, "val" = validation), greedy (one per item) or sampled (`eval.samples` per item at
    `eval.temperature`); writes trajectories.jsonl (+ `text`, `meta`) and summary.json (the rates'
    95% intervals included)."""
    import codedance_jax
    from codedance_jax.rollout import RolloutConfig, RolloutEngine, SamplingConfig, save_jsonl
    from codedance_jax.rollout.placement import sampling_model
    from data.rl_prompts import read_prompts_jsonl
    from eval.rollouts import evaluate
    from runs import setup
    from runs.grpo import rollout_mesh

    summary_path = os.path.join(out_dir, "summary.json")
    if os.path.exists(summary_path):
        with open(summary_path) as f:
            return json.load(f)
    e = c.eval
    prompts = read_prompts_jsonl(os.path.join(world_dir(workdir), split or e.split, file))
    if e.limit:
        prompts = prompts[: e.limit]
    model, processor = codedance_jax.from_pretrained(policy)
    # On the host's sampling mesh, placed as the GRPO run places its policy: the evaluations and the
    # GRPO rollouts then share their compiled programs (the GRPO warm-up finds them compiled).
    mesh = rollout_mesh(c.grpo)
    model = sampling_model(model, mesh, setup.sharding_rules(c.grpo))
    rcfg = RolloutConfig.eval(**e.rollout, policy=policy)
    if sampled:
        sampling = SamplingConfig(temperature=e.temperature, top_p=e.top_p, top_k=e.top_k, seed=e.seed)
        samples, batch = int(e.samples), max(1, int(e.batch_size) // int(e.samples))  # rows per batch as greedy
    else:
        sampling, samples, batch = SamplingConfig(greedy=True, seed=e.seed), 1, e.batch_size
    engine = RolloutEngine(model, processor, rcfg, sampling, mesh=mesh)
    t0 = time.perf_counter()
    res = evaluate(engine, prompts, pool, batch=batch, keys=tuple(e.metric_keys), samples=samples, intervals=True,
                   warm_up=True)
    summary, trajs = res.summary, res.trajectories
    summary["time_s"] = time.perf_counter() - t0
    os.makedirs(out_dir, exist_ok=True)
    path = save_jsonl(trajs, out_dir)
    by_id = {q.id: q for q in prompts}
    lines = []
    with open(path) as f:
        for line, t in zip(f, trajs, strict=True):
            rec = json.loads(line)
            q = by_id[t.prompt_id]
            rec["text"] = t.response_text(processor)
            rec["meta"] = {**q.meta, "question": q.question, "gold": q.answer}
            lines.append(json.dumps(rec))
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(summary_path, "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def _evaluate_phase(c, workdir: str, name: str, policy: str, pool, timings: dict, split: str | None = None,
                    probes: bool = True) -> dict:
    """Every evaluation of phase `name` (greedy, then sampled), timed into `timings[eval_{name}...]`;
    on `split` (default `eval.split`), written to WORKDIR/eval_{name}, or WORKDIR/val_{name} when the
    split is the validation split and `eval.split` is not."""
    out = {}
    prefix = "val" if split == "val" and c.eval.split != "val" else "eval"
    for ev_name, sampled in eval_phases(c, name):
        t0 = time.perf_counter()
        out[ev_name] = s = evaluate_policy(c, workdir, policy, os.path.join(workdir, f"{prefix}_{ev_name}"), pool,
                                           sampled=sampled, split=split)
        lo, hi = s.get("accuracy_ci95") or (float("nan"), float("nan"))
        _log(f"    {ev_name}: accuracy {s['accuracy']:.3f} [{lo:.3f}, {hi:.3f}], tool-call rate {s['tool_rate']:.3f}")
        timings[f"{prefix}_{ev_name}"] = time.perf_counter() - t0
    found = evaluate_probes(c, workdir, policy, os.path.join(workdir, f"{prefix}_{name}_probes"), pool, split) \
        if probes else None
    if found is not None:
        out[f"{name}_probes"] = found
    return out


def probes_path(c, workdir: str, split: str | None = None) -> str:
    return os.path.join(world_dir(workdir), split or c.eval.split, "probes.jsonl")


def evaluate_probes(c, workdir: str, policy: str, out_dir: str, pool, split: str | None = None) -> dict | None:
    """Greedy rollouts of the split's probes (world/{split}/probes.jsonl, if the world has them), with
    accuracy per probe (`probe=...` keys); None without probes."""
    if not os.path.exists(probes_path(c, workdir, split)):
        return None
    t0 = time.perf_counter()
    e = ml_collections.ConfigDict(c.to_dict())
    e.eval.metric_keys = ("probe",)
    s = evaluate_policy(e, workdir, policy, out_dir, pool, split=split, file="probes.jsonl")
    _log("    probes: " + ", ".join(f"{k.split('/')[0][len('probe='):]} {v:.3f}" for k, v in sorted(s.items())
                                   if k.startswith("probe=") and k.endswith("/accuracy"))
         + f" ({time.perf_counter() - t0:.0f} s)")
    return s


def _pool(c):
    """The evaluation's sandbox pool, in its own long-lived thread (`with _pool(c) as pool:`)."""
    from sandbox import PoolThread

    return PoolThread(**c.eval.sandbox)


def _read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


STOPS = ("world", "sft", "sft_eval")


def calibration_prefix(c) -> str:
    """Where the SFT policy's validation evaluations are: WORKDIR/eval_* when `eval.split` is "val",
    else WORKDIR/val_* (the world has a validation split) or, for a world without one, eval_*."""
    return "val" if c.eval.split != "val" and c.world.get("n_val", 0) > 0 else "eval"


def write_calibration(c, workdir: str) -> dict | None:
    """The SFT policy per cell, greedy beside sampled (`eval.calibration`), on the validation split
    (`calibration_prefix`), to WORKDIR/calibration.{md,json}; None without a sampled evaluation."""
    from eval import calibration

    if c.eval.samples <= 0:
        return None
    pre = calibration_prefix(c)
    recs = {n: _read_jsonl(os.path.join(workdir, f"{pre}_{n}", "trajectories.jsonl")) for n in ("sft", "sft_sampled")}
    table = calibration.cells(recs["sft"], recs["sft_sampled"])
    md = calibration.markdown(table)
    with open(os.path.join(workdir, "calibration.md"), "w") as f:
        split = "validation" if pre == "val" or c.eval.split == "val" else "held-out (test)"
        f.write(f"# The SFT policy per cell on the {split} split: what RL can fix\n\n" + md)
    with open(os.path.join(workdir, "calibration.json"), "w") as f:
        json.dump({"cells": table, "learnable": [k for k, r in table.items() if calibration.learnable(r)]}, f,
                  indent=2)
    print(md, flush=True)
    return table


def run(c, workdir: str, stop_after: str | None = None) -> dict:
    """Runs every phase (skipping finished ones) and returns the report's summary.

    stop_after: "world", "sft" or "sft_eval" ends there (a world's calibration: world, SFT and the SFT
    policy's evaluations with WORKDIR/calibration.md) and returns the evaluations' summaries."""
    if stop_after is not None and stop_after not in STOPS:
        raise ValueError(f"stop_after={stop_after!r}: one of {STOPS}")
    from runs import grpo as grpo_run
    from runs import sft as sft_run
    from runs.demo.report import write_report

    workdir = os.path.abspath(workdir)
    # Config errors before any work (nothing written yet): the reward and loss of the GRPO phase.
    budget = int(c.grpo.rollout.max_new_tokens)
    grpo_run.rbat_config(c.grpo.rbat, max_new_tokens=budget), grpo_run.loss_config(c.grpo.loss, max_new_tokens=budget)
    os.makedirs(workdir, exist_ok=True)
    c = ml_collections.ConfigDict(c.to_dict())
    timings = {}
    t_all = time.perf_counter()

    t0 = time.perf_counter()
    _log("1/5 toy world: generating tasks and running the expert's code in the sandbox")
    world = make_world(c, workdir)
    timings["world"] = time.perf_counter() - t0
    if stop_after == "world":
        return {"world": world}

    t0 = time.perf_counter()
    sft_dir = os.path.join(workdir, "sft")
    sft_policy = os.path.join(sft_dir, "policy")
    if not os.path.exists(os.path.join(sft_policy, "codedance.json")):
        _log(f"2/5 SFT: {c.sft.total_steps} steps, batch {c.sft.batch_size}, from random init")
        sft_run.train_and_evaluate(sft_config(c, workdir), sft_dir)
    timings["sft"] = time.perf_counter() - t0
    if stop_after == "sft":
        return {"world": world}

    evals = {}
    with _pool(c) as pool:
        _log(f"3/5 evaluating the SFT policy on the {'validation' if c.eval.split == 'val' else 'test'} split")
        evals.update(_evaluate_phase(c, workdir, "sft", sft_policy, pool, timings))
        if calibration_prefix(c) == "val":  # the calibration table reads the validation split only
            cv = ml_collections.ConfigDict(c.to_dict())
            cv.eval.limit = int(c.eval.get("calibration_items", 0) or 0)  # the grid cycles its cells: balanced
            _log(f"    and on the validation split ({cv.eval.limit or 'all'} items: the calibration table)")
            _evaluate_phase(cv, workdir, "sft", sft_policy, pool, timings, split="val", probes=False)
    write_calibration(c, workdir)
    if stop_after == "sft_eval":
        return {"world": world, **evals}

    t0 = time.perf_counter()
    grpo_dir = os.path.join(workdir, "grpo")
    grpo_policy = os.path.join(grpo_dir, "policy")
    if not os.path.exists(os.path.join(grpo_policy, "codedance.json")):
        _log(f"4/5 GRPO with R_BAT ({c.grpo.rbat.mode}): {c.grpo.total_steps} steps x {c.grpo.prompts_per_step} prompts "
             f"x {c.grpo.group_size} rollouts")
        grpo_run.train_and_evaluate(grpo_config(c, workdir, sft_policy), grpo_dir)
    timings["grpo"] = time.perf_counter() - t0

    with _pool(c) as pool:
        _log("5/5 evaluating the GRPO policy and writing the report")
        evals.update(_evaluate_phase(c, workdir, "grpo", grpo_policy, pool, timings))

    total = time.perf_counter() - t_all  # the report adds the phases up itself
    _log(f"all phases: {total:.0f} s")
    paths = write_report(
        os.path.join(workdir, "report"),
        evals=evals,
        eval_trajectories={n: os.path.join(workdir, f"eval_{n}", "trajectories.jsonl") for n in evals},
        sft_data=os.path.join(world_dir(workdir), "sft", "sft.jsonl"),
        grpo_trajectories=os.path.join(grpo_dir, "trajectories.jsonl"),
        prompt_metas=os.path.join(world_dir(workdir), "rl", "prompts.jsonl"),
        sft_metrics=_read_jsonl(os.path.join(sft_dir, "metrics.jsonl")),
        grpo_metrics=_read_jsonl(os.path.join(grpo_dir, "metrics.jsonl")),
        world=world, timings=timings, targets=dict(c.targets), examples_per_group=c.examples_per_group,
        effect_targets=dict(c.effect_targets), drift=grpo_drift(c, workdir, sft_policy, grpo_dir),
    )
    with open(paths["summary.json"]) as f:
        summary = json.load(f)
    with open(paths["report.md"]) as f:
        print(f.read(), flush=True)
    _log(f"report: {paths['report.html']}")
    return summary


def grpo_drift(c, workdir: str, reference: str, run_dir: str) -> list[dict]:
    """`eval.drift.policy_drift` of a GRPO run's saved rollouts (`trajectories.jsonl`) against the
    `reference` policy (the SFT one), per saved step; cached in RUN_DIR/drift.json."""
    out = os.path.join(run_dir, "drift.json")
    if os.path.exists(out):
        with open(out) as f:
            return json.load(f)
    path = os.path.join(run_dir, "trajectories.jsonl")
    if not os.path.exists(path):
        return []
    import codedance_jax
    from codedance_jax.rollout import load_jsonl
    from eval.drift import policy_drift
    from eval.tool_analytics import record_step

    model, processor = codedance_jax.from_pretrained(reference)
    rows = policy_drift(load_jsonl(path), model, processor, step_of=record_step,
                        temperature=float(c.grpo.rollout.temperature))
    with open(out, "w") as f:
        json.dump(rows, f, indent=2)
    return rows


def prepare_sft(c, workdir: str) -> tuple[dict, str]:
    """World and SFT policy (reused when they exist), as the demo makes them."""
    from runs import sft as sft_run

    world = make_world(c, workdir)
    sft_dir = os.path.join(workdir, "sft")
    policy = os.path.join(sft_dir, "policy")
    if not os.path.exists(os.path.join(policy, "codedance.json")):
        _log(f"SFT: {c.sft.total_steps} steps, batch {c.sft.batch_size}, from random init")
        sft_run.train_and_evaluate(sft_config(c, workdir), sft_dir)
    return world, policy


def ablation_rows(modes=tuple(table3.MODE_NAMES), presets=(), recipe_variants=()) -> list:
    """The ablation's rows: one per reward mode (`table3.rows`), then one per recipe variant
    (`runs.demo.variants`)."""
    return table3.rows(modes, presets) + variants.rows(recipe_variants)


def ablation_config(c, workdir: str, sft_policy: str, row, seed: int | None) -> ml_collections.ConfigDict:
    """The GRPO run config of one ablation row (a `table3.Row` or a `variants.VariantRow`) and seed."""
    g = grpo_config(c, workdir, sft_policy, mode=row.mode)
    if row.preset is not None:
        g.rbat.preset = row.preset
    if isinstance(row, variants.VariantRow):
        variants.apply(g, row.variant)
    if seed is not None:
        g.seed = seed
    return g


def check_ablation(c, workdir: str, rows, seeds) -> None:
    """Config errors of every run before any work: each row's reward, loss and filter blocks."""
    from runs import grpo as grpo_run

    for seed in seeds:
        for row in rows:
            g = ablation_config(c, workdir, os.path.join(workdir, "sft", "policy"), row, seed)
            budget = int(g.rollout.max_new_tokens)
            grpo_run.rbat_config(g.rbat, max_new_tokens=budget), grpo_run.loss_config(g.loss, max_new_tokens=budget)
            grpo_run.filter_config(g)


def ablation_plan(c, workdir: str, modes=tuple(table3.MODE_NAMES), *, seeds=(), presets=(), recipe_variants=()) -> list:
    """What `ablate` would train, without training: per run its name, row label and the GRPO config
    fields that differ from the ablation's GRPO config as given (`c.grpo`, with any command-line
    overrides; paths aside)."""
    workdir = os.path.abspath(workdir)
    sft_policy = os.path.join(workdir, "sft", "policy")
    check_ablation(c, workdir, ablation_rows(modes, presets, recipe_variants), seeds or (None,))
    base = _flat(grpo_config(c, workdir, sft_policy).to_dict())
    plan = []
    for seed in seeds or (None,):
        for row in ablation_rows(modes, presets, recipe_variants):
            g = _flat(ablation_config(c, workdir, sft_policy, row, seed).to_dict())
            plan.append({"run": table3.run_name(row, seed), "label": row.label,
                         "changes": {k: v for k, v in g.items() if base.get(k) != v}})
    return plan


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
    return out


def ablate(c, workdir: str, modes=tuple(table3.MODE_NAMES), *, seeds=(), presets=(), recipe_variants=()) -> dict:
    """Table 3 on the toy world: the reward variants trained from the same SFT policy with the same
    steps, each evaluated on the held-out split, greedy and (with `eval.samples` > 0) sampled.

    seeds: GRPO seeds (prompt order and sampling keys); each row trains once per seed and the table
    gives mean ± std over them. Empty: one run at the config's seed (`ablate/{mode}`).
    presets: R_BAT presets for the R_BAT rows (`paper`, `release`), one row each; empty: the config's.
    recipe_variants: names in `runs.demo.variants.VARIANTS` (Dr. GRPO, DAPO, GSPO, masking, R_turn
    baselines, ...), one row each after the modes' rows, on the config's R_BAT mode (`ablate/{name}`).
    Returns the evaluation summaries by name: `sft`, `sft_sampled`, then per run `{row}[/seed{s}]`
    and `{row}[/seed{s}]_sampled`; with seeds also `table` (per row label: mean, std, n per column)
    and `seconds` (wall time of each row's runs, training and evaluation)."""
    from runs import grpo as grpo_run

    workdir = os.path.abspath(workdir)
    c = ml_collections.ConfigDict(c.to_dict())
    table_rows, seed_list = ablation_rows(modes, presets, recipe_variants), (seeds or (None,))
    check_ablation(c, workdir, table_rows, seed_list)
    _, sft_policy = prepare_sft(c, workdir)
    results, seconds = {}, {}
    with _pool(c) as pool:
        for name, sampled in eval_phases(c, "sft"):
            results[name] = evaluate_policy(c, workdir, sft_policy, os.path.join(workdir, f"eval_{name}"), pool,
                                            sampled=sampled)
        probes = evaluate_probes(c, workdir, sft_policy, os.path.join(workdir, "eval_sft_probes"), pool)
        if probes is not None:
            results["sft_probes"] = probes
    for seed in seed_list:  # seed by seed: a stopped ablation has whole tables for its first seeds
        for row in table_rows:
            t0 = time.perf_counter()
            run = table3.run_name(row, seed)
            run_dir = os.path.join(workdir, "ablate", run)
            policy = os.path.join(run_dir, "policy")
            if not os.path.exists(os.path.join(policy, "codedance.json")):
                g = ablation_config(c, workdir, sft_policy, row, seed)
                _log(f"GRPO, reward {row.key}" + ("" if seed is None else f", seed {seed}") + f": {g.total_steps} steps")
                grpo_run.train_and_evaluate(g, run_dir)
            with _pool(c) as pool:
                for name, sampled in eval_phases(c, run):
                    out = os.path.join(workdir, "ablate", "eval_" + name.replace("/", "_"))
                    results[name] = evaluate_policy(c, workdir, policy, out, pool, sampled=sampled)
                out = os.path.join(workdir, "ablate", "eval_" + run.replace("/", "_") + "_probes")
                probes = evaluate_probes(c, workdir, policy, out, pool)
                if probes is not None:
                    results[f"{run}_probes"] = probes
            drift = grpo_drift(c, workdir, sft_policy, run_dir)
            results[f"{run}_drift"] = drift
            if drift:  # the greedy row's column: how far the run moved from SFT at its last saved step
                results[run][table3.DRIFT_COLUMN] = drift[-1]["kl_k3"]
            seconds[row.key] = seconds.get(row.key, 0.0) + time.perf_counter() - t0
    k = c.eval.samples
    entries = [("SFT cold start", ["sft"])]
    if k > 0:
        entries.append((f"SFT cold start, sampled (k={k})", ["sft_sampled"]))
    for row in table_rows:
        runs = [table3.run_name(row, s) for s in seed_list]
        entries.append((row.label, runs))
        if k > 0:
            entries.append((f"{row.label}, sampled (k={k})", [f"{r}_sampled" for r in runs]))
    results["rows"] = [[label, names] for label, names in entries]  # the table's rows: label, run names
    entries = [(label, [results[n] for n in names]) for label, names in entries]
    if seeds:
        results["table"] = {label: table3.aggregate(runs) for label, runs in entries}
        results["seconds"] = seconds
    seed_text = f"seeds {', '.join(map(str, seeds))}" if seeds else f"seed {c.grpo.seed}"
    md = table3.markdown(entries, title=f"Table 3 on the toy world ({c.grpo.total_steps} GRPO steps per run, {seed_text})")
    return _write_table(workdir, md, results)


def _write_table(workdir: str, md: str, results: dict) -> dict:
    """WORKDIR/ablation.md and ablation.json; the table printed."""
    with open(os.path.join(workdir, "ablation.md"), "w") as f:
        f.write(md)
    with open(os.path.join(workdir, "ablation.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(md, flush=True)
    return results


def world_config(c, seed: int) -> ml_collections.ConfigDict:
    """`c` for world seed `seed`: a deep copy (which keeps the config's references, unlike
    `to_dict()`) with `seed` set, so the world, SFT, GRPO and evaluation seeds follow it."""
    cw = copy.deepcopy(c)
    cw.seed = int(seed)
    return cw


def world_entries(per_world) -> list[tuple[str, list[dict]]]:
    """The rows of a table over several worlds: each row label (in the first world's order) with the
    summaries of its runs in every world (`ablate`'s results, whose `rows` name each row's runs)."""
    entries: dict[str, list[dict]] = {}
    for res in per_world:
        for label, names in res["rows"]:
            entries.setdefault(label, []).extend(res[n] for n in names)
    return list(entries.items())


def ablate_worlds(c, workdir: str, worlds, modes=tuple(table3.MODE_NAMES), **kw) -> dict:
    """`ablate` once per world seed (`c.seed`: the world, its SFT policy and everything that follows
    from it) in WORKDIR/world{s}, then one table over every world and GRPO seed: each row's mean ±
    std over all its runs (the SFT rows: one run per world). Writes WORKDIR/ablation.md and
    ablation.json (`worlds`: each world's results; `table`: per row label, mean, std, n per column)."""
    workdir = os.path.abspath(workdir)
    per_world = {}
    for s in worlds:
        per_world[f"world{s}"] = ablate(world_config(c, s), os.path.join(workdir, f"world{s}"), modes, **kw)
    entries = world_entries(per_world.values())
    seeds = kw.get("seeds") or (c.grpo.seed,)
    title = (f"Table 3 on the toy world ({c.grpo.total_steps} GRPO steps per run; world seeds "
             f"{', '.join(map(str, worlds))} x GRPO seeds {', '.join(map(str, seeds))})")
    out = {"worlds": per_world, "table": {label: table3.aggregate(runs) for label, runs in entries}}
    return _write_table(workdir, table3.markdown(entries, title=title), out)
