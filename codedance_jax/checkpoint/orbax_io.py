"""The converted checkpoint format: orbax parameters plus the files that describe them.

    DIR/config.json        the Hugging Face config (ModelConfig.from_hf_config reads it)
    DIR/codedance.json     {"format": "codedance-orbax", "version": 1, "param_dtype": ...}
    DIR/params/            orbax PyTree checkpoint of the NNX Param state (pure dict)
    DIR/tokenizer*.json, preprocessor_config.json, chat template   (the processor)

Restoring passes abstract arrays that carry their target shardings, so each device reads only
its own shards and the model is never gathered on one device or one host.
"""

from __future__ import annotations

import json
import os

import jax
import orbax.checkpoint as ocp
from flax import nnx

from codedance_jax import sharding as shd
from codedance_jax.checkpoint.build import abstract_model
from codedance_jax.errors import CheckpointError, MissingPathError
from codedance_jax.model.config import ModelConfig
from codedance_jax.model.qwen25vl import Qwen25VL

MARKER = "codedance.json"
FORMAT = "codedance-orbax"


def is_orbax_dir(path) -> bool:
    return os.path.exists(os.path.join(os.fspath(path), MARKER))


def save(model: Qwen25VL, out_dir, processor=None) -> None:
    """Every process calls this (the orbax save is collective); only process 0 writes the small
    files, and the marker last: its presence means the checkpoint is whole (the demo resumes on it)."""
    save_params(model.cfg, nnx.to_pure_dict(nnx.state(model, nnx.Param)), out_dir, processor)


def save_params(cfg: ModelConfig, pure: dict, out_dir, processor=None) -> None:
    """`save` from the Param state as a pure dict (jax or numpy arrays: `checkpoint.background`
    writes a host copy from a thread while the step goes on)."""
    out_dir = os.path.abspath(os.fspath(out_dir))
    os.makedirs(out_dir, exist_ok=True)
    primary, marker = jax.process_index() == 0, os.path.join(out_dir, MARKER)
    if primary:
        if os.path.exists(marker):
            os.remove(marker)  # overwritten in place: not whole again until the new marker
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(cfg.to_hf_config(), f, indent=2)
        if processor is not None:
            processor.save_pretrained(out_dir)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(out_dir, "params"), pure, force=True)
    if primary:
        with open(marker, "w") as f:
            json.dump({"format": FORMAT, "version": 1, "param_dtype": cfg.param_dtype}, f)
    if jax.process_count() > 1:  # no process goes on (and loads it) before the marker exists
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"orbax_io.save {out_dir}")


def load(path, cfg: ModelConfig | None = None, *, mesh: jax.sharding.Mesh | None = None, rules_table=None,
         sharding_tolerance: float = shd.DEFAULT_SHARDING_TOLERANCE) -> Qwen25VL:
    path = os.path.abspath(os.fspath(path))
    if not os.path.isfile(os.path.join(path, MARKER)):
        raise MissingPathError(f"{path}: no {MARKER}; not a checkpoint converted by launch.convert")
    with open(os.path.join(path, MARKER)) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}/{MARKER}: format {meta.get('format')!r} is not {FORMAT!r}")
    params_dir = os.path.join(path, "params")
    if not os.path.isdir(params_dir):
        raise MissingPathError(f"{params_dir}: missing; the converted checkpoint is incomplete (re-run launch.convert).")
    cfg = cfg or ModelConfig.from_hf_config(path).replace(param_dtype=meta.get("param_dtype", "float32"))
    graphdef, state = abstract_model(cfg)
    single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = (jax.tree.map(lambda _: single, state, is_leaf=lambda x: isinstance(x, nnx.Variable)) if mesh is None
                 else shd.param_shardings(state, mesh, rules_table, tolerance=sharding_tolerance)[0])

    def target(var, sharding):
        return jax.ShapeDtypeStruct(var.shape, cfg.weight_dtype, sharding=sharding)

    abstract = jax.tree.map(target, state, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))
    abstract_pure = nnx.to_pure_dict(nnx.state(nnx.merge(graphdef, abstract), nnx.Param))
    with ocp.StandardCheckpointer() as ckptr:
        try:
            restored = ckptr.restore(params_dir, abstract_pure)
        except ValueError as e:
            raise CheckpointError(f"{params_dir}: does not match config.json ({e}); the config and params come from different models.") from e
    nnx.replace_by_pure_dict(state, restored)
    return nnx.merge(graphdef, state)
