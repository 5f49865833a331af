"""Issue 47's pre-registered predictions P1-P7, judged from the runs of `launch.ablate --worlds`.

The predictions are fixed here before any test-split run (their text is also in
benchmarks/results/table3_preregistered/PREDICTIONS.md, committed first). Every number is greedy, on
each world's test split (WORKDIR/world{s}/eval_sft and WORKDIR/world{s}/ablate/eval_{row}_seed{g}),
pooled over the paired runs (world x GRPO seed) unless a prediction says otherwise. The SFT row has
one run per world; a pooled SFT figure weighs each world as often as its GRPO runs do.

`judge` reads only files the ablation wrote (summary.json and trajectories.jsonl of each evaluation,
metrics.jsonl of each GRPO run), so it can be re-run on a committed copy of them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import statistics
from collections.abc import Sequence

from eval.intervals import wilson

PREDICTIONS = {
    "P1": "the cold start over-calls: SFT greedy easy tool rate >= 50%, SFT greedy turns >= 1.60, SFT accuracy 70-90%",
    "P2": "only R_BAT cuts turns: R_BAT turns <= SFT - 0.10; outcome-only turns >= SFT - 0.02; R_BAT easy tool rate "
          "<= 10% against outcome-only's >= 40%; hard tool rate >= 95% in both",
    "P3": "RL helps without saturating: outcome-only and R_BAT each >= SFT + 5 points (paired interval above 0 in "
          "every world, >= 8 of 9 runs positive); no row's mean above 97%",
    "P4": "the reward ordering: R_BAT - outcome-only >= +2 points, positive in >= 6 of 9 runs",
    "P5": "R_BAT learns the hard-item decision faster: the first training step with hard tool rate >= 90% comes "
          "earlier under R_BAT in >= 6 of 9 runs",
    "P6": "the mastered-hard penalty: R_BAT's hard tool rate within 3 points of outcome-only's",
    "P7": "no hidden damage: no family x difficulty cell's pooled greedy loss against SFT above 5 points "
          "(the probes reported with their intervals)",
}
CELLS = tuple(f"family={f},difficulty={d}" for f in ("count", "bars", "find") for d in ("easy", "hard"))
PROBES = ("yellow_easy_count", "color_kind_count", "touching")
HARD_TOOL_STEP_RATE = 0.9  # P5's threshold on a training step's hard-item tool rate


@dataclasses.dataclass
class Run:
    """One greedy evaluation (and, for a GRPO run, its training metrics)."""

    world: str
    seed: int | None
    summary: dict
    items: dict  # prompt id -> (correct 0/1, meta)
    steps: list  # metrics.jsonl rows ([] for SFT)
    probes: dict = dataclasses.field(default_factory=dict)  # the probes' items, as `items`

    def get(self, key: str) -> float:
        return float(self.summary[key])


def _read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


def load_run(eval_dir: str, run_dir: str | None, world: str, seed: int | None) -> Run:
    with open(os.path.join(eval_dir, "summary.json")) as f:
        summary = json.load(f)
    def items(d):
        return {r["prompt_id"]: (float(bool(r.get("correct"))), r.get("meta") or {})
                for r in _read_jsonl(os.path.join(d, "trajectories.jsonl"))}

    steps = _read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if run_dir else []
    return Run(world, seed, summary, items(eval_dir), steps, items(eval_dir + "_probes"))


def load(workdir: str, worlds: Sequence[int], seeds: Sequence[int], rows: Sequence[str] = ("outcome", "full")):
    """{"sft": {world: Run}, row: [Run per (world, seed)]} from `launch.ablate --worlds` output."""
    out: dict = {"sft": {}}
    for w in worlds:
        wd = os.path.join(workdir, f"world{w}")
        out["sft"][f"world{w}"] = load_run(os.path.join(wd, "eval_sft"), None, f"world{w}", None)
        for row in rows:
            for s in seeds:
                run = load_run(os.path.join(wd, "ablate", f"eval_{row}_seed{s}"),
                               os.path.join(wd, "ablate", row, f"seed{s}"), f"world{w}", s)
                out.setdefault(row, []).append(run)
    return out


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def pooled(runs: Sequence[Run], key: str) -> float:
    return _mean(r.get(key) for r in runs)


def sft_pooled(sft: dict, runs: Sequence[Run], key: str) -> float:
    """The SFT figure weighed as the paired runs weigh the worlds."""
    return _mean(sft[r.world].get(key) for r in runs)


def paired_gain(sft: dict, runs: Sequence[Run], world: str) -> tuple[float, float, float]:
    """Per item of `world`: mean over its runs of (run correct - SFT correct); the mean over items and
    its normal 95% interval."""
    rs = [r for r in runs if r.world == world]
    base = sft[world].items
    d = [_mean(r.items[i][0] for r in rs) - base[i][0] for i in base]
    m = _mean(d)
    sd = statistics.stdev(d) if len(d) > 1 else 0.0
    h = 1.96 * sd / math.sqrt(len(d))
    return m, m - h, m + h


def first_step(run: Run, key: str = "difficulty=hard/tool_rate", threshold: float = HARD_TOOL_STEP_RATE) -> float:
    """The first training step whose `key` is >= threshold (inf when none is)."""
    for row in run.steps:
        v = row.get(key)
        if v is not None and not (isinstance(v, float) and math.isnan(v)) and v >= threshold:
            return float(row["step"])
    return math.inf


def cell_acc(run: Run, cell: str) -> float:
    return run.get(f"{cell}/accuracy")


def probe_rate(runs: Sequence[Run], probe: str) -> tuple[float, int, tuple[float, float]]:
    """Accuracy on a probe's items pooled over `runs`: rate, items x runs, Wilson 95% interval."""
    hits = [c for r in runs for c, meta in (*r.items.values(), *r.probes.values()) if meta.get("probe") == probe]
    if not hits:
        return float("nan"), 0, (float("nan"), float("nan"))
    return _mean(hits), len(hits), wilson(sum(hits), len(hits))


WORLD_SOURCES = ("data/toyworld/tasks.py", "data/toyworld/expert.py", "data/toyworld/world.py",
                 "data/toyworld/tokenizer.py")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def digests(c, root: str | None = None) -> dict:
    """The frozen configuration's fingerprints: `world` (the world knobs of configs/demo.py and the
    generator's source files) and `recipe` (the SFT and GRPO run configs), seeds and paths left out,
    so every world seed and GRPO seed of one configuration has the same digests. How a policy is
    evaluated (greedy only, or also sampled) is not part of it: it trains nothing."""
    root = root or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def canon(d: dict) -> bytes:
        d = {k: v for k, v in d.items() if k != "seed"}
        return json.dumps(d, sort_keys=True, default=str).encode()

    src = b"".join(open(os.path.join(root, p), "rb").read() for p in WORLD_SOURCES)
    recipe = {k: {kk: vv for kk, vv in c[k].to_dict().items() if kk not in ("seed", "init_from")}
              for k in ("sft", "grpo")}
    return {"world": _sha(canon(c.world.to_dict()) + src), "recipe": _sha(canon(recipe))}


def _pct(x: float) -> str:
    return "n/a" if x != x else f"{100 * x:.1f}%"


def judge(data: dict, outcome: str = "outcome", rbat: str = "full") -> list[dict]:
    """P1-P7 from `load`'s data: per prediction its text, the measured figures and pass/fail."""
    sft, out, rb = data["sft"], data[outcome], data[rbat]
    worlds = sorted(sft)
    sft_runs = list(sft.values())
    v = []

    def add(pid, passed, measured):
        v.append({"id": pid, "prediction": PREDICTIONS[pid], "measured": measured, "passed": bool(passed)})

    easy_t, turns, acc = (pooled(sft_runs, k) for k in ("difficulty=easy/tool_rate", "avg_turns", "accuracy"))
    add("P1", easy_t >= 0.5 and turns >= 1.60 and 0.70 <= acc <= 0.90,
        f"SFT easy tool rate {_pct(easy_t)}, turns {turns:.2f}, accuracy {_pct(acc)} (mean of {len(sft_runs)} worlds)")

    t_sft = sft_pooled(sft, rb, "avg_turns")
    t_rb, t_out = pooled(rb, "avg_turns"), pooled(out, "avg_turns")
    e_rb, e_out = pooled(rb, "difficulty=easy/tool_rate"), pooled(out, "difficulty=easy/tool_rate")
    h_rb, h_out = pooled(rb, "difficulty=hard/tool_rate"), pooled(out, "difficulty=hard/tool_rate")
    add("P2", t_rb <= t_sft - 0.10 and t_out >= t_sft - 0.02 and e_rb <= 0.10 and e_out >= 0.40
        and h_rb >= 0.95 and h_out >= 0.95,
        f"turns SFT {t_sft:.2f}, R_BAT {t_rb:.2f}, outcome-only {t_out:.2f}; easy tool rate R_BAT {_pct(e_rb)}, "
        f"outcome-only {_pct(e_out)}; hard tool rate R_BAT {_pct(h_rb)}, outcome-only {_pct(h_out)}")

    parts, ok = [], True
    for name, runs in (("outcome-only", out), ("R_BAT", rb)):
        gain = pooled(runs, "accuracy") - sft_pooled(sft, runs, "accuracy")
        pos = sum(r.get("accuracy") > sft[r.world].get("accuracy") for r in runs)
        cis = [paired_gain(sft, runs, w) for w in worlds]
        ok &= gain >= 0.05 and all(lo > 0 for _, lo, _ in cis) and pos >= len(runs) - 1
        ci_text = ", ".join(f"{w} {100 * m:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]" for w, (m, lo, hi) in zip(worlds, cis))
        parts.append(f"{name} {100 * gain:+.1f} pts, {pos}/{len(runs)} runs positive, paired per world: {ci_text}")
    means = {"SFT": pooled(sft_runs, "accuracy"), "outcome-only": pooled(out, "accuracy"), "R_BAT": pooled(rb, "accuracy")}
    ok &= max(means.values()) <= 0.97
    parts.append("row means " + ", ".join(f"{k} {_pct(x)}" for k, x in means.items()))
    add("P3", ok, "; ".join(parts))

    pairs = {(r.world, r.seed): r for r in out}
    diffs = [r.get("accuracy") - pairs[r.world, r.seed].get("accuracy") for r in rb]
    pos = sum(d > 0 for d in diffs)
    sd = statistics.stdev(diffs) if len(diffs) > 1 else float("nan")
    need = "n/a" if not sd == sd else str(max(2, math.ceil((2.49 * sd / 0.013) ** 2)))
    add("P4", _mean(diffs) >= 0.02 and pos >= 6 * len(diffs) / 9,
        f"R_BAT - outcome-only {100 * _mean(diffs):+.1f} pts, positive in {pos}/{len(diffs)} runs "
        f"(ties {sum(d == 0 for d in diffs)}); sigma_d {100 * sd:.1f} pts, so resolving +1.3 pts "
        f"(one-sided 5%, power 80%) takes about {need} paired runs")

    firsts = [(first_step(r), first_step(pairs[r.world, r.seed])) for r in rb]
    earlier = sum(a < b for a, b in firsts)
    fmt = lambda x: "never" if x == math.inf else str(int(x))  # noqa: E731
    add("P5", earlier >= 6 * len(firsts) / 9,
        f"earlier under R_BAT in {earlier}/{len(firsts)} runs; first step R_BAT/outcome-only per run: "
        + ", ".join(f"{fmt(a)}/{fmt(b)}" for a, b in firsts))

    add("P6", abs(h_rb - h_out) <= 0.03,
        f"hard tool rate R_BAT {_pct(h_rb)} against outcome-only {_pct(h_out)} ({100 * (h_rb - h_out):+.1f} pts)")

    worst, parts = 0.0, []
    for name, runs in (("outcome-only", out), ("R_BAT", rb)):
        losses = {c: pooled(runs, f"{c}/accuracy") - sft_pooled(sft, runs, f"{c}/accuracy") for c in CELLS}
        c_min = min(losses, key=losses.get)
        worst = min(worst, losses[c_min])
        parts.append(f"{name} worst cell {c_min.replace('family=', '').replace(',difficulty=', '/')} "
                     f"{100 * losses[c_min]:+.1f} pts")
    probes = []
    for p in PROBES:
        cols = []
        for name, runs in (("SFT", sft_runs), ("outcome-only", out), ("R_BAT", rb)):
            rate, n, (lo, hi) = probe_rate(runs, p)
            cols.append(f"{name} {_pct(rate)} [{_pct(lo)}, {_pct(hi)}] (n={n})")
        probes.append(f"{p}: " + ", ".join(cols))
    add("P7", worst >= -0.05, "; ".join(parts) + ". Probes: " + "; ".join(probes))
    return v


def markdown(verdicts: list[dict]) -> str:
    lines = ["| | prediction | measured | verdict |", "|---|---|---|---|"]
    for x in verdicts:
        lines.append(f"| {x['id']} | {x['prediction']} | {x['measured']} | {'pass' if x['passed'] else '**fail**'} |")
    return "\n".join(lines) + "\n"
