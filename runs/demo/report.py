"""The demo's report: `report.md`, `summary.json`, `report.html` and `plots/*.png` in one folder
(how numbers are written: `numbers.py`; the checks: `checks.py`; the plots: `plots.py`).

    paths = write_report(out_dir, evals={"sft": s0, "grpo": s1},
                         eval_trajectories={"sft": ".../trajectories.jsonl", "grpo": ...},
                         sft_metrics=rows, grpo_metrics=rows, targets={"hard_accuracy": 0.9})

`evals[name]` is a `codedance_jax.rl.scoring.summarize` dict (`accuracy`, `avg_turns`,
`exec_success`, `tool_calls`, `tool_rate`, `n`, and `family=count/accuracy`,
`difficulty=hard/tool_rate`, `family=count,difficulty=hard/accuracy`, ...), optionally with the
rates' 95% intervals (`{key}_ci95` = [lo, hi], `eval.intervals.rate_intervals`), `n_items` and
`samples_per_item` (a sampled evaluation, named `{phase}_sampled`). Evaluations appear in the
dict's order. Rates are printed as percentages with their interval in brackets, a metric that was
not measured (NaN: no code ran) as "n/a". Pairs of evaluations (`before` -> `after`, and
`{before}_sampled` -> `{after}_sampled` when both exist) get a table of differences with
Newcombe's interval (`eval.intervals.difference`), a difference whose interval excludes 0 marked.

Targets: each key is `{scope}_{metric}` (`overall_accuracy`, `hard_accuracy`, `count_tool_rate`:
the scope is matched against the breakdown values) or a summary key itself
(`difficulty=hard/accuracy`); a number means "at least", `{"max": x}` "at most" (`{"min": x}` is
the number). Checked for every evaluation; a missing or NaN value is NOT met. The two
adaptive-tool-use checks compare the evaluations named `before` ("sft") and `after` ("grpo"):
(a) accuracy after >= before, (b) tool-call rate on easy items after < before while the hard
items' rate after stays >= `hard_tool_rate_min`.

Plots use matplotlib's Agg canvas directly (no pyplot, no global backend switch). A series with no
finite value is left out; a plot with no series is not drawn and is listed as "no data".

The HTML page is static: tables, plots (`<img src="plots/...">`) and example trajectories, a few
correct and wrong ones per eval x family x difficulty, read from each eval's `trajectories.jsonl`
(`codedance_jax.rollout.record.save_jsonl`; optional extra fields `text`, a string or a list of
per-turn strings, and `meta` {family, difficulty, question, gold}). Their images are linked by
paths relative to `out_dir` (or copied into `out_dir/images/` with `copy_images=True`). Every piece
of text is HTML-escaped: the model's output is untrusted.
"""

from __future__ import annotations

import html
import json
import math
import os
import shutil
from collections.abc import Mapping, Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from runs.demo.checks import (
    _check_html,
    _verdict,
    adaptive_checks,
    check_targets,
    effect_checks,
    targets_table,
)
from runs.demo.numbers import _ci, _fmt_diff, _num, fmt_ci, fmt_metric
from runs.demo.plots import plot_step_rates, series, step_rates, write_plots
from eval import tool_analytics
from eval.intervals import difference
from eval.report import CSS as EVAL_CSS
from eval.trajectory_html import trajectory_html

FAMILY_ORDER = ("count", "bars", "find")
DIFFICULTY_ORDER = ("easy", "hard")
EVAL_COLUMNS = [
    ("accuracy", "accuracy"),
    ("avg_turns", "avg turns"),
    ("exec_success", "exec success"),
    ("tool_rate", "tool-call rate"),
    ("tool_calls", "tool calls / traj"),
    ("n", "n"),
    ("n_items", "items"),
    ("samples_per_item", "samples / item"),
]
BREAKDOWN_RATES = [("accuracy", "Accuracy"), ("tool_rate", "Tool-call rate"), ("exec_success", "Execution success")]
# The differences table: (summary key, label); a rate of the after-evaluation minus the before one.
DIFF_KEYS = [
    ("accuracy", "accuracy"),
    ("difficulty=easy/accuracy", "accuracy, easy"),
    ("difficulty=hard/accuracy", "accuracy, hard"),
    ("tool_rate", "tool-call rate"),
    ("difficulty=easy/tool_rate", "tool-call rate, easy"),
    ("difficulty=hard/tool_rate", "tool-call rate, hard"),
    ("exec_success", "exec success"),
]


INTERVALS_NOTE = ("Wilson score intervals; a sampled evaluation's k draws of one item, and one trajectory's "
                  "executions, count as one cluster (effective sample size by Kish's design effect).")
DIFF_NOTE = ("After minus before, in percentage points, with Newcombe's hybrid score interval (conservative on "
             "the same items); * marks a difference whose interval excludes 0.")

TOOL_NOTE = ("Read from each executed cell's AST (eval.tool_analytics): trajectories with at least one executed "
             "cell, cells, distinct calls per cell, the share of cells showing each behaviour, the share using a "
             "call never seen in the SFT data, and the commonest set of libraries per trajectory.")

EXTRA_CSS = """
table.summary th{background:#eee}td.num{text-align:right}.met{color:#2a2;font-weight:bold}.notmet{color:#c33;font-weight:bold}
.plots{display:flex;flex-wrap:wrap}.plots img{max-width:560px;max-height:none;border:none}
pre.reasoning:empty{display:none}pre.response{background:#f7f3ff}details{margin:.4em 0}summary{cursor:pointer}
h2{border-bottom:1px solid #ccc;padding-bottom:.2em}
"""


# ---------------------------------------------------------------- numbers


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
    f = _num(obj)  # numpy scalars
    if f is not None:
        return int(f) if float(f).is_integer() and "int" in type(obj).__name__ else f
    try:
        return None if math.isnan(float(obj)) else str(obj)
    except (TypeError, ValueError):
        return str(obj)


# ---------------------------------------------------------------- tables


def _ordered(values, order) -> list[str]:
    values = set(values)
    return [v for v in order if v in values] + sorted(values - set(order))


def _groups(evals: Mapping[str, Mapping]) -> tuple[list[str], list[str]]:
    """Families and difficulties present in any summary's breakdown keys."""
    fams, diffs = set(), set()
    for s in evals.values():
        for k in s:
            prefix, _, _ = k.rpartition("/")
            for part in prefix.split(","):
                key, eq, val = part.partition("=")
                if eq and key == "family":
                    fams.add(val)
                elif eq and key == "difficulty":
                    diffs.add(val)
    return _ordered(fams, FAMILY_ORDER), _ordered(diffs, DIFFICULTY_ORDER)


def eval_table(evals: Mapping[str, Mapping]) -> tuple[list[str], list[list[str]]]:
    cols = [(k, label) for k, label in EVAL_COLUMNS
            if k not in ("n_items", "samples_per_item") or any(k in s for s in evals.values())]
    header = ["eval"] + [label for _, label in cols]
    rows = [[name] + [fmt_ci(k, s.get(k), s.get(f"{k}_ci95")) for k, _ in cols] for name, s in evals.items()]
    return header, rows


def _prefixes(evals: Mapping[str, Mapping]) -> list[tuple[str, str, str]]:
    """(family, difficulty, summary key prefix) of every breakdown row: family x difficulty, then
    each difficulty over all families."""
    fams, diffs = _groups(evals)
    prefixes = []
    if fams and diffs:
        prefixes += [(f, d, f"family={f},difficulty={d}") for f in fams for d in diffs]
    elif fams:
        prefixes += [(f, "all", f"family={f}") for f in fams]
    prefixes += [("all", d, f"difficulty={d}") for d in diffs]
    return [(f, d, p) for f, d, p in prefixes if any(f"{p}/n" in s or f"{p}/accuracy" in s for s in evals.values())]


def rate_breakdown_table(evals: Mapping[str, Mapping], metric: str) -> tuple[list[str], list[list[str]]]:
    """One rate per family x difficulty (rows) and evaluation (columns), with its 95% interval;
    the last row is the rate over all items. Accuracy and tool-call rate cells end with the
    number of items (`items x samples` for a sampled evaluation); execution success counts
    executions, whose number varies, so its cells do not."""
    header = ["family", "difficulty"] + list(evals)
    rows = []
    for fam, diff, p in _prefixes(evals) + [("all", "all", "")]:
        key = f"{p}/{metric}" if p else metric
        row = [fam, diff]
        for s in evals.values():
            cell = fmt_ci(metric, s.get(key), s.get(f"{key}_ci95"))
            n = _num(s.get(f"{p}/n" if p else "n"))
            items, k = _num(s.get(f"{p}/n_items" if p else "n_items")), _num(s.get("samples_per_item"))
            if metric != "exec_success" and n is not None:
                cell += f" ({int(items)} x {int(k)})" if items is not None and k and k > 1 else f" ({int(n)})"
            row.append(cell)
        rows.append(row)
    return header, rows


def differences(evals: Mapping[str, Mapping], before: str, after: str) -> dict:
    """{label: {key, before, after, diff, ci95}} of `after` minus `before` for the DIFF_KEYS rates
    (Newcombe's interval from the two Wilson intervals; None where either lacks one)."""
    b, a = evals.get(before), evals.get(after)
    if b is None or a is None:
        return {}
    out = {}
    for key, label in DIFF_KEYS:
        vb, va = _num(b.get(key)), _num(a.get(key))
        cb, ca = _ci(b.get(f"{key}_ci95")), _ci(a.get(f"{key}_ci95"))
        d = None if vb is None or va is None else va - vb
        ci = list(difference(vb, cb, va, ca)) if d is not None and cb and ca else None
        out[label] = {"key": key, "before": vb, "after": va, "diff": d, "ci95": ci,
                      "excludes_0": None if ci is None else bool(ci[0] > 0 or ci[1] < 0)}
    return out


def comparison_pairs(evals: Mapping[str, Mapping], before: str, after: str) -> list[tuple[str, str]]:
    """(before, after) pairs present: greedy, then sampled."""
    pairs = [(before, after), (f"{before}_sampled", f"{after}_sampled")]
    return [(b, a) for b, a in pairs if b in evals and a in evals]


def differences_table(diffs: Mapping[str, Mapping]) -> tuple[list[str], list[list[str]]]:
    header = ["rate"] + list(diffs)
    labels = [label for _, label in DIFF_KEYS]
    rows = [[label] + [_fmt_diff(d[label]["diff"], d[label]["ci95"]) for d in diffs.values()] for label in labels]
    return header, rows


def _md_table(header, rows) -> str:
    def cell(s):
        return str(s).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _html_table(header, rows) -> str:
    def td(c):
        c = str(c)
        cls = "notmet" if c.endswith("NOT met") else "met" if c == "met" or c.endswith(" met") else ""
        return f'<td class="{cls}">{html.escape(c)}</td>' if cls else f"<td>{html.escape(c)}</td>"

    out = ['<table class="summary"><tr>' + "".join(f"<th>{html.escape(str(h))}</th>" for h in header) + "</tr>"]
    out += ["<tr>" + "".join(td(c) for c in r) + "</tr>" for r in rows]
    return "".join(out) + "</table>"


def _is_flat(d: Mapping) -> bool:
    return all(isinstance(v, str | int | float | bool) or v is None for v in d.values())


# ---------------------------------------------------------------- plots


# ---------------------------------------------------------------- example trajectories


def _meta(rec: Mapping) -> dict:
    m = rec.get("meta")
    return dict(m) if isinstance(m, Mapping) else {}


def select_examples(path: str, per_group: int) -> tuple[list[dict], dict]:
    """Up to `per_group` correct and `per_group` wrong records per (family, difficulty), in file
    order; also the number of records per group. Unreadable lines are skipped."""
    chosen: dict[tuple, dict[str, list]] = {}
    totals: dict[tuple, int] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if not isinstance(rec, dict):
                continue
            m = _meta(rec)
            g = (str(m.get("family", "?")), str(m.get("difficulty", "?")))
            totals[g] = totals.get(g, 0) + 1
            c = rec.get("correct")
            verdict = "correct" if c is True else "wrong" if c is False else "unscored"
            bucket = chosen.setdefault(g, {}).setdefault(verdict, [])
            if len(bucket) < per_group:
                bucket.append(rec)
    fams = _ordered({g[0] for g in chosen}, FAMILY_ORDER)
    diffs = _ordered({g[1] for g in chosen}, DIFFICULTY_ORDER)
    out = []
    for fam in fams:
        for diff in diffs:
            for verdict in ("correct", "wrong", "unscored"):
                out += chosen.get((fam, diff), {}).get(verdict, [])
    return out, {f"{f}/{d}": n for (f, d), n in totals.items()}


def _image_src(rel: str, traj_dir: str, out_dir: str, copy_to: str | None) -> str:
    src = os.path.normpath(os.path.join(traj_dir, rel))
    if copy_to is not None and os.path.isfile(src):
        os.makedirs(copy_to, exist_ok=True)
        dst = os.path.join(copy_to, os.path.basename(src))
        shutil.copyfile(src, dst)
        src = dst
    return os.path.relpath(src, out_dir).replace(os.sep, "/")


def _example_html(rec: Mapping, traj_dir: str, out_dir: str, copy_to: str | None) -> str:
    m = _meta(rec)
    images = [str(p) for p in rec.get("images") or [] if isinstance(p, str)]
    srcs = [_image_src(p, traj_dir, out_dir, copy_to) for p in images]
    turns = [t if isinstance(t, Mapping) else {} for t in rec.get("turns") or []]
    c = rec.get("correct")
    verdict = "correct" if c is True else "wrong" if c is False else "unscored"
    rewards = rec.get("rewards") if isinstance(rec.get("rewards"), Mapping) else {}
    rew = ", ".join(f"{k} {_num(v):.3g}" if _num(v) is not None else f"{k} {v}" for k, v in rewards.items())
    info = [
        str(rec.get("id", "?")),
        f"{m.get('family', '?')} / {m.get('difficulty', '?')}",
        verdict,
        f"{rec.get('num_turns', len(turns))} turns",
        f"{sum(s in ('ok', 'error', 'timeout', 'crashed') for s in rec.get('turn_status') or [])} executions",
        f"finish: {rec.get('finish_reason', '')}",
    ] + ([f"rewards: {rew}"] if rew else [])
    out = [f'<div class="item {verdict}" data-verdict="{verdict}"><div class="meta">'
           f"{html.escape(' · '.join(info))}</div>"]
    if m.get("question") is not None:
        out.append(f'<pre class="question">{html.escape(str(m["question"]))}</pre>')
    text = rec.get("text", rec.get("turn_texts"))
    if isinstance(text, str):  # the full response already shows the code
        turns = [{**t, "code": None} for t in turns]
    turns = [{kk: (str(v) if kk in ("status", "observation", "code") and v is not None else v) for kk, v in t.items()}
             for t in turns]
    out.append(trajectory_html(srcs, turns, text if isinstance(text, list) else None, out_dir, eager=True,
                               response=text if isinstance(text, str) else None))
    gold = m.get("gold", rec.get("gold"))
    out.append(
        f'<p><b>answer</b>: <span class="prediction">{html.escape(str(rec.get("answer")))}</span> · '
        f'<b>reference</b>: <span class="gold">{html.escape(str(gold))}</span> · '
        f"<b>{html.escape(verdict)}</b></p></div>"
    )
    return "".join(out)


# ---------------------------------------------------------------- the report


def tool_use_section(eval_trajectories: Mapping[str, str], sft_data: Sequence[str] | str | None,
                     grpo_trajectories: str | None, plot_dir: str) -> dict:
    """The tool-use analytics (`eval.tool_analytics`) of each evaluation's trajectories, per family,
    against the calls of the SFT data; the per-step curves of the GRPO rollouts (drawn as
    `plots/grpo_tool_use.png`). Returns {"evals": {name: analyze(...)}, "curves": rows, "plot": path
    or None, "sft_calls": n or None}."""
    paths = [sft_data] if isinstance(sft_data, str) else list(sft_data or [])
    paths = [p for p in paths if os.path.isfile(p)]
    seen = tool_analytics.sft_calls(paths) if paths else None
    out = {"evals": {}, "curves": [], "plot": None, "sft_calls": None if seen is None else len(seen)}
    for name, path in eval_trajectories.items():
        if path and os.path.isfile(path):
            out["evals"][name] = tool_analytics.analyze(tool_analytics.read_records(path), ("family",), seen)
    if grpo_trajectories and os.path.isfile(grpo_trajectories):
        rows = tool_analytics.step_curves(tool_analytics.read_records(grpo_trajectories), seen)
        out["curves"] = rows
        keys = [(f"behaviour/{label}", label) for label, _ in tool_analytics.BEHAVIOURS]
        keys.append(("novel_cell_rate", "a call not in the SFT data"))
        data = [(label, *series(rows, k)) for k, label in keys]
        data = [d for d in data if d[1] and any(y > 0 for y in d[2])]
        if data:
            fig = Figure(figsize=(6, 3.6), dpi=100)
            FigureCanvasAgg(fig)
            ax = fig.add_subplot()
            for label, xs, ys in data:
                ax.plot(xs, ys, label=label, marker="o" if len(xs) <= 30 else None, markersize=4)
            ax.set_title("GRPO rollouts: what the executed cells do")
            ax.set_xlabel("step")
            ax.set_ylabel("share of executed cells")
            ax.set_ylim(-0.03, 1.03)
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
            fig.tight_layout()
            os.makedirs(plot_dir, exist_ok=True)
            out["plot"] = os.path.join(plot_dir, "grpo_tool_use.png")
            fig.savefig(out["plot"], format="png")
    return out


def _pct(v) -> str:
    f = _num(v)
    return "n/a" if f is None else f"{100 * f:.0f}%"


def tool_use_table(analytics: Mapping[str, Mapping]) -> tuple[list[str], list[list[str]]]:
    """Rows: evaluation x family (all first); columns: trajectories with code, cells, calls per
    cell, the share of cells showing each behaviour, the share using a call not in the SFT data,
    the commonest library composition per trajectory."""
    labels = [label for label, _ in tool_analytics.BEHAVIOURS]
    header = ["eval", "family", "with code", "cells", "calls / cell"] + labels + ["not in SFT", "top composition"]
    rows = []
    for name, groups in analytics.items():
        order = ["all"] + [f"family={f}" for f in FAMILY_ORDER] + sorted(
            g for g in groups if g != "all" and g.removeprefix("family=") not in FAMILY_ORDER)
        for g in order:
            st = groups.get(g)
            if not st:
                continue
            beh = st.get("behaviour_cell_rate") or {}
            comp = st.get("compositions") or []
            rows.append([name, g.removeprefix("family="), f"{st['with_code']} / {st['trajectories']}", st["cells"],
                         fmt_metric("calls", st.get("calls_per_cell"))] + [_pct(beh.get(lb)) for lb in labels]
                        + [_pct(st.get("novel_cell_rate")),
                           f"{comp[0][0]} ({_pct(comp[0][1])})" if comp else "n/a"])
    return header, rows


DRIFT_NOTE = ("How far GRPO moved the policy: KL(sampling policy || SFT policy) per sampled token, averaged "
              "over each saved step's rollouts (k3 = r - 1 - log r with r = p_SFT / p_policy, unbiased and >= 0; "
              "k1 = log p_policy - log p_SFT, unbiased, noisier; eval.drift).")


def drift_table(drift: Sequence[Mapping]) -> tuple[list[str], list[list[str]]]:
    return (["step", "KL (k3)", "KL (k1)", "sampled tokens", "trajectories"],
            [[str(r["step"]), f"{r['kl_k3']:.4f}", f"{r['kl_k1']:.4f}", str(r["tokens"]), str(r["trajectories"])]
             for r in drift])


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
    rows of GRPO's sampling policies against the SFT policy (how far the policy moved)."""
    out_dir = os.path.abspath(os.fspath(out_dir))
    os.makedirs(out_dir, exist_ok=True)
    evals = {str(k): dict(v or {}) for k, v in (evals or {}).items()}
    eval_trajectories = dict(eval_trajectories or {})
    written: dict[str, str] = {}

    plots, no_data = write_plots(os.path.join(out_dir, "plots"), sft_metrics, grpo_metrics)
    for p in plots.values():
        written[os.path.relpath(p, out_dir)] = p
    tools = tool_use_section(eval_trajectories, sft_data, grpo_trajectories, os.path.join(out_dir, "plots"))
    if tools["plot"]:
        written[os.path.relpath(tools["plot"], out_dir)] = tools["plot"]
    t_tools = tool_use_table(tools["evals"])
    steps = []
    if grpo_trajectories and os.path.isfile(grpo_trajectories):
        metas = None
        if prompt_metas and os.path.isfile(prompt_metas):
            metas = {str(r.get("id")): r for r in tool_analytics.read_records(prompt_metas)}
        steps = step_rates(tool_analytics.read_records(grpo_trajectories), metas)
    step_plot = plot_step_rates(steps, os.path.join(out_dir, "plots", "grpo_step_rates.png"))
    if step_plot:
        written[os.path.relpath(step_plot, out_dir)] = step_plot
    novel = {n: g["all"].get("novel_calls") or [] for n, g in tools["evals"].items()}
    target_res = check_targets(evals, targets)
    pairs = comparison_pairs(evals, before, after)
    checks = adaptive_checks(evals, before, after, hard_tool_rate_min)
    for b, a in pairs[1:]:  # the sampled pair: the policy the reward acts on
        checks += adaptive_checks(evals, b, a, hard_tool_rate_min)
    diffs = {f"{a} - {b}": differences(evals, b, a) for b, a in pairs}
    effects = effect_checks(evals, diffs, effect_targets, before, after)
    t_eval = eval_table(evals)
    t_rates = [(title, rate_breakdown_table(evals, m)) for m, title in BREAKDOWN_RATES]
    has_breakdown = bool(_prefixes(evals))
    t_diff = differences_table(diffs)
    t_targets = targets_table(target_res, targets)
    timings = {str(k): v for k, v in (timings or {}).items()}
    t_time = (["phase", "seconds", "minutes"],
              [[k, fmt_metric("s", v), fmt_metric("s", _num(v) / 60 if _num(v) is not None else None)]
               for k, v in timings.items()])
    if timings:
        total = sum(_num(v) or 0.0 for v in timings.values())
        t_time[1].append(["total", f"{total:.2f}", f"{total / 60:.2f}"])
    world = dict(world or {})
    flat_world = _is_flat(world)

    # summary.json
    summary = {
        "title": title,
        "evals": evals,
        "eval_order": list(evals),
        "targets": {"given": targets or {}, "results": target_res,
                    "all_met": {n: all(r["met"] for r in res.values()) for n, res in target_res.items()}},
        "adaptive_checks": checks,
        "differences": diffs,
        "effect_checks": effects,
        "intervals": INTERVALS_NOTE,
        "tool_use": {"evals": tools["evals"], "grpo_curves": tools["curves"], "sft_calls": tools["sft_calls"]},
        "grpo_step_rates": steps,
        "policy_drift": list(drift or []),
        "timings": timings,
        "world": world,
        "plots": sorted(os.path.relpath(p, out_dir) for p in plots.values()),
        "plots_without_data": no_data,
        "final_train": {"sft": dict(sft_metrics[-1]) if sft_metrics else None,
                        "grpo": dict(grpo_metrics[-1]) if grpo_metrics else None},
    }
    p = os.path.join(out_dir, "summary.json")
    with open(p, "w", encoding="utf-8") as f:
        json.dump(_clean(summary), f, indent=2, allow_nan=False)
    written["summary.json"] = p

    # report.md
    md = [f"# {title}", "", "## Evaluations", ""]
    md += [_md_table(*t_eval) if evals else "No evaluations.", ""]
    md += ["Rates are shares of trajectories (execution success: successful executions / executions; "
           "n/a when no code ran), with their 95% interval in brackets: " + INTERVALS_NOTE, ""]
    if diffs:
        md += ["## Changes", "", DIFF_NOTE, "", _md_table(*t_diff), ""]
    md += ["## By family and difficulty", ""]
    if has_breakdown:
        for title_, t in t_rates:
            md += [f"### {title_}", "", _md_table(*t), ""]
    else:
        md += ["No breakdown.", ""]
    md += ["## Targets", ""]
    if targets:
        md += [_md_table(*t_targets), ""]
        for n, res in target_res.items():
            md.append(f"- {n}: {'all targets met' if all(r['met'] for r in res.values()) else 'targets NOT met'}")
        md.append("")
    else:
        md += ["No targets given.", ""]
    md += ["### Adaptive tool use", ""]
    md += [f"- {c['name']}: **{_verdict(c['met'])}** ({c['detail']})" for c in checks] + [""]
    if effects:
        md += ["### GRPO against SFT (issue 18)", ""]
        md += [f"- {c['name']}: **{_verdict(c['met'])}** ({c['detail']})" for c in effects] + [""]
    md += ["## Tool use (from the executed cells)", ""]
    if t_tools[1]:
        md += [TOOL_NOTE, "", _md_table(*t_tools), ""]
        md += [f"- {n}: calls not in the SFT data: " + (", ".join(f"`{c}` ({k})" for c, k in v) or "none")
               for n, v in novel.items()] if tools["sft_calls"] is not None else []
        md.append("")
    else:
        md += ["No trajectories with executed cells.", ""]
    if tools["plot"]:
        md += ["![grpo_tool_use](plots/grpo_tool_use.png)", ""]
    md += ["## Training curves", ""]
    if step_plot:
        md += ["GRPO's rollouts per step (the sampling policy the reward acts on), with 95% intervals "
               "(clustered by prompt):", "", "![grpo_step_rates](plots/grpo_step_rates.png)", ""]
    if drift:
        md += [DRIFT_NOTE, "", _md_table(*drift_table(drift)), ""]
    md += [f"![{stem}](plots/{stem}.png)" for stem in plots]
    md += [f"- {t}: no data" for t in no_data] + [""]
    md += ["## Timings", "", _md_table(*t_time) if timings else "No timings.", ""]
    md += ["## World", ""]
    if not world:
        md += ["No world summary.", ""]
    elif flat_world:
        md += [_md_table(["key", "value"], [[k, v] for k, v in world.items()]), ""]
    else:
        md += ["```json", json.dumps(_clean(world), indent=2), "```", ""]
    md += ["Examples of trajectories: report.html.", ""]
    p = os.path.join(out_dir, "report.md")
    with open(p, "w", encoding="utf-8") as f:
        f.write("\n".join(md))
    written["report.md"] = p

    # report.html
    h = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
         f"<style>{EVAL_CSS}{EXTRA_CSS}</style></head><body><h1>{html.escape(title)}</h1>"]
    h += ["<h2>Evaluations</h2>", _html_table(*t_eval) if evals else "<p>No evaluations.</p>"]
    h.append(f"<p class='meta'>{html.escape(INTERVALS_NOTE)}</p>")
    if diffs:
        h += ["<h2>Changes</h2>", f"<p class='meta'>{html.escape(DIFF_NOTE)}</p>", _html_table(*t_diff)]
    h.append("<h2>By family and difficulty</h2>")
    if has_breakdown:
        for title_, t in t_rates:
            h += [f"<h3>{html.escape(title_)}</h3>", _html_table(*t)]
    else:
        h.append("<p>No breakdown.</p>")
    h.append("<h2>Targets</h2>")
    h.append(_html_table(*t_targets) if targets else "<p>No targets given.</p>")
    h.append("<h3>Adaptive tool use</h3><ul>")
    h += [_check_html(c) for c in checks]
    if effects:
        h.append("</ul><h3>GRPO against SFT (issue 18)</h3><ul>")
        h += [_check_html(c) for c in effects]
    h.append("</ul><h2>Tool use (from the executed cells)</h2>")
    if t_tools[1]:
        h += [f"<p class='meta'>{html.escape(TOOL_NOTE)}</p>", _html_table(*t_tools)]
        if tools["sft_calls"] is not None:
            h.append("<ul>" + "".join(
                f"<li>{html.escape(n)}: calls not in the SFT data: "
                + html.escape(", ".join(f"{c} ({k})" for c, k in v) or "none") + "</li>" for n, v in novel.items())
                + "</ul>")
    else:
        h.append("<p>No trajectories with executed cells.</p>")
    if tools["plot"]:
        h.append('<div class="plots"><img src="plots/grpo_tool_use.png" alt="grpo_tool_use"></div>')
    h.append("<h2>Training curves</h2><div class='plots'>")
    if step_plot:
        h.append('<img src="plots/grpo_step_rates.png" alt="grpo_step_rates">')
    h += [f'<img src="plots/{html.escape(stem)}.png" alt="{html.escape(stem)}">' for stem in plots]
    h.append("</div>")
    if no_data:
        h.append("<p class='meta'>no data: " + html.escape(", ".join(no_data)) + "</p>")
    h += ["<h2>Timings</h2>", _html_table(*t_time) if timings else "<p>No timings.</p>", "<h2>World</h2>"]
    if not world:
        h.append("<p>No world summary.</p>")
    elif flat_world:
        h.append(_html_table(["key", "value"], [[k, v] for k, v in world.items()]))
    else:
        h.append(f"<pre>{html.escape(json.dumps(_clean(world), indent=2))}</pre>")
    h.append("<h2>Example trajectories</h2>")
    copy_root = os.path.join(out_dir, "images") if copy_images else None
    names = list(evals) + [n for n in eval_trajectories if n not in evals]
    for name in names:
        path = eval_trajectories.get(name)
        h.append(f"<details open><summary><b>{html.escape(name)}</b></summary>")
        if not path or not os.path.isfile(path):
            h.append(f"<p>No trajectories ({html.escape(str(path))}).</p></details>")
            continue
        recs, totals = select_examples(path, examples_per_group)
        h.append(f"<p class='meta'>{html.escape(os.path.relpath(path, out_dir))}: showing {len(recs)} of {sum(totals.values())} "
                 f"({html.escape(', '.join(f'{g} {n}' for g, n in totals.items()))})</p>")
        traj_dir = os.path.dirname(os.path.abspath(path))
        to = os.path.join(copy_root, _safe(name)) if copy_root else None
        group = None
        for rec in recs:
            m = _meta(rec)
            g = f"{m.get('family', '?')} / {m.get('difficulty', '?')}"
            if g != group:
                h.append(("</details>" if group is not None else "") + f"<details><summary>{html.escape(g)}</summary>")
                group = g
            h.append(_example_html(rec, traj_dir, out_dir, to))
        if group is not None:
            h.append("</details>")
        h.append("</details>")
    h.append("</body></html>")
    p = os.path.join(out_dir, "report.html")
    with open(p, "w", encoding="utf-8") as f:
        f.write("".join(h))
    written["report.html"] = p
    return written


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name) or "_"
