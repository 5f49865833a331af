"""The run summary: the columns of the paper's Table 3 (accuracy, average turns, execution success
rate) for our run, with the paper's accuracy numbers (SPEC section 7) beside them.

- accuracy (rule): VLMEvalKit's rule verdicts, items it would hand to a judge counted wrong
  (VLMEvalKit's `exact_matching` mode); `deferred` says how many those were.
- accuracy (rule + judge): the judge's verdict on deferred items (only when a judge ran).
- accuracy (strict): our stricter scorer (eval.scoring.strict_score).
- headline: the benchmark's reported number where VLMEvalKit aggregates differently from a mean:
  HRBench = mean over `cycle_category` of each cycle's accuracy; WeMath = four-dimensional
  "Score (Strict)" = (N - 0.5 IG - RM_strict - IK) / N over the 2- and 3-step problem groups
  (VLMEvalKit hard-codes N = 525, the testmini group count; here N is the number of groups present).
  It uses the final verdict (rule, or judge where it ran).
- average turns: assistant turns per trajectory; execution success rate: executions with status
  "ok" / tool calls (a malformed code block or an unavailable sandbox counts as a failed call).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict

from eval.benchmarks import get_benchmark


def _mean(xs) -> float | None:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else None


def wemath_scores(records: list[dict]) -> dict | None:
    groups: dict[tuple[str, str], dict[str, int]] = defaultdict(dict)
    for r in records:
        key, gid = str(r.get("key") or ""), r.get("ID")
        if gid is None or "steps" not in key:
            continue
        steps, part = key.split("steps_", 1) if "steps_" in key else (key, "")
        groups[(steps, str(gid))][part] = int(r["score"])
    counts = dict(IG=0, IK=0, CM_strict=0, CM_loose=0, RM_strict=0, RM_loose=0)
    n = 0
    for (steps, _), parts in groups.items():
        k = int(steps)
        singles = [parts.get(str(i)) for i in range(1, k + 1)]
        if "multi" not in parts or any(s is None for s in singles):
            continue
        n += 1
        multi, all_ok, any_ok = parts["multi"], all(singles), any(singles)
        if multi:
            counts["CM_strict"] += all_ok
            counts["CM_loose"] += any_ok
            counts["RM_strict"] += not all_ok
            counts["RM_loose"] += not any_ok
        else:
            counts["IG"] += all_ok
            counts["IK"] += not all_ok
    if not n:
        return None
    score = lambda rm: 100.0 * (n - 0.5 * counts["IG"] - counts[rm] - counts["IK"]) / n
    return dict(groups=n, score_strict=score("RM_strict"), score_loose=score("RM_loose"), **counts)


def summarize(benchmark: str, records: list[dict], judge_used: bool = False) -> dict:
    bench = get_benchmark(benchmark)
    n = len(records)
    calls = sum(r["num_tool_calls"] for r in records)
    s = dict(
        benchmark=benchmark,
        paper_name=bench.paper_name,
        items=n,
        accuracy_rule=_pct(_mean(r["hit"] for r in records)),
        deferred=sum(r["rule_verdict"] == "deferred" for r in records),
        accuracy_rule_judge=_pct(_mean(r["score"] for r in records)) if judge_used else None,
        accuracy_strict=_pct(_mean(r["strict_hit"] for r in records)),
        avg_turns=_mean(r["num_turns"] for r in records),
        tool_calls=calls,
        exec_success_rate=_pct(sum(r["exec_ok"] for r in records) / calls) if calls else None,
        paper_codedance_7b=bench.paper[0],
        paper_qwen25vl_7b=bench.paper[1],
    )
    headline, how = s["accuracy_rule_judge"] if judge_used else s["accuracy_rule"], "mean"
    if benchmark.startswith("HRBench") and records and all("cycle_category" in r for r in records):
        by = defaultdict(list)
        for r in records:
            by[str(r["cycle_category"])].append(r["score"])
        headline, how = _pct(_mean(_mean(v) for v in by.values())), "mean over cycle_category"
    if benchmark == "WeMath":
        w = wemath_scores(records)
        if w:
            s["wemath"] = w
            headline, how = w["score_strict"], "four-dimensional Score (Strict)"
    s.update(headline=headline, headline_metric=how)
    return s


def _pct(x):
    return None if x is None else 100.0 * x


def format_value(v, nd=1):
    return "—" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


TABLE_COLUMNS = [
    ("benchmark", "benchmark"),
    ("items", "items"),
    ("headline", "ours"),
    ("accuracy_rule", "accuracy (rule)"),
    ("deferred", "deferred to judge"),
    ("accuracy_rule_judge", "rule + judge"),
    ("accuracy_strict", "strict"),
    ("avg_turns", "avg turns"),
    ("exec_success_rate", "exec success %"),
    ("paper_codedance_7b", "paper CodeDance-7B"),
    ("paper_qwen25vl_7b", "paper Qwen2.5-VL-7B"),
]


def markdown_table(summaries: list[dict]) -> str:
    lines = ["| " + " | ".join(h for _, h in TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    for s in summaries:
        lines.append("| " + " | ".join(format_value(s.get(k), 2 if k == "avg_turns" else 1) for k, _ in TABLE_COLUMNS) + " |")
    return "\n".join(lines)


def write_summary(benchmark: str, records: list[dict], workdir: str, judge_used: bool = False) -> dict:
    s = summarize(benchmark, records, judge_used)
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(s, f, indent=2)
    note = (
        f"\n\n'ours' is the {s['headline_metric']} of the final verdicts; 'accuracy (rule)' is VLMEvalKit's "
        f"rule-based score with deferred items counted wrong. Paper numbers: SPEC section 7.\n"
    )
    with open(os.path.join(workdir, "summary.md"), "w") as f:
        f.write(markdown_table([s]) + note)
    return s
