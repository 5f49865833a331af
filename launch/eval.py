r"""Evaluate a checkpoint on one of the paper's benchmarks.

  python -m launch.eval --config=configs/eval.py:ChartQA --config.checkpoint=/ckpt/codedance7b \
      --config.data_path=/data/ChartQA_TEST.tsv --workdir=/tmp/eval_chartqa

Writes predictions.jsonl/.tsv, trajectories.jsonl (+ images/), summary.json/.md and report.html
in the workdir; run it again with the same workdir to resume (scored items are skipped).
"""

from absl import flags
from ml_collections import config_flags

from launch import runner

config_flags.DEFINE_config_file("config", None, "configs/eval.py:<benchmark>", lock_config=True)
flags.DEFINE_string("workdir", None, "Predictions, trajectories, summary and report.", required=True)


def main(argv):
    del argv
    from eval.evaluate import evaluate

    evaluate(flags.FLAGS.config, flags.FLAGS.workdir)


if __name__ == "__main__":
    runner.run(main)
