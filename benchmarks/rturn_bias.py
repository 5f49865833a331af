"""Is R_turn's normalisation an unbiased policy-gradient signal? An exact study on a two-turn bandit.

    .venv/bin/python benchmarks/rturn_bias.py [--n 8 32] [--out benchmarks/results/rturn_bias/rturn_bias.json]

The bandit. At turn 0 the policy π = softmax(θ) picks one of three actions:
  answer     answer at once: 1 turn, no tool call, r^0 = 0;
  code_ok    a tool call that runs (r^0 = 0), then the answer at turn 1 (forced, r^1 = 0);
  code_fail  a tool call that fails (r^0 = −0.5), then the answer at turn 1.
R_turn's objective is J(θ) = E[R^0] = −0.5·π_fail (turn 1 is forced: no decision, no gradient), the
true advantage of an action is A(a) = R^0(a) − J, and the exact policy gradient is
∇_θ J = Σ_a π_a ∇log π_a A(a) = π ⊙ A (softmax logits).

An estimator is the R_BAT kernel's A_turn^0 (`rbat_advantages`, mode "full", a batch of N i.i.d.
trajectories): ĝ = 1/N Σ_i ∇log π(a_i) Â_i with ∇log π(a) = e_a − π. Its expectation is computed
exactly, by enumerating every composition (n_answer, n_ok, n_fail) of the batch with its
multinomial probability, and compared with ∇J: `cos` is the cosine between E[ĝ] and ∇J (1 = unbiased
in direction; σ-normalisations rescale the gradient, so direction is what can be compared), and
`E[Â|a]` is the mean advantage the estimator gives action a (the true A(a) up to scale, if unbiased).

With two return levels, any estimator that gives the two zero-return actions the same mean
advantage is parallel to ∇J, so a second bandit adds a decision at turn 1: after a tool call the
policy (its own softmax π_1) answers, or calls a tool that runs or fails, then answers (turn 2,
forced); 1 to 3 turns, four return levels at turn 0 (R^0 = r^0 + β R^1, β = 0.2). Its reference is
E[Σ_m ∇log π_m(a_m) R^m], the turn-level gradient without a baseline, and `cos` is reported per
decision turn and over both (a scale that differs between turn indices tilts the latter).

Estimators: the two presets with R_turn's statistics over tool turns (SPEC [decided], the default)
or over all turns (`turn_stats="all"`), and with the batch baseline or the leave-one-out one
(`turn_baseline="turn_loo"`). Prints Markdown tables and writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from codedance_jax.rl import RBATConfig, rbat_advantages  # noqa: E402

ACTIONS = ("answer", "code_ok", "code_fail")
CODE = {"A": 0, "O": 1, "F": 2}  # a turn: A = answer (no code), O = a tool call that runs, F = one that fails
RETURN = np.array([0.0, 0.0, -0.5])  # R^0 of each turn-0 action in the two-turn bandit


@dataclasses.dataclass(frozen=True)
class Bandit:
    """Trajectories as strings of turns; the policy decides turns 0 .. decisions − 1 (one softmax
    per turn index), the turn after the last decision is a forced answer."""

    name: str
    decisions: int
    types: tuple[str, ...]

    @property
    def max_turns(self) -> int:
        return self.decisions + 1


TWO_TURN = Bandit("two_turn", 1, ("A", "OA", "FA"))
THREE_TURN = Bandit("three_turn", 2, ("A", "OA", "FA", "OOA", "OFA", "FOA", "FFA"))
SETTINGS = ((0.5, 0.3, 0.2), (0.2, 0.6, 0.2), (0.6, 0.1, 0.3), (0.1, 0.45, 0.45))
THREE_TURN_SETTINGS = (((0.5, 0.3, 0.2), (0.3, 0.3, 0.4)), ((0.2, 0.5, 0.3), (0.6, 0.3, 0.1)))
ESTIMATORS = {
    "paper, tool turns, batch (default)": RBATConfig.paper(),
    "paper, all turns, batch": RBATConfig.paper(turn_stats="all"),
    "paper, tool turns, turn_loo": RBATConfig.paper(turn_baseline="turn_loo"),
    "paper, all turns, turn_loo": RBATConfig.paper(turn_stats="all", turn_baseline="turn_loo"),
    "release, tool turns, batch (release default)": RBATConfig.release(),
    "release, all turns, batch": RBATConfig.release(turn_stats="all"),
    "release, all turns, turn_loo": RBATConfig.release(turn_stats="all", turn_baseline="turn_loo"),
}


def compositions(n: int, k: int = 3):
    """Every tuple of k counts summing to n."""
    if k == 1:
        yield (n,)
        return
    for first in range(n + 1):
        for rest in compositions(n - first, k - 1):
            yield (first, *rest)


def multinomial(counts, probs) -> float:
    n = sum(counts)
    coef = math.factorial(n) / math.prod(math.factorial(c) for c in counts)
    return coef * math.prod(p**c for p, c in zip(probs, counts, strict=True))


def type_prob(bandit: Bandit, t: str, pis) -> float:
    return math.prod(pis[m][CODE[t[m]]] for m in range(min(len(t), bandit.decisions)))


def turn_returns(t: str, beta: float = 0.2) -> list[float]:
    """R^m = r^m + β R^{m+1}, r^m = −0.5 on a failed tool call (the paper's eq. 2)."""
    out, nxt = [0.0] * len(t), 0.0
    for m in reversed(range(len(t))):
        out[m] = (-0.5 if t[m] == "F" else 0.0) + beta * nxt
        nxt = out[m]
    return out


def batch_arrays(bandit: Bandit, types: list[str]):
    """The kernel's inputs for a batch of trajectories given as turn strings."""
    n, m = len(types), bandit.max_turns
    is_tool, failed, valid = (np.zeros((n, m), bool) for _ in range(3))
    for i, t in enumerate(types):
        for k, c in enumerate(t):
            valid[i, k], is_tool[i, k], failed[i, k] = True, c in "OF", c == "F"
    return is_tool, failed, valid


def batch_advantages(cfg: RBATConfig, bandit: Bandit, types: list[str]) -> np.ndarray:
    """Â [N, M] of a batch, from the kernel."""
    is_tool, failed, valid = batch_arrays(bandit, types)
    n = len(types)
    _, a_turn = rbat_advantages(np.zeros(n, np.float32), np.ones(n, bool), is_tool, failed, group_size=n,
                                cfg=cfg, turn_valid=valid)
    return np.asarray(a_turn, np.float64)


def score(bandit: Bandit, t: str, adv, pis) -> np.ndarray:
    """Σ_m ∇_θ log π_m(a_m) · adv[m] over the decision turns: [decisions, 3] (softmax logits θ_m)."""
    g = np.zeros((bandit.decisions, 3))
    for m in range(min(len(t), bandit.decisions)):
        g[m] = (np.eye(3)[CODE[t[m]]] - np.asarray(pis[m])) * adv[m]
    return g


def reference_gradient(bandit: Bandit, pis) -> np.ndarray:
    """E[Σ_m ∇log π_m(a_m) R^m]: the expected turn-level policy gradient without a baseline, [decisions, 3].
    A baseline is unbiased when its estimator's expectation is parallel to this (per turn index)."""
    return sum(type_prob(bandit, t, pis) * score(bandit, t, turn_returns(t), pis) for t in bandit.types)


def true_gradient(pi) -> np.ndarray:
    """Two-turn bandit: ∇_θ J of J = E[R^0] = π·R^0, i.e. π ⊙ (R^0 − J)."""
    pi = np.asarray(pi, np.float64)
    return pi * (RETURN - float(pi @ RETURN))


def expected(cfg: RBATConfig, pi_or_pis, n: int, bandit: Bandit = TWO_TURN) -> dict:
    """E[ĝ] ([decisions, 3]; flat for the two-turn bandit) and E[Â^0 | turn-0 action], by enumerating
    every batch composition of n trajectories."""
    pis = (pi_or_pis,) if bandit.decisions == 1 else pi_or_pis
    probs = [type_prob(bandit, t, pis) for t in bandit.types]
    grad = np.zeros((bandit.decisions, 3))
    adv0 = np.zeros(3)  # E[Σ_i 1{a_i^0 = a} Â_i^0]
    total_p = 0.0
    for counts in compositions(n, len(bandit.types)):
        p = multinomial(counts, probs)
        if p == 0.0:
            continue
        types = [t for t, c in zip(bandit.types, counts, strict=True) for _ in range(c)]
        adv = batch_advantages(cfg, bandit, types)
        for i, t in enumerate(types):
            grad += p * score(bandit, t, adv[i], pis) / n
            adv0[CODE[t[0]]] += p * adv[i, 0]
        total_p += p
    return {"grad": grad[0] if bandit.decisions == 1 else grad, "cond_adv": adv0 / (n * np.asarray(pis[0])),
            "total_p": total_p}


def cosine(u, v) -> float:
    u, v = np.ravel(u), np.ravel(v)
    nu, nv = np.linalg.norm(u), np.linalg.norm(v)
    return float(u @ v / (nu * nv)) if nu > 0 and nv > 0 else float("nan")


def _angle(c: float):
    return math.degrees(math.acos(min(1.0, max(-1.0, c)))) if math.isfinite(c) else None


def study(ns=(8, 32), settings=SETTINGS, estimators=None) -> list[dict]:
    """The two-turn bandit: per batch size, policy and estimator."""
    estimators = ESTIMATORS if estimators is None else estimators
    rows = []
    for n in ns:
        for pi in settings:
            g_true = true_gradient(pi)
            j = float(np.asarray(pi) @ RETURN)
            rows.append({"n": n, "pi": list(pi), "estimator": "true advantage A(a) = R^0(a) − J",
                         "cond_adv": list(RETURN - j), "cos": 1.0, "angle_deg": 0.0,
                         "answer_share": float(g_true[0] / np.linalg.norm(g_true))})
            for name, cfg in estimators.items():
                e = expected(cfg, pi, n)
                c = cosine(e["grad"], g_true)
                rows.append({"n": n, "pi": list(pi), "estimator": name, "cfg": dataclasses.asdict(cfg),
                             "cond_adv": list(e["cond_adv"]), "grad": list(e["grad"]), "cos": c,
                             "angle_deg": _angle(c), "answer_share": float(e["grad"][0] / np.linalg.norm(e["grad"]))})
    return rows


def study_three_turn(n: int = 6, settings=THREE_TURN_SETTINGS, estimators=None) -> list[dict]:
    """The three-turn bandit: cosines per decision turn and over both."""
    estimators = ESTIMATORS if estimators is None else estimators
    rows = []
    for pis in settings:
        ref = reference_gradient(THREE_TURN, pis)
        for name, cfg in estimators.items():
            g = expected(cfg, pis, n, THREE_TURN)["grad"]
            cos = [cosine(g[m], ref[m]) for m in range(2)] + [cosine(g, ref)]
            rows.append({"n": n, "pis": [list(p) for p in pis], "estimator": name, "grad": g.tolist(),
                         "reference": ref.tolist(), "cos_turn0": cos[0], "cos_turn1": cos[1], "cos": cos[2],
                         "angle_deg": [_angle(c) for c in cos]})
    return rows


def markdown(rows) -> str:
    lines = ["| N | π (answer, ok, fail) | estimator | E[Â\\|answer] | E[Â\\|code ok] | E[Â\\|code fails] | "
             "cos(E ĝ, ∇J) | angle | ĝ_answer / \\|ĝ\\| |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        angle = "n/a" if r["angle_deg"] is None else f"{r['angle_deg']:.1f}°"
        lines.append(f"| {r['n']} | {', '.join(f'{p:g}' for p in r['pi'])} | {r['estimator']} | "
                     + " | ".join(f"{x:+.3f}" for x in r["cond_adv"])
                     + f" | {r['cos']:.4f} | {angle} | {r['answer_share']:+.3f} |")
    return "\n".join(lines) + "\n"


def markdown_three_turn(rows) -> str:
    lines = ["| N | π_0; π_1 (answer, ok, fail) | estimator | cos turn 0 | cos turn 1 | cos (both) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        pis = "; ".join(", ".join(f"{p:g}" for p in pi) for pi in r["pis"])
        lines.append(f"| {r['n']} | {pis} | {r['estimator']} | {r['cos_turn0']:.4f} | {r['cos_turn1']:.4f} | "
                     f"{r['cos']:.4f} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[8, 32], help="two-turn bandit: batch sizes (trajectories)")
    ap.add_argument("--n3", type=int, default=6, help="three-turn bandit: batch size")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "rturn_bias",
                                                  "rturn_bias.json"))
    args = ap.parse_args()
    rows = study(tuple(args.n))
    print("Two-turn bandit\n")
    print(markdown(rows))
    three = study_three_turn(args.n3)
    print("Three-turn bandit (a second decision at turn 1)\n")
    print(markdown_three_turn(three))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"actions": ACTIONS, "returns": RETURN.tolist(), "two_turn": rows, "three_turn": three}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
