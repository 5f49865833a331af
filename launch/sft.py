r"""Supervised fine-tuning.

  python -m launch.sft --config=configs/sft.py:tiny --workdir=/tmp/sft_tiny
  python -m launch.sft --config=configs/sft.py:qwen25vl_7b --workdir=DIR --config.init_from=/ckpt/qwen7b_orbax

Multi-host: pass --coordinator_address=HOST:PORT --num_processes=N --process_id=I (or nothing on
TPU pods, where `jax.distributed.initialize()` discovers them; see launch/tpu_pod_sft.sh).
"""

from absl import flags
from ml_collections import config_flags

from codedance_jax import compile_cache
from launch import distributed, runner

config_flags.DEFINE_config_file("config", None, "configs/sft.py:<preset>", lock_config=True)
flags.DEFINE_string("workdir", None, "Checkpoints, metrics.jsonl, TensorBoard events.", required=True)


def main(argv):
    del argv
    distributed.initialize()
    compile_cache.enable()  # re-runs reuse compiled steps (CODEDANCE_COMPILATION_CACHE=off disables)
    from runs.sft import train_and_evaluate

    train_and_evaluate(flags.FLAGS.config, flags.FLAGS.workdir)


if __name__ == "__main__":
    runner.run(main, trains=True)
