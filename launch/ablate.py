r"""Table 3 of the paper on the toy world: four reward variants from the same SFT policy.

  python -m launch.ablate --workdir=/tmp/codedance_demo           # reuses the demo's world and SFT policy
  python -m launch.ablate --workdir=DIR --modes=outcome,full --config.grpo.total_steps=20

Rows: outcome-only GRPO (R_acc + R_format), DeepEyes-style tool bonus, R_BAT without R_turn, full
R_BAT; each trained with the same seeds and evaluated on the held-out split. Prints the table and
writes WORKDIR/ablation.md and ablation.json.
"""

from absl import flags, logging
from ml_collections import config_flags

from codedance_jax import compile_cache
from launch import runner

config_flags.DEFINE_config_file("config", "configs/demo.py", "configs/demo.py[:default|mini]", lock_config=False)
flags.DEFINE_string("workdir", "/tmp/codedance_demo", "The demo workdir (world and SFT policy are reused).")
flags.DEFINE_list("modes", ["outcome", "tool_bonus", "no_turn", "full"], "Reward variants (RBATConfig.mode).")


def _known_modes(modes) -> bool:
    from codedance_jax.rl.rbat import MODES

    return bool(modes) and all(m in MODES for m in modes)


flags.register_validator("modes", _known_modes, "unknown reward variant; choose among outcome,tool_bonus,no_turn,full")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    compile_cache.enable()  # re-runs and ablations reuse compiled steps (CODEDANCE_COMPILATION_CACHE=off disables)
    from codedance_jax.demo.pipeline import ablate

    ablate(flags.FLAGS.config, flags.FLAGS.workdir, tuple(flags.FLAGS.modes))


if __name__ == "__main__":
    runner.run(main, trains=True)
