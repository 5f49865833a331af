"""The demo report's tables, as (header, rows) of strings, from the evaluations' summaries.

`codedance_jax.rl.scoring.summarize` keys: `accuracy`, `family=count/accuracy`,
`difficulty=hard/tool_rate`, `family=count,difficulty=hard/accuracy`, ..., with `{key}_ci95`
intervals where `eval.intervals.rate_intervals` added them. Families and difficulties are listed in
a fixed order (`FAMILY_ORDER`, `DIFFICULTY_ORDER`), any others after them, sorted. The paired
accuracy tables read `eval.intervals.paired_accuracy` results (groups under the same names).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from eval import tool_analytics
from eval.intervals import difference
from runs.demo.numbers import fmt_ci, fmt_diff, fmt_interval, fmt_metric, fmt_p, to_float, to_interval

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

Rows = tuple[list[str], list[list[str]]]


def ordered(values, order) -> list[str]:
    """`values` in `order`, then the others sorted."""
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
    return ordered(fams, FAMILY_ORDER), ordered(diffs, DIFFICULTY_ORDER)


def breakdown_prefixes(evals: Mapping[str, Mapping]) -> list[tuple[str, str, str]]:
    """(family, difficulty, summary key prefix) of every breakdown row: family x difficulty, then
    each difficulty over all families. Empty when no summary has a breakdown."""
    fams, diffs = _groups(evals)
    prefixes = []
    if fams and diffs:
        prefixes += [(f, d, f"family={f},difficulty={d}") for f in fams for d in diffs]
    elif fams:
        prefixes += [(f, "all", f"family={f}") for f in fams]
    prefixes += [("all", d, f"difficulty={d}") for d in diffs]
    return [(f, d, p) for f, d, p in prefixes if any(f"{p}/n" in s or f"{p}/accuracy" in s for s in evals.values())]


def eval_table(evals: Mapping[str, Mapping]) -> Rows:
    """One row per evaluation: its rates with their intervals, turns, calls and counts (the sampled
    evaluations' `items` and `samples / item` columns only where some evaluation has them)."""
    cols = [(k, label) for k, label in EVAL_COLUMNS
            if k not in ("n_items", "samples_per_item") or any(k in s for s in evals.values())]
    header = ["eval"] + [label for _, label in cols]
    rows = [[name] + [fmt_ci(k, s.get(k), s.get(f"{k}_ci95")) for k, _ in cols] for name, s in evals.items()]
    return header, rows


def rate_breakdown_table(evals: Mapping[str, Mapping], metric: str) -> Rows:
    """One rate per family x difficulty (rows) and evaluation (columns), with its 95% interval;
    the last row is the rate over all items. Accuracy and tool-call rate cells end with the
    number of items (`items x samples` for a sampled evaluation); execution success counts
    executions, whose number varies, so its cells do not."""
    header = ["family", "difficulty"] + list(evals)
    rows = []
    for fam, diff, p in breakdown_prefixes(evals) + [("all", "all", "")]:
        key = f"{p}/{metric}" if p else metric
        row = [fam, diff]
        for s in evals.values():
            cell = fmt_ci(metric, s.get(key), s.get(f"{key}_ci95"))
            n = to_float(s.get(f"{p}/n" if p else "n"))
            items, k = to_float(s.get(f"{p}/n_items" if p else "n_items")), to_float(s.get("samples_per_item"))
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
        vb, va = to_float(b.get(key)), to_float(a.get(key))
        cb, ca = to_interval(b.get(f"{key}_ci95")), to_interval(a.get(f"{key}_ci95"))
        d = None if vb is None or va is None else va - vb
        ci = list(difference(vb, cb, va, ca)) if d is not None and cb and ca else None
        out[label] = {"key": key, "before": vb, "after": va, "diff": d, "ci95": ci,
                      "excludes_0": None if ci is None else bool(ci[0] > 0 or ci[1] < 0)}
    return out


def comparison_pairs(evals: Mapping[str, Mapping], before: str, after: str) -> list[tuple[str, str]]:
    """(before, after) pairs present: greedy, then sampled."""
    pairs = [(before, after), (f"{before}_sampled", f"{after}_sampled")]
    return [(b, a) for b, a in pairs if b in evals and a in evals]


def breakdown_keys(evals: Mapping[str, Mapping]) -> tuple[str, ...]:
    """The metadata keys the summaries break down by (`family`, `difficulty`), for grouping
    per-item comparisons the same way."""
    fams, diffs = _groups(evals)
    return tuple(k for k, vals in (("family", fams), ("difficulty", diffs)) if vals)


def paired_table(paired: Mapping, before: str, after: str) -> Rows:
    """One `eval.intervals.paired_accuracy` result as rows: all items, then family x difficulty,
    then each difficulty; columns: items, both accuracies, the difference, the paired interval,
    (greedy) the discordant counts b / c and McNemar's exact p, and Newcombe's interval."""
    groups = paired.get("groups") or {}
    greedy = any("mcnemar_p" in g for g in groups.values())
    header = ["family", "difficulty", "items", before, after, "difference",
              "paired 95% interval" + ("" if greedy else " (bootstrap)")]
    header += (["b / c", "McNemar p"] if greedy else []) + ["Newcombe 95% interval"]
    order = [("all", "all", "all")] + breakdown_prefixes({"": {f"{g}/n": 1 for g in groups if g != "all"}})
    rows = []
    for fam, diff, g in order:
        cell = groups.get(g)
        if not cell:
            continue
        row = [fam, diff, str(cell["n_items"]), fmt_metric("accuracy", cell["before"]),
               fmt_metric("accuracy", cell["after"]), fmt_diff(cell["diff"], None), fmt_interval(cell["paired_ci95"])]
        if greedy:
            row += [f"{cell['b']} / {cell['c']}", fmt_p(cell["mcnemar_p"])]
        rows.append(row + [fmt_interval(cell["newcombe_ci95"])])
    return header, rows


def differences_table(diffs: Mapping[str, Mapping]) -> Rows:
    """One row per DIFF_KEYS rate, one column per pair (`{after} - {before}`)."""
    header = ["rate"] + list(diffs)
    labels = [label for _, label in DIFF_KEYS]
    rows = [[label] + [fmt_diff(d[label]["diff"], d[label]["ci95"]) for d in diffs.values()] for label in labels]
    return header, rows


def _pct(v) -> str:
    f = to_float(v)
    return "n/a" if f is None else f"{100 * f:.0f}%"


def tool_use_table(analytics: Mapping[str, Mapping]) -> Rows:
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


def drift_table(drift: Sequence[Mapping]) -> Rows:
    """`eval.drift.policy_drift` rows: KL of GRPO's sampling policy from the SFT policy per step."""
    return (["step", "KL (k3)", "KL (k1)", "sampled tokens", "trajectories"],
            [[str(r["step"]), f"{r['kl_k3']:.4f}", f"{r['kl_k1']:.4f}", str(r["tokens"]), str(r["trajectories"])]
             for r in drift])


def timings_table(timings: Mapping[str, float]) -> Rows:
    """Seconds and minutes per phase, then the total (a phase without a number counts 0)."""
    rows = [[k, fmt_metric("s", v), fmt_metric("s", to_float(v) / 60 if to_float(v) is not None else None)]
            for k, v in timings.items()]
    if timings:
        total = sum(to_float(v) or 0.0 for v in timings.values())
        rows.append(["total", f"{total:.2f}", f"{total / 60:.2f}"])
    return ["phase", "seconds", "minutes"], rows
