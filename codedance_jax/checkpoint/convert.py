"""Checkpoint conversion in both directions (the library side of `launch.convert`)."""

from __future__ import annotations

import os
import time

from codedance_jax import sharding as shd
from codedance_jax.checkpoint import hf, orbax_io
from codedance_jax.errors import ConfigError, MissingPathError
from codedance_jax.model.config import ModelConfig


def _source_dtype(src: str) -> str:
    if orbax_io.is_orbax_dir(src):
        return orbax_io.read_marker(src).get("param_dtype", "float32")
    cfg = ModelConfig.read_hf_config(src)
    dt = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    return {"bfloat16": "bfloat16", "float16": "float16"}.get(dt, "float32")


def convert(src, dst, *, dtype: str | None = None, mesh: str | None = None, log=print) -> str:
    """Converts `src` to the other format at `dst`; returns the direction taken."""
    from codedance_jax.processing import Processor

    src, dst = os.fspath(src), os.fspath(dst)
    if not os.path.isdir(src):
        raise MissingPathError(f"--src={src}: no such directory",
                               "give a Hugging Face Qwen2.5-VL checkpoint directory or one converted by launch.convert")
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ConfigError(f"--dst={dst} is the source directory", "write the conversion to another directory")
    m = None
    if mesh:
        try:
            sizes = [int(x) for x in mesh.split(",")]
        except ValueError:
            sizes = []
        if len(sizes) != 3:
            raise ConfigError(f"--mesh={mesh!r}: not three integer sizes", "give data,fsdp,tensor, e.g. --mesh=1,8,1")
        m = shd.make_mesh(*sizes)
    dtype = dtype or _source_dtype(src)
    cfg = ModelConfig.from_hf_config(src).replace(param_dtype=dtype, dtype=dtype)
    t0 = time.time()
    proc = Processor.from_pretrained(src)
    if orbax_io.is_orbax_dir(src):
        model = orbax_io.load(src, cfg, mesh=m)
        files = hf.export_hf(model, dst, proc)
        direction = "orbax->hf"
        log(f"wrote {len(files)} safetensors file(s) + config + tokenizer to {dst}")
    elif hf.is_hf_dir(src):
        model = hf.load_hf_model(src, cfg, mesh=m)
        orbax_io.save(model, dst, proc)
        direction = "hf->orbax"
        log(f"wrote orbax params + config + tokenizer to {dst}")
    else:
        raise MissingPathError(f"{src}: neither a Hugging Face checkpoint (*.safetensors) nor a converted one ({orbax_io.MARKER}).")
    log(f"{direction} in {time.time() - t0:.1f}s ({dtype})")
    return direction
