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

from codedance_jax import input_files
from codedance_jax import sharding as shd
from codedance_jax.checkpoint.build import abstract_model
from codedance_jax.errors import CheckpointError, MissingPathError
from codedance_jax.model.config import ModelConfig
from codedance_jax.model.qwen25vl import Qwen25VL

MARKER = "codedance.json"
FORMAT = "codedance-orbax"


def is_orbax_dir(path) -> bool:
    return os.path.lexists(os.path.join(os.fspath(path), MARKER))


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


def read_marker(path) -> dict:
    """The checkpoint's `codedance.json` (format, version, param_dtype), checked."""
    marker = os.path.join(os.fspath(path), MARKER)
    if not os.path.lexists(marker):
        raise MissingPathError(f"{os.fspath(path)}: no {MARKER}; not a checkpoint converted by launch.convert")
    meta = input_files.read_json(marker)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else meta
        raise CheckpointError(f"{marker}: format {got!r} is not {FORMAT!r}", "give a checkpoint written by launch.convert")
    return meta


# A tensorstore error status in an exception's text: the files, not the config, are at fault.
_STORE_ERRORS = ("FAILED_PRECONDITION", "OUT_OF_RANGE", "NOT_FOUND", "DATA_LOSS", "Error reading", "Error opening")
_REWRITE_FIX = "the checkpoint is incomplete or damaged: copy it again, or convert it again with launch.convert"


def check_params(params_dir: str, fix: str = _REWRITE_FIX) -> None:
    """Checks the files of an orbax (OCDBT) parameter directory before restoring from it.

    Walks the database's B-tree (`tensorstore.ocdbt.dump`: the manifest and index nodes only, a
    few KB) and checks that every data file it points into exists and is long enough. A missing
    or truncated file then fails here in one line naming it, instead of deep inside the restore,
    whose worker threads also print a traceback each when their event loop is gone."""
    if not os.path.lexists(os.path.join(params_dir, "_METADATA")):
        raise CheckpointError(f"{params_dir}/_METADATA: missing (the parameter tree of the checkpoint)", fix)
    if not os.path.exists(os.path.join(params_dir, "manifest.ocdbt")):
        if any(n.startswith("ocdbt.process_") for n in os.listdir(params_dir)):
            raise CheckpointError(f"{params_dir}/manifest.ocdbt: missing (the index of the parameter files)",
                                  fix)
        return  # not an OCDBT layout: the restore checks what it reads
    import tensorstore as ts

    def file_of(location: str) -> tuple[str, int]:
        # "<kind>:<base path>:<file path>:<offset>:<length>", paths relative to params_dir
        head, offset, length = location.rsplit(":", 2)
        _, base, rel = head.split(":", 2)
        return os.path.join(params_dir, base, rel), int(offset) + int(length)

    def check(location: str) -> None:
        file, end = file_of(location)
        if not os.path.exists(file):
            raise CheckpointError(f"{file}: missing (a parameter file of {params_dir})", fix)
        size = os.path.getsize(file)
        if size < end:
            raise CheckpointError(f"{file}: truncated: {size:,} bytes, the parameter database refers to "
                                  f"{end:,}", fix)

    try:
        kv = ts.KvStore.open({"driver": "file", "path": params_dir + "/"}).result()
        versions = ts.ocdbt.dump(kv).result()["versions"]
        todo = [versions[-1]["root"].get("location")] if versions else []
        while todo:
            location = todo.pop()
            if not location:
                continue
            check(location)
            for entry in ts.ocdbt.dump(kv, location).result().get("entries", ()):
                for v in entry.values():
                    if isinstance(v, str) and v.startswith("btreenode:"):
                        todo.append(v)
                    elif isinstance(v, str) and v.startswith("value:"):
                        check(v)
    except CheckpointError:
        raise
    except ValueError as e:  # tensorstore's errors: a manifest or index node that cannot be read
        raise CheckpointError(f"{params_dir}: the parameter database cannot be read ({_first_line(e)})",
                              fix) from e
    except (AttributeError, KeyError, TypeError, IndexError):
        return  # a tensorstore whose dump format differs: the restore still checks what it reads


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def load(path, cfg: ModelConfig | None = None, *, mesh: jax.sharding.Mesh | None = None, rules_table=None,
         sharding_tolerance: float = shd.DEFAULT_SHARDING_TOLERANCE) -> Qwen25VL:
    path = os.path.abspath(os.fspath(path))
    meta = read_marker(path)
    params_dir = os.path.join(path, "params")
    if not os.path.isdir(params_dir):
        raise MissingPathError(f"{params_dir}: missing; the converted checkpoint is incomplete (re-run launch.convert).")
    check_params(params_dir)
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
        except Exception as e:  # noqa: BLE001 -- orbax raises bare Exceptions for unreadable arrays
            chain = f"{e} {e.__cause__ or ''}"
            if any(s in chain for s in _STORE_ERRORS):
                raise CheckpointError(f"{params_dir}: cannot be read ({_first_line(e.__cause__ or e)})",
                                      _REWRITE_FIX) from e
            if isinstance(e, ValueError):
                raise CheckpointError(f"{params_dir}: does not match config.json ({_first_line(e)}); the config and "
                                      "params come from different models.") from e
            raise
    nnx.replace_by_pure_dict(state, restored)
    return nnx.merge(graphdef, state)
