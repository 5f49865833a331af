r"""The end-to-end demo on the toy world: world -> SFT -> eval -> GRPO (R_BAT) -> eval -> report.

  python -m launch.demo --workdir=/tmp/codedance_demo                     # ~15 min on 2 CPU cores
  python -m launch.demo --workdir=/tmp/demo_mini --config=configs/demo.py:mini   # seconds-scale (tests)

Sizes are data: override any field, e.g. --config.sft.steps=400 --config.grpo.mode=no_turn.
"""

import ml_collections


def get_config(preset: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.world = ml_collections.ConfigDict(dict(n_sft=1600, n_rl=400, n_eval=120, hard_frac=0.5, easy_code_rate=0.3, error_rate=0.1,
                                             workers=2, max_pixels=168 * 168))
    # SFT of the toy model from scratch (random init): AdamW, warmup + cosine (a constant 2e-3
    # diverged in a probe on this machine).
    c.sft = ml_collections.ConfigDict(dict(
        steps=600, batch_size=16, lr=1e-3, warmup_ratio=0.05,
        buckets=((96, 16, 4), (192, 32, 8), (256, 64, 16), (448, 64, 16)),
    ))
    # GRPO with R_BAT from the SFT policy. Group size and prompt count are sized so that a step
    # has groups with mixed outcomes (all-correct groups carry no signal).
    c.grpo = ml_collections.ConfigDict(dict(
        steps=6, prompts_per_step=8, group_size=8, lr=5e-5, temperature=1.0, mode="full", preset="paper",
        max_turns=3, max_turn_tokens=192, max_new_tokens=384, max_total_tokens=448,
        buckets=((256, 64, 16), (448, 96, 24)), grad_accum=1, sandbox_workers=2,
    ))
    c.eval = ml_collections.ConfigDict(dict(max_turns=3, batch=64, limit=0))
    c.targets = ml_collections.ConfigDict(dict(hard_accuracy=0.9, overall_accuracy=0.75))
    c.examples_per_group = 2

    if preset == "mini":  # for tests: every phase runs, nothing is expected to be learned
        c.world.update(n_sft=24, n_rl=16, n_eval=12)
        c.sft.update(steps=3, batch_size=8)
        c.grpo.update(steps=2, prompts_per_step=2, group_size=4, max_turn_tokens=48, max_new_tokens=96,
                      max_total_tokens=448, buckets=((384, 64, 16), (512, 96, 24)))
        c.eval.update(batch=16)
        c.examples_per_group = 1
    elif preset != "default":
        raise ValueError(f"unknown preset {preset!r}: default | mini")
    return c
