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

from codedance_jax import input_files
from codedance_jax.errors import CheckpointError, MissingPathError

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(bool),
}
NAMES = {v: k for k, v in DTYPES.items()}
INDEX = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 << 20  # the format's own limit (safetensors refuses larger headers)


def read_header(fpath: str) -> dict[str, tuple[dict, int]]:
    """{tensor name: (header entry, byte offset of the data section)} of one safetensors file.

    Checked against the file before anything is mapped: a Git LFS pointer in place of the
    weights, a header that is not JSON, and a file shorter than its header says (a copy that
    stopped early) each raise `CheckpointError` naming the file, instead of a `MemoryError`
    (an 8-byte length read from a text file) or an mmap `ValueError` on the first tensor."""
    with input_files.open_binary(fpath) as f:
        size = os.fstat(f.fileno()).st_size
        raw = f.read(8)
        if input_files.is_lfs_pointer(raw + f.read(len(input_files.LFS_POINTER) - 8)):
            raise input_files.lfs_pointer_error(fpath)
        if len(raw) < 8:
            raise CheckpointError(f"{fpath}: truncated safetensors file ({size} bytes, no header)", input_files.RECOPY_FIX)
        (n,) = struct.unpack("<Q", raw)
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise CheckpointError(f"{fpath}: not a safetensors file or truncated: its first 8 bytes give a {n:,}-byte "
                                  f"header, the file has {size:,} bytes", input_files.RECOPY_FIX)
        f.seek(8)
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{fpath}: corrupt safetensors header ({e})", input_files.RECOPY_FIX) from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{fpath}: corrupt safetensors header (not a JSON object)", input_files.RECOPY_FIX)
    base, end, out = 8 + n, 0, {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            start, stop = (int(x) for x in meta["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{fpath}: corrupt safetensors header (tensor {name}: {meta!r})",
                                  input_files.RECOPY_FIX) from e
        if not 0 <= start <= stop:
            raise CheckpointError(f"{fpath}: corrupt safetensors header (tensor {name}: data_offsets {[start, stop]})",
                                  input_files.RECOPY_FIX)
        end = max(end, stop)
        out[name] = (meta, base)
    if base + end > size:
        raise CheckpointError(f"{fpath}: truncated: {size:,} bytes, but its header describes {base + end:,} "
                              f"({base + end - size:,} missing)", input_files.RECOPY_FIX)
    return out


class SafetensorsDir:
    """All tensors of a Hugging Face checkpoint directory (single file or sharded with an index)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        files = sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors"))
        index_path = os.path.join(self.path, INDEX)
        if os.path.lexists(index_path):
            index = input_files.read_json(index_path)
            weight_map = (index.get("weight_map") if isinstance(index, dict) else None) or {}
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
            for name, (meta, base) in read_header(fpath).items():
                self.entries[name] = (fpath, meta, base)

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
