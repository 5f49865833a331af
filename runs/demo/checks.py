"""The demo report's checks: targets per evaluation, the adaptive-tool-use pair and issue 18's
GRPO-against-SFT effects (their rules are in `report.py`'s docstring)."""

from __future__ import annotations

from collections.abc import Mapping

from runs.demo.numbers import METRICS, fmt_diff, fmt_metric, fmt_p, to_float


def lookup(summary: Mapping, key: str):
    """A target key's value in a summary: the key itself, `overall_{metric}`, or `{value}_{metric}`
    where `value` is a breakdown value (`hard_accuracy` -> `difficulty=hard/accuracy`)."""
    if key in summary:
        return summary[key]
    for m in sorted(METRICS, key=len, reverse=True):
        if key == m or key.endswith("_" + m):
            scope = key[: -len(m)].rstrip("_")
            break
    else:
        return None
    if scope in ("", "overall", "all"):
        return summary.get(m)
    for k, v in summary.items():
        prefix, _, metric = k.rpartition("/")
        if metric == m and "," not in prefix and prefix.partition("=")[2] == scope:
            return v
    return None

def _threshold(spec) -> tuple[str, float]:
    if isinstance(spec, Mapping):
        if "max" in spec:
            return "<=", float(spec["max"])
        return ">=", float(spec["min"])
    return ">=", float(spec)

def check_targets(evals: Mapping[str, Mapping], targets: Mapping | None) -> dict:
    """{eval: {target: {value, op, threshold, met}}}; a missing/NaN value is not met."""
    out = {}
    for name, s in evals.items():
        res = {}
        for key, spec in (targets or {}).items():
            op, thr = _threshold(spec)
            v = to_float(lookup(s, key))
            met = v is not None and (v >= thr if op == ">=" else v <= thr)
            res[key] = {"value": v, "op": op, "threshold": thr, "met": bool(met)}
        out[name] = res
    return out

def adaptive_checks(evals: Mapping[str, Mapping], before: str = "sft", after: str = "grpo",
                    hard_tool_rate_min: float = 0.8) -> list[dict]:
    """The two adaptive-tool-use checks; `met` is None when an evaluation or a value is missing."""
    b, a = evals.get(before), evals.get(after)
    checks = []
    name_a = f"{after} does not lower accuracy vs {before}"
    name_b = (f"{after} lowers the tool-call rate on easy items vs {before}, "
              f"hard items stay >= {fmt_metric('tool_rate', hard_tool_rate_min)}")
    if b is None or a is None:
        why = f"not evaluated: needs evaluations named '{before}' and '{after}'"
        return [{"name": name_a, "met": None, "detail": why}, {"name": name_b, "met": None, "detail": why}]
    acc_b, acc_a = to_float(b.get("accuracy")), to_float(a.get("accuracy"))
    met = None if acc_b is None or acc_a is None else acc_a >= acc_b
    checks.append({
        "name": name_a, "met": met, "values": {before: acc_b, after: acc_a},
        "detail": f"accuracy {before} {fmt_metric('accuracy', acc_b)} -> {after} {fmt_metric('accuracy', acc_a)}",
    })
    easy_b, easy_a = to_float(lookup(b, "easy_tool_rate")), to_float(lookup(a, "easy_tool_rate"))
    hard_b, hard_a = to_float(lookup(b, "hard_tool_rate")), to_float(lookup(a, "hard_tool_rate"))
    if None in (easy_b, easy_a, hard_a):
        met = None
    else:
        met = easy_a < easy_b and hard_a >= hard_tool_rate_min
    checks.append({
        "name": name_b, "met": met,
        "values": {f"{before} easy": easy_b, f"{after} easy": easy_a, f"{before} hard": hard_b, f"{after} hard": hard_a},
        "detail": (f"easy tool-call rate {before} {fmt_metric('tool_rate', easy_b)} -> {after} "
                   f"{fmt_metric('tool_rate', easy_a)}; hard {before} {fmt_metric('tool_rate', hard_b)} -> {after} "
                   f"{fmt_metric('tool_rate', hard_a)} (needs >= {fmt_metric('tool_rate', hard_tool_rate_min)})"),
    })
    return checks

def effect_checks(evals: Mapping[str, Mapping], diffs: Mapping[str, Mapping], spec: Mapping | None,
                  before: str = "sft", after: str = "grpo", paired: Mapping[str, Mapping] | None = None) -> list[dict]:
    """Issue 18's targets for GRPO against SFT (`spec`: `accuracy_gain` (sampled and greedy, each with
    its interval above 0), `easy_tool_rate_ratio` (easy-item tool rate after <= ratio x before,
    greedy and sampled), `hard_tool_rate_min` (hard items' tool rate after, both), `cell_loss_max`
    (no family x difficulty cell loses more than this much greedy accuracy, item by item)); greedy
    accuracy and hard accuracy must not fall. The accuracy gain is judged on the paired interval where the
    pair was compared item by item (`paired`: `eval.intervals.paired_accuracy` per `{after} -
    {before}`; Tango's score interval for greedy, the bootstrap over items for sampled), else on
    Newcombe's. `met` is None where an evaluation or a value is missing."""
    if not spec:
        return []
    bs, as_ = f"{before}_sampled", f"{after}_sampled"
    sampled = diffs.get(f"{as_} - {bs}", {})
    greedy = diffs.get(f"{after} - {before}", {})
    out = []

    def add(name, met, detail):
        out.append({"name": name, "met": met, "detail": detail})

    gain = float(spec.get("accuracy_gain", 0.05))
    gains = {"sampled": float(spec.get("sampled_accuracy_gain", gain)), "greedy": gain}
    for label, b, a, pair in (("sampled", bs, as_, sampled), ("greedy", before, after, greedy)):
        g = gains[label]
        cell = ((paired or {}).get(f"{a} - {b}") or {}).get("groups", {}).get("all")
        if cell:
            diff, ci = cell["diff"], cell["paired_ci95"]
            how = f"paired interval, {cell['n_items']} items"
            if "mcnemar_p" in cell:
                how += f", McNemar p = {fmt_p(cell['mcnemar_p'])}"
        else:
            d = pair.get("accuracy") or {}
            diff, ci, how = d.get("diff"), d.get("ci95"), "Newcombe's interval"
        if g > 0:
            ok = None if diff is None or ci is None else bool(diff >= g and ci[0] > 0)
            name = f"{label} accuracy {a} >= {b} + {100 * g:.0f} pts, interval above 0"
        else:  # issue 47's demo: sampled accuracy up
            ok = None if diff is None else bool(diff > 0)
            name = f"{label} accuracy {a} above {b}"
        add(name, ok, f"{fmt_diff(diff, ci)} ({how})")
    if "accuracy_max" in spec:  # issue 47: the world leaves headroom; no saturation
        v = to_float(lookup(evals.get(after), "accuracy")) if evals.get(after) else None
        add(f"greedy accuracy {after} <= {fmt_metric('accuracy', float(spec['accuracy_max']))}",
            None if v is None else bool(v <= float(spec["accuracy_max"])), fmt_metric("accuracy", v))
    if "sft_easy_tool_rate_min" in spec:  # issue 47: the cold start over-calls tools on easy items
        v = to_float(lookup(evals.get(before), "easy_tool_rate")) if evals.get(before) else None
        thr = float(spec["sft_easy_tool_rate_min"])
        add(f"greedy easy-item tool-call rate {before} >= {fmt_metric('tool_rate', thr)}",
            None if v is None else bool(v >= thr), fmt_metric("tool_rate", v))
    if "turns_drop" in spec:  # issue 47: R_BAT cuts turns
        tb = to_float(lookup(evals.get(before), "avg_turns")) if evals.get(before) else None
        ta = to_float(lookup(evals.get(after), "avg_turns")) if evals.get(after) else None
        drop = float(spec["turns_drop"])
        add(f"greedy turns {after} <= {before} - {drop:.2f}",
            None if tb is None or ta is None else bool(ta <= tb - drop + 1e-9),
            "n/a" if tb is None or ta is None else f"{tb:.2f} -> {ta:.2f}")
    for pair, label in ((greedy, "greedy"), (sampled, "sampled")):
        for key in ("accuracy", "accuracy, hard"):
            d = pair.get(key) or {}
            ok = None if d.get("diff") is None else bool(d["diff"] >= 0)
            add(f"{label} {key} does not fall", ok, fmt_diff(d.get("diff"), d.get("ci95")))
    if "cell_loss_max" in spec:
        loss_max = float(spec["cell_loss_max"])
        groups = ((paired or {}).get(f"{after} - {before}") or {}).get("groups", {})
        cells = {k: g["diff"] for k, g in groups.items() if "," in k}
        worst = min(cells, key=cells.get) if cells else None
        add(f"greedy: no family x difficulty cell of {after} loses more than {100 * loss_max:.0f} pts",
            None if worst is None else bool(cells[worst] >= -loss_max - 1e-9),
            "not compared item by item" if worst is None else
            f"largest loss: {worst} {fmt_diff(cells[worst], groups[worst]['paired_ci95'])}")
    ratio = float(spec.get("easy_tool_rate_ratio", 0.5))
    hard_min = float(spec.get("hard_tool_rate_min", 0.9))
    for b, a, label in ((before, after, "greedy"), (bs, as_, "sampled")):
        eb, ea = evals.get(b), evals.get(a)
        vb = to_float(lookup(eb, "easy_tool_rate")) if eb else None
        va = to_float(lookup(ea, "easy_tool_rate")) if ea else None
        # A cold start that calls no tool on easy items leaves nothing to halve: not evaluated.
        ok = None if vb is None or va is None or vb == 0 else bool(va <= ratio * vb)
        add(f"{label} easy-item tool-call rate {a} <= {ratio:g} x {b}", ok,
            f"{fmt_metric('tool_rate', vb)} -> {fmt_metric('tool_rate', va)}"
            + (f" ({b} calls no tool on easy items)" if vb == 0 else ""))
        vh = to_float(lookup(ea, "hard_tool_rate")) if ea else None
        add(f"{label} hard-item tool-call rate {a} >= {fmt_metric('tool_rate', hard_min)}",
            None if vh is None else bool(vh >= hard_min), fmt_metric("tool_rate", vh))
    return out

def verdict(met) -> str:
    """A check's outcome in words: met, NOT met, or not evaluated (None)."""
    return "not evaluated" if met is None else ("met" if met else "NOT met")

def targets_table(results: dict, targets: Mapping | None) -> tuple[list[str], list[list[str]]]:
    header = ["target", "threshold"] + list(results)
    rows = []
    for key, spec in (targets or {}).items():
        op, thr = _threshold(spec)
        metric = next((m for m in sorted(METRICS, key=len, reverse=True) if key.endswith(m)), "")
        row = [key, f"{op} {fmt_metric(metric, thr)}"]
        for res in results.values():
            r = res[key]
            row.append(f"{fmt_metric(metric, r['value'])} {verdict(r['met'])}")
        rows.append(row)
    return header, rows
