r"""Evaluate a checkpoint on one of the paper's benchmarks.

  python -m launch.eval --config=configs/eval.py:ChartQA --config.checkpoint=/ckpt/codedance7b \
      --config.data_path=/data/ChartQA_TEST.tsv --workdir=/tmp/eval_chartqa

Writes predictions.jsonl/.tsv, trajectories.jsonl (+ images/), summary.json/.md and report.html
in the workdir; run it again with the same workdir to resume (scored items are skipped).
Several processes (`--coordinator_address --num_processes --process_id`, or `--tpu_pod`) each
evaluate every n-th item in WORKDIR/processes/P/; process 0 merges them into WORKDIR.
"""

from absl import flags
from ml_collections import config_flags

from launch import distributed, runner

config_flags.DEFINE_config_file("config", None, "configs/eval.py:<benchmark>", lock_config=True)
flags.DEFINE_string("workdir", None, "Predictions, trajectories, summary and report.", required=True)


def main(argv):
    del argv
    distributed.initialize()  # several processes: each evaluates its share, process 0 merges
    from eval.evaluate import evaluate

    evaluate(flags.FLAGS.config, flags.FLAGS.workdir)


if __name__ == "__main__":
    runner.run(main)
