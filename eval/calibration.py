"""Does a cold-start policy leave RL something to fix? Per cell, greedy beside sampled behaviour.

RL with group-relative advantages fixes fast what the policy already does *sometimes*: a cell
(family x difficulty) where greedy decoding is wrong while some sampled paths are right. `cells`
reads a greedy and a sampled evaluation of the same items (`trajectories.jsonl` records: `prompt_id`,
`correct`, `num_tool_calls`, `meta`) and gives, per cell and overall:

    n_items, greedy_acc, greedy_tool_rate,
    sampled_acc, pass_at_k (share of items with >= 1 right draw of k), k,
    sampled_tool_rate, acc_with_code / acc_without_code (sampled draws that called a tool or not,
    NaN where there were none), gap = pass_at_k - greedy_acc.

`learnable(row)` is the calibration criterion of the demo's world (WORKSPACE.md, "The world's
calibration"): greedy mostly wrong on the cell while the sampled code paths there are mostly right,
and the right answers are reachable (pass@k well above greedy).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping, Sequence
from typing import Any

KEYS = ("family", "difficulty")


def _get(r, k, default=None):
    return r.get(k, default) if isinstance(r, Mapping) else getattr(r, k, default)


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else math.nan


def cells(greedy: Sequence[Any], sampled: Sequence[Any], keys: Sequence[str] = KEYS) -> dict[str, dict]:
    """{"all": row, "family=find,difficulty=hard": row, ...} (module doc); items in both evaluations only."""
    g = {str(_get(r, "prompt_id")): r for r in greedy}
    s: dict[str, list] = collections.defaultdict(list)
    for r in sampled:
        s[str(_get(r, "prompt_id"))].append(r)
    from codedance_jax.rl.scoring import metadata_groups  # here: scoring imports JAX (rbat)

    ids = [i for i in g if i in s]
    groups: dict[str, list[str]] = {"all": ids}
    # The cells under the names the rest of the evaluation uses (the keys' combination).
    for name, idx in metadata_groups([_get(g[i], "meta") or {} for i in ids], keys).items():
        if len(keys) == 1 or "," in name:
            groups[name] = [ids[j] for j in idx]
    out = {}
    for name, members in groups.items():
        draws = [d for i in members for d in s[i]]
        code = [bool(_get(d, "correct")) for d in draws if _get(d, "num_tool_calls", 0) > 0]
        direct = [bool(_get(d, "correct")) for d in draws if _get(d, "num_tool_calls", 0) == 0]
        row = {
            "n_items": len(members),
            "greedy_acc": _mean(bool(_get(g[i], "correct")) for i in members),
            "greedy_tool_rate": _mean(_get(g[i], "num_tool_calls", 0) > 0 for i in members),
            "sampled_acc": _mean(bool(_get(d, "correct")) for d in draws),
            "pass_at_k": _mean(any(bool(_get(d, "correct")) for d in s[i]) for i in members),
            "k": min((len(s[i]) for i in members), default=0),
            "sampled_tool_rate": _mean(_get(d, "num_tool_calls", 0) > 0 for d in draws),
            "acc_with_code": _mean(code),
            "acc_without_code": _mean(direct),
        }
        row["gap"] = row["pass_at_k"] - row["greedy_acc"]
        out[name] = row
    return out


def learnable(row: Mapping, *, greedy_max: float = 0.5, code_min: float = 0.7, gap_min: float = 0.25) -> bool:
    """A cell RL can fix: greedy accuracy <= greedy_max, sampled code paths right >= code_min of the
    time, and pass@k at least gap_min above greedy."""
    code = row["acc_with_code"]
    return row["greedy_acc"] <= greedy_max and not math.isnan(code) and code >= code_min and row["gap"] >= gap_min


def markdown(table: Mapping[str, Mapping]) -> str:
    """The cells as a Markdown table (rates in %), the learnable ones marked."""
    cols = ("greedy_acc", "greedy_tool_rate", "sampled_acc", "pass_at_k", "sampled_tool_rate", "acc_with_code",
            "acc_without_code")
    k = table["all"]["k"] if "all" in table else 0
    head = ["cell", "items", "greedy acc", "greedy tool", "sampled acc", f"pass@{k}", "sampled tool",
            "acc with code", "acc without code", "RL can fix"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in table.items():
        vals = ["-" if math.isnan(row[c]) else f"{100 * row[c]:.1f}" for c in cols]
        lines.append(f"| {name} | {row['n_items']} | " + " | ".join(vals) + f" | {'yes' if learnable(row) else ''} |")
    return "\n".join(lines) + "\n"
