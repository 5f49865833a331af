r"""Convert Qwen2.5-VL checkpoints: Hugging Face safetensors <-> orbax.

  python -m launch.convert --src=/ckpt/Qwen2.5-VL-7B-Instruct --dst=/ckpt/qwen7b_orbax
  python -m launch.convert --src=/ckpt/qwen7b_orbax --dst=/ckpt/qwen7b_hf --dtype=bfloat16
  python -m launch.convert --src=... --dst=... --mesh=1,8,1   # place shards on a data,fsdp,tensor mesh

The direction follows the source: a Hugging Face directory becomes orbax, an orbax one becomes
Hugging Face (config.json, safetensors shards, tokenizer and preprocessor files).
"""

from absl import flags

from launch import runner

flags.DEFINE_string("src", None, "Source checkpoint directory (HF or converted).", required=True)
flags.DEFINE_string("dst", None, "Destination directory.", required=True)
flags.DEFINE_string("dtype", None, "Parameter dtype of the output (default: keep the source's).")
flags.DEFINE_string("mesh", None, "data,fsdp,tensor sizes to load onto, e.g. 1,8,1 (default: one device).")


def main(argv):
    del argv
    from codedance_jax.checkpoint.convert import convert

    f = flags.FLAGS
    convert(f.src, f.dst, dtype=f.dtype, mesh=f.mesh)


if __name__ == "__main__":
    runner.run(main)
