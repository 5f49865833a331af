r"""Serve a checkpoint behind an OpenAI-compatible API (SPEC §8).

  python -m launch.serve --checkpoint=PATH [--port=8000]
  curl localhost:8000/v1/models
  # openai.OpenAI(base_url="http://localhost:8000/v1", api_key="-").chat.completions.create(model="codedance", ...)

Model names: `codedance` (chat) and `codedance-agent` (the server runs the multi-turn code loop
in the sandbox and returns the answer plus the trajectory). User errors (missing checkpoint, port
in use) exit with status 2 and one line on stderr.
"""

import sys

from absl import app, flags, logging

from codedance_jax.serve import ServeConfig, StartError, serve

flags.DEFINE_string("checkpoint", None, "Converted (launch.convert) or Hugging Face Qwen2.5-VL checkpoint directory.")
flags.DEFINE_string("host", "127.0.0.1", "Interface to listen on (0.0.0.0 for every interface).")
flags.DEFINE_integer("port", 8000, "Port (0 = any free port; the chosen one is printed).")
flags.DEFINE_string("model_name", "codedance", "Name served at /v1/models; '<name>-agent' runs agent mode.")
flags.DEFINE_string("dtype", "float32", "Compute dtype (bfloat16 on accelerators).")
flags.DEFINE_integer("max_context", 4096, "Prompt + completion tokens per sequence.")
flags.DEFINE_integer("max_batch", 8, "Sequences decoded together.")
flags.DEFINE_integer("decode_chunk", 16, "Decode steps per device call (streaming granularity).")
flags.DEFINE_bool("agent", True, "Serve '<name>-agent' (needs the sandbox: root, Linux namespaces).")
flags.DEFINE_integer("sandbox_workers", 2, "Code cells that may run at once in agent mode.")
flags.DEFINE_bool("local_images", True, "Let image_url name files on this machine (off beyond localhost).")
flags.DEFINE_bool("warmup", True, "Compile the decode path before accepting requests.")


def main(argv):
    del argv
    f = flags.FLAGS
    logging.set_verbosity(logging.WARNING)  # orbax logs every read at INFO
    cfg = ServeConfig(model_name=f.model_name, max_context=f.max_context, max_batch=f.max_batch,
                      decode_chunk=f.decode_chunk, agent=f.agent, sandbox_workers=f.sandbox_workers,
                      local_images=f.local_images)
    try:
        serve(f.checkpoint, host=f.host, port=f.port, cfg=cfg, dtype=f.dtype, warmup=f.warmup)
    except StartError as e:
        print(f"launch.serve: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    app.run(main)
