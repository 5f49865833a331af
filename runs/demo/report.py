"""The demo's report: `report.md`, `summary.json`, `report.html` and `plots/*.png` in one folder.

    paths = write_report(out_dir, evals={"sft": s0, "grpo": s1},
                         eval_trajectories={"sft": ".../trajectories.jsonl", "grpo": ...},
                         sft_metrics=rows, grpo_metrics=rows, targets={"hard_accuracy": 0.9})

Three steps: `gather` computes every number and draws the plots (`Findings`); `summary.json` is
the findings as JSON; `build_report` turns them into one `report_model.Report`, which
`to_markdown` and `to_html` render, so the two files hold the same sections, tables, numbers and
figures. The HTML page adds the example trajectories (`examples.py`), which Markdown points to.
Elsewhere: how numbers are written (`numbers.py`), the tables (`tables.py`), the checks
(`checks.py`), the plots (`plots.py`).

`evals[name]` is a `codedance_jax.rl.scoring.summarize` dict (`accuracy`, `avg_turns`,
`exec_success`, `tool_calls`, `tool_rate`, `n`, and `family=count/accuracy`,
`difficulty=hard/tool_rate`, `family=count,difficulty=hard/accuracy`, ...), optionally with the
rates' 95% intervals (`{key}_ci95` = [lo, hi], `eval.intervals.rate_intervals`), `n_items` and
`samples_per_item` (a sampled evaluation, named `{phase}_sampled`). Evaluations appear in the
dict's order. Rates are printed as percentages with their interval in brackets, a metric that was
not measured (NaN: no code ran) as "n/a". Pairs of evaluations (`before` -> `after`, and
`{before}_sampled` -> `{after}_sampled` when both exist) get a table of differences with
Newcombe's interval (`eval.intervals.difference`), a difference whose interval excludes 0 marked.
Where both evaluations' records are in `eval_trajectories`, each pair's accuracy is also compared
item by item (`eval.intervals.paired_accuracy`, items matched by id), overall and per family x
difficulty: greedy with McNemar's exact p and Tango's score interval, sampled with a bootstrap over
items, Newcombe's interval beside them (summary.json: `paired_accuracy`).

Targets: each key is `{scope}_{metric}` (`overall_accuracy`, `hard_accuracy`, `count_tool_rate`:
the scope is matched against the breakdown values) or a summary key itself
(`difficulty=hard/accuracy`); a number means "at least", `{"max": x}` "at most" (`{"min": x}` is
the number). Checked for every evaluation; a missing or NaN value is NOT met. The two
adaptive-tool-use checks compare the evaluations named `before` ("sft") and `after` ("grpo"):
(a) accuracy after >= before, (b) tool-call rate on easy items after < before while the hard
items' rate after stays >= `hard_tool_rate_min`.

A plot with no series is not drawn and is listed as "no data". The HTML page is static (no
script): tables, plots (`<img src="plots/...">`) and example trajectories; every piece of text is
HTML-escaped, since the model's output is untrusted.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence

from eval import tool_analytics
from eval.intervals import paired_accuracy
from eval.report import CSS as EVAL_CSS
from runs.demo import tables
from runs.demo.checks import adaptive_checks, check_targets, effect_checks, targets_table, verdict
from runs.demo.examples import examples_html
from runs.demo.numbers import to_float
from runs.demo.plots import plot_step_rates, plot_tool_use, step_rates, write_plots
from runs.demo.report_model import (
    Block,
    Bullets,
    Cell,
    Code,
    Figure,
    Paragraph,
    Preformatted,
    Raw,
    Report,
    Section,
    Strong,
    Table,
    to_html,
    to_markdown,
)

RATES_NOTE = ("Rates are shares of trajectories (execution success: successful executions / executions; "
              "n/a when no code ran), with their 95% interval in brackets: ")
INTERVALS_NOTE = ("Wilson score intervals; a sampled evaluation's k draws of one item, and one trajectory's "
                  "executions, count as one cluster (effective sample size by Kish's design effect).")
DIFF_NOTE = ("After minus before, in percentage points, with Newcombe's hybrid score interval (conservative on "
             "the same items); * marks a difference whose interval excludes 0.")
PAIRED_NOTE = ("Accuracy on the items both evaluations share (matched by id), after minus before in percentage "
               "points. Greedy: b items right only after, c right only before; McNemar's exact test of b against "
               "c, and Tango's score interval of (b - c) / items. Sampled: mean per-item accuracy (share of "
               "correct draws), its interval from a bootstrap over items (2000 resamples, fixed seed, "
               "percentile). Newcombe's interval (as if the evaluations were independent: conservative) "
               "beside them; * marks an interval that excludes 0.")
TOOL_NOTE = ("Read from each executed cell's AST (eval.tool_analytics): trajectories with at least one executed "
             "cell, cells, distinct calls per cell, the share of cells showing each behaviour, the share using a "
             "call never seen in the SFT data, and the commonest set of libraries per trajectory.")
STEP_RATES_NOTE = ("GRPO's rollouts per step (the sampling policy the reward acts on), with 95% intervals "
                   "(clustered by prompt):")
DRIFT_NOTE = ("How far GRPO moved the policy: KL(sampling policy || SFT policy) per sampled token, averaged "
              "over each saved step's rollouts (k3 = r - 1 - log r with r = p_SFT / p_policy, unbiased and >= 0; "
              "k1 = log p_policy - log p_SFT, unbiased, noisier; eval.drift).")

CSS = EVAL_CSS + """
table.summary th{background:#eee}td.num{text-align:right}.met{color:#2a2;font-weight:bold}.notmet{color:#c33;font-weight:bold}
.plots{display:flex;flex-wrap:wrap}.plots img{max-width:560px;max-height:none;border:none}
pre.reasoning:empty{display:none}pre.response{background:#f7f3ff}details{margin:.4em 0}summary{cursor:pointer}
h2{border-bottom:1px solid #ccc;padding-bottom:.2em}
"""


def _clean(obj):
    """JSON-safe copy: NaN/inf -> None, tuples -> lists, unknown objects -> str."""
    if isinstance(obj, Mapping):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    if isinstance(obj, bool) or obj is None or isinstance(obj, str | int):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    f = to_float(obj)  # numpy scalars
    if f is not None:
        return int(f) if float(f).is_integer() and "int" in type(obj).__name__ else f
    try:
        return None if math.isnan(float(obj)) else str(obj)
    except (TypeError, ValueError):
        return str(obj)


def tool_use_analytics(eval_trajectories: Mapping[str, str], sft_data: Sequence[str] | str | None,
                       grpo_trajectories: str | None) -> dict:
    """The tool-use analytics (`eval.tool_analytics`) of each evaluation's trajectories, per family,
    against the calls of the SFT data; the per-step curves of the GRPO rollouts. Returns
    {"evals": {name: analyze(...)}, "curves": rows, "sft_calls": n or None}."""
    paths = [sft_data] if isinstance(sft_data, str) else list(sft_data or [])
    paths = [p for p in paths if os.path.isfile(p)]
    seen = tool_analytics.sft_calls(paths) if paths else None
    out = {"evals": {}, "curves": [], "sft_calls": None if seen is None else len(seen)}
    for name, path in eval_trajectories.items():
        if path and os.path.isfile(path):
            out["evals"][name] = tool_analytics.analyze(tool_analytics.read_records(path), ("family",), seen)
    if grpo_trajectories and os.path.isfile(grpo_trajectories):
        out["curves"] = tool_analytics.step_curves(tool_analytics.read_records(grpo_trajectories), seen)
    return out


@dataclasses.dataclass
class Findings:
    """Everything the report says, computed once. Plot paths are relative to the report's folder."""

    title: str
    evals: dict[str, dict]
    targets: dict  # as given
    target_results: dict  # check_targets'
    checks: list[dict]  # adaptive_checks', greedy pair then sampled pair
    diffs: dict[str, dict]  # {"{after} - {before}": differences(...)}
    paired: dict[str, dict]  # {"{after} - {before}": eval.intervals.paired_accuracy(...)}, where records exist
    effects: list[dict]  # effect_checks'
    tool_use: dict  # tool_use_analytics'
    steps: list[dict]  # step_rates'
    drift: list[dict]
    timings: dict[str, float]
    world: dict
    final_train: dict
    curves: dict[str, str]  # training curves: {stem: path}
    no_data: list[str]  # titles of the training curves without data
    step_plot: str | None = None
    tool_plot: str | None = None


def gather(out_dir: str, *, evals: dict[str, dict], eval_trajectories: Mapping[str, str] | None = None,
           sft_metrics: Sequence[Mapping] | None = None, grpo_metrics: Sequence[Mapping] | None = None,
           sft_data: Sequence[str] | str | None = None, grpo_trajectories: str | None = None,
           prompt_metas: str | None = None, effect_targets: Mapping | None = None, world: Mapping | None = None,
           timings: Mapping[str, float] | None = None, targets: Mapping | None = None,
           title: str = "CodeDance toy world", before: str = "sft", after: str = "grpo",
           hard_tool_rate_min: float = 0.8, drift: Sequence[Mapping] | None = None) -> Findings:
    """Compute the report's numbers and draw its plots into `out_dir/plots/` (`write_report`'s
    arguments; `evals` as `write_report` normalises them: {str: dict})."""
    plot_dir = os.path.join(out_dir, "plots")
    curves, no_data = write_plots(plot_dir, sft_metrics, grpo_metrics)
    tools = tool_use_analytics(eval_trajectories or {}, sft_data, grpo_trajectories)
    tool_plot = plot_tool_use(tools["curves"], os.path.join(plot_dir, "grpo_tool_use.png")) if tools["curves"] else None
    steps = []
    if grpo_trajectories and os.path.isfile(grpo_trajectories):
        metas = None
        if prompt_metas and os.path.isfile(prompt_metas):
            metas = {str(r.get("id")): r for r in tool_analytics.read_records(prompt_metas)}
        steps = step_rates(tool_analytics.read_records(grpo_trajectories), metas)
    step_plot = plot_step_rates(steps, os.path.join(plot_dir, "grpo_step_rates.png"))
    pairs = tables.comparison_pairs(evals, before, after)
    checks = adaptive_checks(evals, before, after, hard_tool_rate_min)
    for b, a in pairs[1:]:  # the sampled pair: the policy the reward acts on
        checks += adaptive_checks(evals, b, a, hard_tool_rate_min)
    diffs = {f"{a} - {b}": tables.differences(evals, b, a) for b, a in pairs}
    paired = {}
    for b, a in pairs:  # item by item, where both evaluations' records were saved
        pb, pa = (eval_trajectories or {}).get(b), (eval_trajectories or {}).get(a)
        if pb and pa and os.path.isfile(pb) and os.path.isfile(pa):
            paired[f"{a} - {b}"] = paired_accuracy(
                tool_analytics.read_records(pb), tool_analytics.read_records(pa), tables.breakdown_keys(evals),
                sampled=b == f"{before}_sampled")

    def rel(p):
        return None if p is None else os.path.relpath(p, out_dir).replace(os.sep, "/")

    return Findings(
        title=title, evals=evals, targets=dict(targets or {}), target_results=check_targets(evals, targets),
        checks=checks, diffs=diffs, paired=paired,
        effects=effect_checks(evals, diffs, effect_targets, before, after, paired),
        tool_use=tools, steps=steps, drift=list(drift or []), timings={str(k): v for k, v in (timings or {}).items()},
        world=dict(world or {}),
        final_train={"sft": dict(sft_metrics[-1]) if sft_metrics else None,
                     "grpo": dict(grpo_metrics[-1]) if grpo_metrics else None},
        curves={stem: rel(p) for stem, p in curves.items()}, no_data=no_data,
        step_plot=rel(step_plot), tool_plot=rel(tool_plot))


def summary_json(f: Findings) -> dict:
    """summary.json: the findings, keyed as the report's readers expect."""
    return {
        "title": f.title,
        "evals": f.evals,
        "eval_order": list(f.evals),
        "targets": {"given": f.targets, "results": f.target_results,
                    "all_met": {n: all(r["met"] for r in res.values()) for n, res in f.target_results.items()}},
        "adaptive_checks": f.checks,
        "differences": f.diffs,
        "paired_accuracy": f.paired,
        "effect_checks": f.effects,
        "intervals": INTERVALS_NOTE,
        "tool_use": {"evals": f.tool_use["evals"], "grpo_curves": f.tool_use["curves"],
                     "sft_calls": f.tool_use["sft_calls"]},
        "grpo_step_rates": f.steps,
        "policy_drift": f.drift,
        "timings": f.timings,
        "world": f.world,
        "plots": sorted(f.curves.values()),
        "plots_without_data": f.no_data,
        "final_train": f.final_train,
    }


def _check_items(checks: Sequence[Mapping]) -> Bullets:
    return Bullets([(f"{c['name']}: ", Strong(verdict(c["met"]), {True: "met", False: "notmet"}.get(c["met"], "")),
                     f" ({c['detail']})") for c in checks])


def _targets(f: Findings) -> list[Block]:
    if not f.targets:
        return [Paragraph("No targets given.")]
    header, rows = targets_table(f.target_results, f.targets)
    results = list(f.target_results.values())
    rows = [r[:2] + [Cell(c, "met" if res[r[0]]["met"] else "notmet") for c, res in zip(r[2:], results, strict=True)]
            for r in rows]
    met = [f"{n}: {'all targets met' if all(r['met'] for r in res.values()) else 'targets NOT met'}"
           for n, res in f.target_results.items()]
    return [Table(header, rows), Bullets(met)]


def _tool_use(f: Findings) -> list[Block]:
    header, rows = tables.tool_use_table(f.tool_use["evals"])
    if not rows:
        blocks: list[Block] = [Paragraph("No trajectories with executed cells.")]
    else:
        blocks = [Paragraph(TOOL_NOTE, note=True), Table(header, rows)]
        if f.tool_use["sft_calls"] is not None:
            items = []
            for name, groups in f.tool_use["evals"].items():
                calls = groups["all"].get("novel_calls") or []
                spans = [s for i, (c, k) in enumerate(calls) for s in ((", ",) if i else ()) + (Code(c), f" ({k})")]
                items.append([f"{name}: calls not in the SFT data: "] + (spans or ["none"]))
            blocks.append(Bullets(items))
    if f.tool_plot:
        blocks.append(Figure(f.tool_plot, "grpo_tool_use"))
    return blocks


def _world(world: Mapping) -> Block:
    if not world:
        return Paragraph("No world summary.")
    if all(isinstance(v, str | int | float | bool) or v is None for v in world.values()):
        return Table(["key", "value"], [[k, v] for k, v in world.items()])
    return Preformatted(json.dumps(_clean(world), indent=2), "json")


def build_report(f: Findings, examples: str = "") -> Report:
    """The report as data: the sections both renderings show. `examples`: the example trajectories'
    HTML (escaped), shown in the page; Markdown points to the page instead."""
    evals = f.evals
    eval_rows = [Table(*tables.eval_table(evals)) if evals else Paragraph("No evaluations."),
                 Paragraph(RATES_NOTE + INTERVALS_NOTE, note=True)]
    sections = [Section("Evaluations", eval_rows)]
    if f.diffs:
        changes: list[Block] = [Paragraph(DIFF_NOTE, note=True), Table(*tables.differences_table(f.diffs))]
        if f.paired:
            changes.append(Paragraph(PAIRED_NOTE, note=True))
        for label, p in f.paired.items():
            after_name, _, before_name = label.partition(" - ")
            blocks: list[Block] = [Table(*tables.paired_table(p, before_name, after_name))]
            if p["before_only"] or p["after_only"]:
                blocks.append(Paragraph(f"Left out: {p['before_only']} items evaluated only by {before_name}, "
                                        f"{p['after_only']} only by {after_name}.", note=True))
            kind = "sampled" if p["sampled"] else "greedy"
            changes.append(Section(f"Accuracy item by item, {kind}: {label}",
                                   [Paragraph(f"{p['method']}.", note=True)] + blocks))
        sections.append(Section("Changes", changes))
    if tables.breakdown_prefixes(evals):
        breakdown = [Section(title, [Table(*tables.rate_breakdown_table(evals, m))])
                     for m, title in tables.BREAKDOWN_RATES]
    else:
        breakdown = [Paragraph("No breakdown.")]
    sections.append(Section("By family and difficulty", breakdown))
    targets = _targets(f) + [Section("Adaptive tool use", [_check_items(f.checks)])]
    if f.effects:
        targets.append(Section("GRPO against SFT (issue 18)", [_check_items(f.effects)]))
    sections.append(Section("Targets", targets))
    sections.append(Section("Tool use (from the executed cells)", _tool_use(f)))
    curves: list[Block] = []
    if f.step_plot:
        curves += [Paragraph(STEP_RATES_NOTE), Figure(f.step_plot, "grpo_step_rates")]
    curves += [Figure(path, stem) for stem, path in f.curves.items()]
    if f.no_data:
        curves.append(Bullets([f"{t}: no data" for t in f.no_data]))
    if f.drift:
        curves += [Paragraph(DRIFT_NOTE, note=True), Table(*tables.drift_table(f.drift))]
    sections.append(Section("Training curves", curves))
    sections.append(Section("Timings", [Table(*tables.timings_table(f.timings)) if f.timings
                                        else Paragraph("No timings.")]))
    sections.append(Section("World", [_world(f.world)]))
    sections.append(Section("Example trajectories", [Raw(examples, "Examples of trajectories: report.html.")]))
    return Report(f.title, sections)


def write_report(
    out_dir: str,
    *,
    evals: Mapping[str, Mapping],
    eval_trajectories: Mapping[str, str] | None,
    sft_metrics: Sequence[Mapping] | None,
    grpo_metrics: Sequence[Mapping] | None,
    sft_data: Sequence[str] | str | None = None,
    grpo_trajectories: str | None = None,
    prompt_metas: str | None = None,
    effect_targets: Mapping | None = None,
    world: Mapping | None = None,
    timings: Mapping[str, float] | None = None,
    targets: Mapping | None = None,
    title: str = "CodeDance toy world",
    before: str = "sft",
    after: str = "grpo",
    hard_tool_rate_min: float = 0.8,
    examples_per_group: int = 2,
    copy_images: bool = False,
    drift: Sequence[Mapping] | None = None,
) -> dict[str, str]:
    """Write report.md, summary.json, report.html and plots/*.png to `out_dir`; returns
    {path relative to out_dir: absolute path} of every file written. `sft_data`: the SFT JSONL
    (the calls the analytics call "seen"); `grpo_trajectories`: GRPO's rollout records (the
    analytics' per-step curves, and each step's accuracy and tool-call rate with 95% intervals);
    `prompt_metas`: the RL prompts' JSONL (`id`, `difficulty`: the per-difficulty step rates);
    `effect_targets`: `effect_checks`' spec (GRPO against SFT, issue 18); `drift`: `eval.drift.policy_drift`
    rows of GRPO's sampling policies against the SFT policy (how far the policy moved). Example
    trajectories' images are linked from where they are, or copied into `out_dir/images/` with
    `copy_images=True`."""
    out_dir = os.path.abspath(os.fspath(out_dir))
    os.makedirs(out_dir, exist_ok=True)
    evals = {str(k): dict(v or {}) for k, v in (evals or {}).items()}
    eval_trajectories = dict(eval_trajectories or {})
    f = gather(out_dir, evals=evals, eval_trajectories=eval_trajectories, sft_metrics=sft_metrics,
               grpo_metrics=grpo_metrics, sft_data=sft_data, grpo_trajectories=grpo_trajectories,
               prompt_metas=prompt_metas, effect_targets=effect_targets, world=world, timings=timings,
               targets=targets, title=title, before=before, after=after, hard_tool_rate_min=hard_tool_rate_min,
               drift=drift)
    names = list(evals) + [n for n in eval_trajectories if n not in evals]
    examples = examples_html(names, eval_trajectories, out_dir, examples_per_group,
                             os.path.join(out_dir, "images") if copy_images else None)
    report = build_report(f, examples)
    written = {p: os.path.join(out_dir, p) for p in [*f.curves.values(), f.tool_plot, f.step_plot] if p}
    texts = {"summary.json": json.dumps(_clean(summary_json(f)), indent=2, allow_nan=False),
             "report.md": to_markdown(report), "report.html": to_html(report, css=CSS)}
    for name, text in texts.items():
        written[name] = os.path.join(out_dir, name)
        with open(written[name], "w", encoding="utf-8") as fh:
            fh.write(text)
    return written
