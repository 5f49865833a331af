"""Named GRPO recipe variants: one table of config overrides, each a row of `launch.ablate --variants`.

A variant is a set of overrides of the GRPO run config (configs/grpo.py documents each field with
its paper and symbols), applied on top of the ablation's config; its R_BAT mode is the config's
(`full` unless overridden), so `--modes=full --variants=drgrpo,dapo` compares each variant with the
paper's recipe trained from the same SFT policy and seeds. An override's value may be a function of
the GRPO config (for sizes that follow the rollout budget).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import ml_collections


def _budget_fraction(frac: float) -> Callable[[ml_collections.ConfigDict], int]:
    """A token count as a fraction of the rollout budget (DAPO: L_cache = 4096 of L_max = 20480)."""
    return lambda g: max(1, int(int(g.rollout.max_new_tokens) * frac))


@dataclasses.dataclass(frozen=True)
class Variant:
    label: str
    source: str  # the paper or release it comes from
    overrides: dict[str, Any]  # dotted field of the GRPO config -> value, or a function of that config


VARIANTS: dict[str, Variant] = {
    "drgrpo": Variant("Dr. GRPO (no std in A_seq, constant normaliser L)", "Liu et al. 2025",
                      {"rbat.seq_norm": "none", "loss.aggregation": "seq_sum_norm"}),
    "dapo": Variant("DAPO (clip-higher, token mean, overlong shaping, dynamic sampling)", "Yu et al. 2025",
                    {"loss.clip_eps_low": 0.2, "loss.clip_eps_high": 0.28, "loss.aggregation": "token_mean",
                     "rbat.overlong_cache": _budget_fraction(0.2), "filter.groups": "acc"}),
    "dynamic_sampling": Variant("dynamic sampling only (no-contrast groups dropped)", "Yu et al. 2025",
                                {"filter.groups": "acc"}),
    "overlong": Variant("overlong shaping only (L_cache = 20% of the budget)", "Yu et al. 2025",
                        {"rbat.overlong_cache": _budget_fraction(0.2)}),
    "gspo": Variant("GSPO (sequence ratio, token advantages)", "Zheng et al. 2025",
                    {"loss.ratio": "sequence", "loss.clip_eps_low": 3e-4, "loss.clip_eps_high": 4e-4}),
    "mask_truncated": Variant("truncated / over-turn trajectories masked", "Mini-o3, Lai et al. 2025",
                              {"filter.mask_truncated": True}),
    "turn_all": Variant("R_turn statistics over all turns", "CodeDance appendix reading",
                        {"rbat.turn_stats": "all"}),
    "turn_loo": Variant("R_turn per-turn leave-one-out baseline", "benchmarks/results/rturn_bias",
                        {"rbat.turn_stats": "all", "rbat.turn_baseline": "turn_loo"}),
    "mastered_direct": Variant("R_BAT's d(mu) < 0 only where direct answers are all right (rbat.mastered)",
                               "issue 47, P6", {"rbat.mastered": "direct"}),
    "kl": Variant("k3 KL to the SFT policy (beta 0.001)", "verl's low_var_kl default",
                  {"loss.kl_coef": 0.001}),
    "filter_pass": Variant("RL prompts the SFT policy sometimes solves (0 < pass < 8)", "CodeDance release",
                           {"data.filter_pass": (0.0, 1.0), "data.filter_samples": 8}),
    "no_warmup": Variant("no learning-rate warm-up (the demo's default warms up over 10% of the steps)",
                         "the demo's recipe before 2026-12-06", {"optim.warmup_ratio": 0.0}),
}


@dataclasses.dataclass(frozen=True)
class VariantRow:
    """A row of the ablation table for a variant (the duck type of `table3.Row`)."""

    variant: str
    mode: str | None = None  # None: the config's R_BAT mode
    preset: str | None = None

    @property
    def key(self) -> str:
        return self.variant

    @property
    def label(self) -> str:
        return VARIANTS[self.variant].label


def rows(names) -> list[VariantRow]:
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown recipe variants {unknown}; choose among {', '.join(VARIANTS)}")
    return [VariantRow(n) for n in names]


def apply(g: ml_collections.ConfigDict, name: str) -> ml_collections.ConfigDict:
    """The GRPO config `g` with variant `name`'s overrides (in place; returned for chaining)."""
    for path, value in VARIANTS[name].overrides.items():
        node, _, leaf = path.rpartition(".")
        target = g
        for part in node.split(".") if node else ():
            target = target[part]
        if leaf not in target:
            raise KeyError(f"variant {name!r}: the GRPO config has no field {path!r}")
        target[leaf] = value(g) if callable(value) else value
    return g


__all__ = ["VARIANTS", "Variant", "VariantRow", "apply", "rows"]
