r"""GRPO with R_BAT: multi-turn rollouts through the sandbox, sharded policy updates, evaluation.

  python -m launch.grpo --config=configs/grpo.py:tiny --workdir=/tmp/grpo_tiny
  python -m launch.grpo --config=configs/grpo.py:qwen25vl_7b --workdir=DIR \
      --config.init_from=/ckpt/sft7b/policy --config.data.jsonl=/data/rl.jsonl --config.data.eval_jsonl=/data/eval.jsonl

Killed or preempted runs resume from the latest checkpoint in DIR. Multi-host flags as in launch.sft.
"""

from absl import flags
from ml_collections import config_flags

from codedance_jax import compile_cache
from launch import distributed, runner

config_flags.DEFINE_config_file("config", None, "configs/grpo.py:<preset>", lock_config=True)
flags.DEFINE_string("workdir", None, "Checkpoints, metrics.jsonl, eval.jsonl, the final policy.", required=True)


def main(argv):
    del argv
    distributed.initialize()
    compile_cache.enable()  # re-runs reuse compiled steps (CODEDANCE_COMPILATION_CACHE=off disables)
    from runs.grpo import train_and_evaluate

    train_and_evaluate(flags.FLAGS.config, flags.FLAGS.workdir)


if __name__ == "__main__":
    runner.run(main, trains=True)
