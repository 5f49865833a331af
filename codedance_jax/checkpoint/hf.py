"""Hugging Face checkpoints: load a Qwen2.5-VL directory into NNX, export NNX back to one.

Loading streams tensor by tensor from memory-mapped safetensors through the declarative table in
`codedance_jax.model.params`; every tensor's shape is checked against the config before use.
Export writes `config.json` (the released checkpoints' flat layout, which every `transformers`
version and vLLM read), safetensors shards written one tensor at a time, the tokenizer and
preprocessor files, and `generation_config.json`.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from codedance_jax import sharding as shd
from codedance_jax.checkpoint import safetensors_io
from codedance_jax.checkpoint.build import model_from_tensors, params_to_hf
from codedance_jax.errors import CheckpointError, CheckpointMissingTensorsError
from codedance_jax.model.config import ModelConfig
from codedance_jax.model.params import canonical_hf_name, rules
from codedance_jax.model.qwen25vl import Qwen25VL


def is_hf_dir(path) -> bool:
    path = os.fspath(path)
    return os.path.isdir(path) and any(f.endswith(".safetensors") for f in os.listdir(path))


def load_hf_model(path, cfg: ModelConfig | None = None, *, mesh: jax.sharding.Mesh | None = None, rules_table=None,
                  sharding_tolerance: float = shd.DEFAULT_SHARDING_TOLERANCE) -> Qwen25VL:
    path = os.fspath(path)
    cfg = cfg or ModelConfig.from_hf_config(path)
    src = safetensors_io.SafetensorsDir(path)
    by_canon = {canonical_hf_name(k): k for k in src.keys()}
    # A tied checkpoint may still carry `lm_head.weight`; the table does not ask for it, so it is ignored.
    wanted = {r.hf_name for r in rules(cfg)}
    missing = sorted(wanted - set(by_canon))
    if missing:
        raise CheckpointMissingTensorsError(
            f"{path}: {len(missing)} tensor(s) missing from the safetensors files, e.g. {missing[:3]}. "
            "The checkpoint is incomplete or its config.json does not match its weights "
            "(check num_hidden_layers, vision depth, tie_word_embeddings)."
        )

    def get(rule):
        arr = src.get(by_canon[rule.hf_name])
        if tuple(arr.shape) != rule.hf_shape:
            raise CheckpointError(
                f"{path}: tensor {rule.hf_name} has shape {tuple(arr.shape)} but config.json implies "
                f"{rule.hf_shape}; the weights and config.json come from different models."
            )
        return arr

    return model_from_tensors(cfg, get, mesh=mesh, rules_table=rules_table, sharding_tolerance=sharding_tolerance)


def hf_generation_config(cfg: ModelConfig) -> dict:
    return {"bos_token_id": cfg.bos_token_id, "eos_token_id": [cfg.eos_token_id, cfg.bos_token_id],
            "pad_token_id": cfg.bos_token_id, "do_sample": False}


def export_hf(model: Qwen25VL, out_dir, processor=None, *, dtype: str | None = None, max_shard_bytes: int = 4 << 30) -> list[str]:
    """Writes a Hugging Face checkpoint directory that `transformers` loads. Returns shard names."""
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    cfg = model.cfg
    np_dtype = np.dtype(jax.numpy.dtype(dtype or cfg.param_dtype))
    shapes = {r.hf_name: (r.hf_shape, np_dtype) for r in rules(cfg)}
    stream = ((name, arr.astype(np_dtype, copy=False)) for name, arr in params_to_hf(model))
    files = safetensors_io.write(out_dir, stream, shapes=shapes, max_shard_bytes=max_shard_bytes)
    hf_cfg = cfg.replace(param_dtype=str(np_dtype) if np_dtype != np.float32 else "float32").to_hf_config()
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(hf_generation_config(cfg), f, indent=2)
    if processor is not None:
        processor.save_pretrained(out_dir)
    return files
