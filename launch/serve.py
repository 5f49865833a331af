r"""Serve a checkpoint behind an OpenAI-compatible API (SPEC §8).

  python -m launch.serve --checkpoint=PATH [--port=8000]
  curl localhost:8000/v1/models
  # openai.OpenAI(base_url="http://localhost:8000/v1", api_key="-").chat.completions.create(model="codedance", ...)

On a host with several devices, `--mesh_data=-1` splits the decoded rows over all of them (and
`--mesh_tensor=2` splits the weights and KV cache over pairs of them, for a policy larger than one
chip); the default is one device.

Model names: `codedance` (chat) and `codedance-agent` (the server runs the multi-turn code loop
in the sandbox and returns the answer plus the trajectory). User errors (missing checkpoint, port
in use, listening beyond loopback without an API key) exit with status 2 and one line on stderr.

Safe by default (codedance_jax/serve/guard.py, media.py): loopback only; image URLs may not name
local files unless --allowed_local_media_path names directories; browsers on other sites and
foreign Host names are refused; bodies, headers and images are bounded. Beyond loopback:

  CODEDANCE_API_KEY=$(openssl rand -hex 16) python -m launch.serve --checkpoint=PATH --host=0.0.0.0
"""

import os
import sys

from absl import flags, logging

from codedance_jax.serve import ServeConfig, StartError, serve
from launch import runner

flags.DEFINE_string("checkpoint", None, "Converted (launch.convert) or Hugging Face Qwen2.5-VL checkpoint directory.")
flags.DEFINE_string("host", "127.0.0.1", "Interface to listen on (0.0.0.0 for every interface: needs --api_key "
                    "or --allow_insecure_remote).")
flags.DEFINE_integer("port", 8000, "Port (0 = any free port; the chosen one is printed).")
flags.DEFINE_string("model_name", "codedance", "Name served at /v1/models; '<name>-agent' runs agent mode.")
flags.DEFINE_string("dtype", "float32", "Compute dtype (bfloat16 on accelerators).")
flags.DEFINE_integer("max_context", 4096, "Prompt + completion tokens per sequence.")
flags.DEFINE_integer("max_batch", 8, "Sequences decoded together.")
flags.DEFINE_integer("decode_chunk", 16, "Decode steps per device call (streaming granularity).")
flags.DEFINE_bool("agent", True, "Serve '<name>-agent' (needs the sandbox: root, Linux namespaces).")
flags.DEFINE_integer("sandbox_workers", 2, "Code cells that may run at once in agent mode.")
flags.DEFINE_string("api_key", None, "Require 'Authorization: Bearer KEY' on every endpoint. Prefer the "
                    "CODEDANCE_API_KEY environment variable (a flag shows in ps).")
flags.DEFINE_bool("allow_insecure_remote", False, "Listen beyond loopback without an API key (anyone who can reach "
                  "the port may use the model and its sandbox).")
flags.DEFINE_list("allowed_local_media_path", [], "Directories whose world-readable files image URLs may name "
                  "(local paths, file://). Default: none, images come as data: URLs only.")
flags.DEFINE_list("allowed_hosts", [], "More Host header names to serve (e.g. a DNS name of this machine); '*' = any. "
                  "Loopback names and the --host address are always served.")
flags.DEFINE_list("allowed_origins", [], "Browser origins (https://app.example) allowed to call the API, with CORS "
                  "headers. Default: none, requests with another Origin are refused.")
flags.DEFINE_integer("max_request_mb", 32, "Largest request body (MiB), images included; larger ones get 413.")
flags.DEFINE_float("header_timeout_s", 10.0, "Seconds a connection has to send a request's headers.")
flags.DEFINE_float("body_timeout_s", 60.0, "Seconds a request has to send its body once its headers are in.")
flags.DEFINE_integer("max_image_pixels", 25_000_000, "Largest image (width x height) decoded; checked from its header.")
flags.DEFINE_bool("warmup", True, "Compile the decode path before accepting requests.")
flags.DEFINE_integer("mesh_data", 1, "Devices of this process that rows are split over (-1: every device that "
                     "--mesh_tensor leaves; --max_batch must divide by it). 1: one device, as before.")
flags.DEFINE_integer("mesh_tensor", 1, "Devices that share the weights and KV cache, split by heads (a policy larger "
                     "than one chip).")


def main(argv):
    del argv
    f = flags.FLAGS
    logging.set_verbosity(logging.WARNING)  # orbax logs every read at INFO
    cfg = ServeConfig(model_name=f.model_name, max_context=f.max_context, max_batch=f.max_batch,
                      decode_chunk=f.decode_chunk, agent=f.agent, sandbox_workers=f.sandbox_workers,
                      api_key=f.api_key or os.environ.get("CODEDANCE_API_KEY") or None,
                      allowed_hosts=tuple(f.allowed_hosts), allowed_origins=tuple(f.allowed_origins),
                      allowed_local_media_path=tuple(f.allowed_local_media_path),
                      max_body_bytes=f.max_request_mb << 20, header_timeout_s=f.header_timeout_s,
                      body_timeout_s=f.body_timeout_s, max_image_pixels=f.max_image_pixels,
                      mesh_data=f.mesh_data, mesh_tensor=f.mesh_tensor)
    try:
        serve(f.checkpoint, host=f.host, port=f.port, cfg=cfg, dtype=f.dtype, warmup=f.warmup,
              allow_insecure_remote=f.allow_insecure_remote)
    except StartError as e:
        print(f"launch.serve: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    runner.run(main)  # a broken checkpoint is one line and exit 2, as in every launcher
