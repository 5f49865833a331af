r"""Table 3 of the paper on the toy world: four reward variants from the same SFT policy.

  python -m launch.ablate --workdir=/tmp/codedance_demo           # reuses the demo's world and SFT policy
  python -m launch.ablate --workdir=DIR --modes=outcome,full --config.grpo.total_steps=20
  python -m launch.ablate --workdir=DIR --seeds=0,1,2 --presets=paper,release   # Table 3, mean ± std

Rows: outcome-only GRPO (R_acc + R_format), DeepEyes-style tool bonus, R_BAT without R_turn, full
R_BAT (once per `--presets` entry); each trained from the same SFT policy with the same steps, once
per GRPO seed in `--seeds`, and evaluated on the held-out split. Prints the table (mean ± std over
the seeds) and writes WORKDIR/ablation.md and ablation.json. Finished runs are reused.
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


flags.DEFINE_list("seeds", [], "GRPO seeds, one run per row each (empty: the config's seed, one run).")
flags.DEFINE_list("presets", [], "R_BAT presets for the R_BAT rows: paper, release (empty: the config's).")
flags.register_validator("seeds", lambda s: all(x.lstrip("-").isdigit() for x in s), "--seeds: integers, e.g. 0,1,2")
flags.register_validator("presets", lambda p: all(x in ("paper", "release") for x in p), "--presets: paper and/or release")
flags.register_validator("modes", _known_modes, "unknown reward variant; choose among outcome,tool_bonus,no_turn,full")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    compile_cache.enable()  # re-runs and ablations reuse compiled steps (CODEDANCE_COMPILATION_CACHE=off disables)
    from runs.demo.pipeline import ablate

    f = flags.FLAGS
    ablate(f.config, f.workdir, tuple(f.modes), seeds=tuple(int(x) for x in f.seeds), presets=tuple(f.presets))


if __name__ == "__main__":
    runner.run(main, trains=True)
