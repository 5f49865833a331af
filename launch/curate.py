r"""Curate SFT trajectories (paper section 3.2; SPEC section 8).

  python -m launch.curate --config=configs/curate.py:toy --workdir=/tmp/curate_toy
  python -m launch.sft --config=configs/sft.py:tiny --workdir=/tmp/sft_cur \
      --config.data.jsonl=/tmp/curate_toy/sft.jsonl --config.data.synthetic=0

Re-running the same command resumes: decided items and cached endpoint replies are kept.
"""

from absl import flags
from ml_collections import config_flags

from launch import runner

config_flags.DEFINE_config_file("config", None, "configs/curate.py:<preset>", lock_config=True)
flags.DEFINE_string("workdir", None, "Stage files, cache, sft.jsonl, tfds/, report.", required=True)


def main(argv):
    del argv
    from runs.curate.pipeline import run

    run(flags.FLAGS.config, flags.FLAGS.workdir)


if __name__ == "__main__":
    runner.run(main)
