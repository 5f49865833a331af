r"""The main job: the whole CodeDance pipeline on the toy world, on any laptop.

  python -m launch.demo --workdir=/tmp/codedance_demo

Generates the toy world (expert trajectories executed in the sandbox), trains a ~1M-parameter
Qwen2.5-VL with SFT, evaluates it on held-out items, trains it further with GRPO and the R_BAT
reward, evaluates again, and writes WORKDIR/report/ (report.md, report.html, plots, summary.json).
Re-running with the same workdir skips finished phases and resumes training from checkpoints.
--stop_after=sft_eval ends after the SFT policy's evaluations and writes WORKDIR/calibration.md:
per family x difficulty, greedy beside sampled accuracy, pass@k and tool use (what RL can fix).
"""

from absl import flags, logging
from ml_collections import config_flags

from codedance_jax import compile_cache
from launch import runner

config_flags.DEFINE_config_file("config", "configs/demo.py", "configs/demo.py[:default|mini]", lock_config=False)
flags.DEFINE_string("workdir", "/tmp/codedance_demo", "Where the world, checkpoints, evaluations and the report go.")
flags.DEFINE_enum("stop_after", None, ["world", "sft", "sft_eval"],
                  "End after this phase: sft_eval calibrates a world (WORKDIR/calibration.md) before any RL.")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax and TFDS log every file at INFO
    compile_cache.enable()  # re-runs and ablations reuse compiled steps (CODEDANCE_COMPILATION_CACHE=off disables)
    from runs.demo.pipeline import run

    run(flags.FLAGS.config, flags.FLAGS.workdir, stop_after=flags.FLAGS.stop_after)


if __name__ == "__main__":
    runner.run(main, trains=True)
