"""Streaming safetensors: read one tensor at a time through a memory map, write one at a time.

Written here (not `safetensors.numpy.save_file`) because that takes the whole state dict at once:
an export would then hold the model twice on the host. The format is a little-endian u64 header
length, a JSON header {name: {dtype, shape, data_offsets}}, then the raw bytes.
bfloat16 is read and written through `ml_dtypes`.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Iterator

import ml_dtypes
import numpy as np

from codedance_jax.errors import CheckpointError, MissingPathError

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(bool),
}
NAMES = {v: k for k, v in DTYPES.items()}
INDEX = "model.safetensors.index.json"


class SafetensorsDir:
    """All tensors of a Hugging Face checkpoint directory (single file or sharded with an index)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        files = sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors"))
        index_path = os.path.join(self.path, INDEX)
        if os.path.exists(index_path):
            with open(index_path) as f:
                weight_map = json.load(f).get("weight_map", {})
            missing = sorted(set(weight_map.values()) - set(files))
            if missing:
                raise MissingPathError(
                    f"{index_path} lists shard(s) {missing[:3]} that are not in {self.path}; copy the complete checkpoint."
                )
        if not files:
            raise MissingPathError(f"{self.path}: no *.safetensors files (expected model.safetensors or shards + {INDEX}).")
        self.entries: dict[str, tuple[str, dict, int]] = {}
        for fname in files:
            fpath = os.path.join(self.path, fname)
            with open(fpath, "rb") as f:
                raw = f.read(8)
                if len(raw) < 8:
                    raise CheckpointError(f"{fpath}: truncated safetensors file (no header); re-copy it.")
                (n,) = struct.unpack("<Q", raw)
                try:
                    header = json.loads(f.read(n))
                except json.JSONDecodeError as e:
                    raise CheckpointError(f"{fpath}: corrupt safetensors header ({e}); re-copy the file.") from e
            for name, meta in header.items():
                if name != "__metadata__":
                    self.entries[name] = (fpath, meta, 8 + n)

    def keys(self) -> list[str]:
        return list(self.entries)

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only numpy view of the memory-mapped file (no copy)."""
        fpath, meta, base = self.entries[name]
        if meta["dtype"] not in DTYPES:
            raise CheckpointError(f"{fpath}: tensor {name} has unsupported dtype {meta['dtype']}")
        dtype = DTYPES[meta["dtype"]]
        start, end = meta["data_offsets"]
        shape = tuple(meta["shape"])
        if end - start != dtype.itemsize * int(np.prod(shape)):
            raise CheckpointError(f"{fpath}: tensor {name} has {end - start} bytes for shape {shape} {meta['dtype']}")
        return np.memmap(fpath, dtype=dtype, mode="r", offset=base + start, shape=shape)


def write(path: str | os.PathLike, tensors: Iterable[tuple[str, np.ndarray]], *, shapes: dict[str, tuple[tuple, np.dtype]],
          max_shard_bytes: int = 4 << 30, metadata: dict | None = None) -> list[str]:
    """Writes tensors (streamed in the order of `shapes`) into one or more shards.

    `shapes` gives every tensor's (shape, dtype) up front, so headers are written before data and
    only the tensor being written is in memory. Returns the file names written.
    """
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    names = list(shapes)
    shards, cur, size = [], [], 0
    for name in names:
        shape, dtype = shapes[name]
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if cur and size + nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(name)
        size += nbytes
    shards.append(cur)
    fnames = (["model.safetensors"] if len(shards) == 1 else
              [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    it: Iterator[tuple[str, np.ndarray]] = iter(tensors)
    weight_map, total = {}, 0
    for fname, shard in zip(fnames, shards, strict=True):
        header, off = {"__metadata__": {"format": "pt", **(metadata or {})}}, 0
        for name in shard:
            shape, dtype = shapes[name]
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            header[name] = {"dtype": NAMES[np.dtype(dtype)], "shape": list(shape), "data_offsets": [off, off + nbytes]}
            off += nbytes
            weight_map[name] = fname
        total += off
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
        with open(os.path.join(path, fname), "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for name in shard:
                got_name, arr = next(it)
                if got_name != name:
                    raise RuntimeError(f"tensor stream out of order: expected {name}, got {got_name}")
                arr = np.ascontiguousarray(arr, dtype=shapes[name][1])
                if arr.shape != tuple(shapes[name][0]):
                    raise ValueError(f"tensor {name}: shape {arr.shape} != declared {shapes[name][0]}")
                f.write(arr.reshape(-1).view(np.uint8).data)
    if len(shards) > 1:
        with open(os.path.join(path, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return fnames
