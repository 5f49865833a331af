"""Table 3 of the paper on the toy world: which rows `launch.ablate` trains, and mean ± std over seeds.

A row is a reward variant (`RBATConfig.mode`); the R_BAT rows (`no_turn`, `full`) come once per
R_BAT preset asked for (`paper`, `release`), the others under the run config's preset. Every row
trains from the same SFT policy with the same steps, once per GRPO seed, and each run is evaluated
on the held-out split (greedy, and sampled when `eval.samples` > 0). The table gives each column's
mean ± sample std over the seeds (n = the number of seeds; a single seed shows the 95% interval
of its rate instead).
"""

from __future__ import annotations

import dataclasses
import math
import statistics

from runs.demo.numbers import fmt_ci

MODE_NAMES = {  # paper Table 3 rows, in its order
    "outcome": "GRPO (R_acc + R_format)",
    "tool_bonus": "DeepEyes-style tool reward",
    "no_turn": "R_BAT without R_turn",
    "full": "R_BAT (full)",
}
RBAT_MODES = ("no_turn", "full")  # the rows whose reward the R_BAT preset changes beyond the format term
COLUMNS = (  # (summary key, header): the paper's columns plus the tool-call rate on easy and hard items
    ("accuracy", "accuracy"),
    ("avg_turns", "avg turns"),
    ("exec_success", "exec success"),
    ("difficulty=easy/tool_rate", "tool rate easy"),
    ("difficulty=hard/tool_rate", "tool rate hard"),
    ("kl_to_sft", "KL to SFT"),
)
# KL(sampling policy || SFT) per sampled token at a run's last saved GRPO step (eval.drift, k3): set
# by `pipeline.ablate` on each run's greedy entry, so it shows that (and how far) a run moved.
DRIFT_COLUMN = "kl_to_sft"


@dataclasses.dataclass(frozen=True)
class Row:
    mode: str
    preset: str | None = None  # None: the run config's preset, not named in the row's key

    @property
    def key(self) -> str:
        return self.mode if self.preset is None else f"{self.mode}@{self.preset}"

    @property
    def label(self) -> str:
        return MODE_NAMES[self.mode] + ("" if self.preset is None else f", {self.preset} preset")


def rows(modes, presets=()) -> list[Row]:
    """One row per mode; the R_BAT modes once per preset in `presets` (none given: one row)."""
    unknown = [m for m in modes if m not in MODE_NAMES]
    if unknown:
        raise ValueError(f"unknown reward variants {unknown}; choose among {', '.join(MODE_NAMES)}")
    out = []
    for m in modes:
        if m in RBAT_MODES and presets:
            out += [Row(m, p) for p in presets]
        else:
            out.append(Row(m))
    return out


def run_name(row: Row, seed: int | None) -> str:
    """The folder of one run under WORKDIR/ablate (a single run without seeds keeps the mode's name)."""
    return row.key if seed is None else f"{row.key}/seed{seed}"


def aggregate(runs: list[dict]) -> dict:
    """Per column: mean, sample std (0 for one run), n and the values, over the runs' summaries."""
    out = {}
    for col, _ in COLUMNS:
        vals = [float(r[col]) for r in runs if isinstance(r.get(col), int | float) and math.isfinite(r[col])]
        if vals:
            out[col] = dict(mean=statistics.fmean(vals), std=statistics.stdev(vals) if len(vals) > 1 else 0.0,
                            n=len(vals), values=vals)
    return out


def _cell(col: str, runs: list[dict], agg: dict) -> str:
    if col == DRIFT_COLUMN:
        a = agg.get(col)
        return "n/a" if a is None else f"{a['mean']:.4f}" + (f" ± {a['std']:.4f}" if a["n"] > 1 else "")
    if len(runs) == 1:
        return fmt_ci(col.rpartition("/")[2] or col, runs[0].get(col, float("nan")), runs[0].get(f"{col}_ci95"))
    a = agg.get(col)
    if a is None:
        return "n/a"
    if col == "avg_turns":
        return f"{a['mean']:.2f} ± {a['std']:.2f}"
    return f"{100 * a['mean']:.1f} ± {100 * a['std']:.1f}%"


def markdown(entries: list[tuple[str, list[dict]]], *, title: str) -> str:
    """entries: (row label, the runs' summaries) in table order."""
    head = "| reward | runs | " + " | ".join(h for _, h in COLUMNS) + " |"
    lines = [f"# {title}", "", head, "|" + "---|" * (len(COLUMNS) + 2)]
    for label, runs in entries:
        agg = aggregate(runs)
        lines.append(f"| {label} | {len(runs)} | " + " | ".join(_cell(col, runs, agg) for col, _ in COLUMNS) + " |")
    lines += ["", "One run: the rate with its 95% interval. Several (seeds): mean ± sample std over them. "
              "KL to SFT: KL(sampling policy || SFT policy) per sampled token at the run's last saved GRPO step "
              "(eval.drift)."]
    return "\n".join(lines) + "\n"


__all__ = ["COLUMNS", "DRIFT_COLUMN", "MODE_NAMES", "RBAT_MODES", "Row", "aggregate", "markdown", "rows", "run_name"]
