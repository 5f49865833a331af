r"""Evaluation run configs, one per benchmark (VLMEvalKit's names; SPEC section 7).

  python -m launch.eval --config=configs/eval.py:ChartQA --config.checkpoint=/ckpt/codedance7b \
      --config.data_path=/data/ChartQA_TEST.tsv --workdir=/tmp/eval_chartqa
  python -m launch.eval --config=configs/eval.py:HRBench8K --config.checkpoint=CKPT --config.max_turns=0 ...

Benchmarks: CountBenchQA PixmoCount VStarBench HRBench4K HRBench8K ChartQA CharXiv MathVista
MathVision MathVerse WeMath. data_path: VLMEvalKit's TSV or the release's file (eval/loaders.py),
or a directory holding it; nothing is downloaded.
"""

import ml_collections

from eval.benchmarks import BENCHMARKS


def get_config(benchmark: str = "ChartQA") -> ml_collections.ConfigDict:
    if benchmark not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {benchmark!r}: {' | '.join(BENCHMARKS)}")
    c = ml_collections.ConfigDict()
    c.benchmark = benchmark
    c.data_path = ""  # the benchmark file or a directory holding it
    c.checkpoint = ""  # Hugging Face Qwen2.5-VL directory or a launch.convert output
    c.dtype = "bfloat16"
    # mesh: how the checkpoint is loaded (its parameters read sharded over fsdp). Sampling runs on
    #   rollout.mesh_data x mesh_tensor below, where the parameters are then placed and this copy dropped.
    c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=-1, tensor=1))
    c.sharding_tolerance = 0.02  # see configs/sft.py
    c.limit = 0  # >0: only the first N items (smoke runs)
    c.batch_size = 16  # prompts per rollout call (the engine pads to rollout.batch_multiple)
    c.max_turns = 10  # SPEC: 10 in evaluation; 0 = text-only answer (no code instructions, no sandbox)
    c.turn_format = "code"  # code (paper) | tool_call (release)
    # mesh_data: the sampling mesh, per process: each batch's rows split over this many of the process's own
    #   devices (jax.local_devices(); -1 = all of them), the policy replicated over them, placed there device to
    #   device from the loaded checkpoint (codedance_jax/rollout/placement.py). batch_multiple must be a multiple
    #   of it: 8 covers hosts of 1, 2, 4 or 8 devices. rollout_stats.jsonl records the placement per batch.
    # mesh_tensor: the policy's weights split over groups of this many of those devices (attention heads, MLP
    #   columns and vocabulary; the KV cache by KV heads), for a policy larger than one chip; mesh_data = -1 then
    #   means the local devices / mesh_tensor, which it must divide. 1: every device holds the whole policy.
    c.rollout = ml_collections.ConfigDict(
        dict(
            max_turn_tokens=2048,
            max_new_tokens=8192,
            max_total_tokens=16384,
            decode_chunk=32,
            batch_multiple=8,
            prompt_buckets=(1024, 2048, 4096, 8192, 16384),
            obs_buckets=(256, 1024, 4096),
            obs_max_images=4,
            obs_max_chars=2000,
            mesh_data=-1,
            mesh_tensor=1,
        )
    )
    c.sandbox = ml_collections.ConfigDict(dict(kind="pool", num_workers=16, timeout_s=15.0, memory_mb=2048))
    # Off by default: asked only where VLMEvalKit would ask its judge (rule verdict None).
    # The judge goes through the openai client: any OpenAI-compatible URL, e.g. launch.serve's
    # http://127.0.0.1:8000/v1 with model "codedance"; the key is read from the named variable.
    c.judge = ml_collections.ConfigDict(dict(enabled=False, url="", model="gpt-4o-mini", api_key_env="OPENAI_API_KEY",
                                             timeout_s=60.0, retries=2))
    return c
