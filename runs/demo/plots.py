"""The demo report's plots: training curves from the metrics rows, GRPO's per-step sampled
rates with 95% bands, and what GRPO's executed cells do per step. Matplotlib's Agg canvas
directly (no pyplot, no global backend switch); a series with no finite value is left out, a plot
with no series is not drawn."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from eval import tool_analytics
from eval.intervals import rate_intervals
from runs.demo.numbers import to_float, to_interval

# (file stem, title, y label, metrics source, [(key, legend label)], y is a rate)
PLOTS = [
    ("sft_loss", "SFT loss", "loss", "sft", [("loss", "train"), ("eval/loss", "eval")], False),
    ("grpo_reward", "GRPO mean reward", "reward (R_BAT total)", "grpo", [("reward/total", "reward/total")], False),
    ("grpo_accuracy", "GRPO accuracy", "accuracy", "grpo",
     [("accuracy", "rollouts"), ("difficulty=easy/accuracy", "rollouts, easy"),
      ("difficulty=hard/accuracy", "rollouts, hard"), ("eval/accuracy", "held-out eval")], True),
    ("grpo_turns", "GRPO average turns", "turns / trajectory", "grpo",
     [("avg_turns", "rollouts"), ("eval/avg_turns", "held-out eval")], False),
    ("grpo_exec_success", "GRPO execution success", "successful executions / executions", "grpo",
     [("exec_success", "rollouts"), ("eval/exec_success", "held-out eval")], True),
    ("grpo_entropy", "GRPO policy entropy", "entropy", "grpo", [("train/entropy", "entropy")], False),
    ("grpo_tool_rate", "GRPO tool-call rate by difficulty", "share of trajectories with a tool call", "grpo",
     [("difficulty=easy/tool_rate", "easy"), ("difficulty=hard/tool_rate", "hard")], True),
]

def series(rows: Sequence[Mapping], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of `key` over metric rows, skipping rows without it or with a non-finite value."""
    pts = []
    for i, r in enumerate(rows or ()):
        y = to_float(r.get(key)) if isinstance(r, Mapping) else None
        if y is None:
            continue
        x = to_float(r.get("step"))
        pts.append((i if x is None else x, y))
    pts.sort(key=lambda p: p[0])
    return [p[0] for p in pts], [p[1] for p in pts]

def write_plots(plot_dir: str, sft_metrics, grpo_metrics) -> tuple[dict[str, str], list[str]]:
    """Draw the training curves; returns ({stem: path}, [titles of plots without data])."""
    os.makedirs(plot_dir, exist_ok=True)
    sources = {"sft": sft_metrics or [], "grpo": grpo_metrics or []}
    written, empty = {}, []
    for stem, title, ylabel, src, keys, rate in PLOTS:
        data = [(label, *series(sources[src], key), key.startswith("eval/")) for key, label in keys]
        data = [d for d in data if d[1]]
        if not data:
            empty.append(title)
            continue
        fig = Figure(figsize=(6, 3.6), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for label, xs, ys, is_eval in data:
            few = len(xs) <= 30
            ax.plot(xs, ys, label=label, linestyle="--" if is_eval else "-",
                    marker=("s" if is_eval else "o") if few else None, markersize=4)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        if rate:
            ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
        if len(data) > 1 or len(keys) > 1:
            ax.legend(fontsize="small")
        fig.tight_layout()
        path = os.path.join(plot_dir, f"{stem}.png")
        fig.savefig(path, format="png")
        written[stem] = path
    return written, empty

STEP_RATES = (("accuracy", "accuracy"), ("tool_rate", "tool-call rate"))

def _prompt_meta(rec: Mapping, metas: Mapping[str, Mapping] | None) -> dict:
    """A GRPO record's prompt metadata: GRPO names a prompt `{id}@{epoch}`, the prompts file `{id}`."""
    pid = str(rec.get("prompt_id"))
    for key in (pid, pid.rpartition("@")[0]):
        if metas and key in metas:
            return dict(metas[key])
    return dict(rec.get("meta") or {})

def step_rates(records: Sequence[Mapping], metas: Mapping[str, Mapping] | None = None) -> list[dict]:
    """Per GRPO step (from the records' sampling policy): accuracy and tool-call rate of its rollouts,
    overall and per difficulty, each with its 95% interval (the group of one prompt is a cluster).
    `metas`: prompt id -> metadata ({"difficulty": ...}; the records' own `meta` otherwise)."""
    by_step: dict[int, list] = {}
    for r in records:
        s = tool_analytics.record_step(r)
        if s is not None:
            by_step.setdefault(s, []).append(r)
    rows = []
    for s in sorted(by_step):
        recs = by_step[s]
        ms = [_prompt_meta(r, metas) for r in recs]
        row = {"step": s, "n": len(recs), **rate_intervals(recs, ms, ("difficulty",))}
        for prefix in [""] + sorted({f"difficulty={m.get('difficulty')}/" for m in ms}):
            idx = [i for i, m in enumerate(ms) if not prefix or f"difficulty={m.get('difficulty')}/" == prefix]
            sub = [recs[i] for i in idx]
            row[f"{prefix}accuracy"] = sum(bool(r.get("correct")) for r in sub) / len(sub)
            row[f"{prefix}tool_rate"] = sum(any(st in tool_analytics.EXECUTED for st in r.get("turn_status") or [])
                                            for r in sub) / len(sub)
        rows.append(row)
    return rows

def plot_step_rates(rows: Sequence[Mapping], path: str) -> str | None:
    """Accuracy and tool-call rate per GRPO step, easy and hard, with 95% bands; None without data."""
    if not rows:
        return None
    fig = Figure(figsize=(9, 3.6), dpi=100)
    FigureCanvasAgg(fig)
    drawn = False
    for k, (metric, title) in enumerate(STEP_RATES):
        ax = fig.add_subplot(1, len(STEP_RATES), k + 1)
        for prefix, label in (("difficulty=easy/", "easy"), ("difficulty=hard/", "hard"), ("", "all")):
            pts = [(r["step"], r[f"{prefix}{metric}"], to_interval(r.get(f"{prefix}{metric}_ci95"))) for r in rows
                   if to_float(r.get(f"{prefix}{metric}")) is not None and to_interval(r.get(f"{prefix}{metric}_ci95"))]
            if not pts:
                continue
            xs, ys, cis = zip(*pts, strict=True)
            line = ax.plot(xs, ys, label=label, marker="o" if len(xs) <= 30 else None, markersize=4,
                           linestyle="--" if not prefix else "-")[0]
            ax.fill_between(xs, [c[0] for c in cis], [c[1] for c in cis], color=line.get_color(), alpha=0.15)
            drawn = True
        ax.set_title(f"GRPO rollouts: {title}")
        ax.set_xlabel("step")
        ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    if not drawn:
        return None
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, format="png")
    return path

def plot_tool_use(curves: Sequence[Mapping], path: str) -> str | None:
    """What GRPO's executed cells do per step (`eval.tool_analytics.step_curves` rows): the share of
    cells showing each behaviour, and using a call not in the SFT data. A behaviour never seen is
    left out; None when nothing was seen."""
    keys = [(f"behaviour/{label}", label) for label, _ in tool_analytics.BEHAVIOURS]
    keys.append(("novel_cell_rate", "a call not in the SFT data"))
    data = [(label, *series(curves, k)) for k, label in keys]
    data = [d for d in data if d[1] and any(y > 0 for y in d[2])]
    if not data:
        return None
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
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, format="png")
    return path
