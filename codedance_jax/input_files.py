"""Files people hand us (checkpoints, configs), read so that a bad one is a one-line `UserError`.

Checkpoints arrive truncated, half-copied or mislabelled: a Git LFS pointer where the weights
should be (a clone without `git lfs pull`), a config.json that is not JSON, a symlink that points
at itself. Each loader reads its files through these helpers, so each of those cases names the
file, says what is wrong and how to fix it (`launch.runner` prints it as one line, status 2)
instead of ending in a `JSONDecodeError`, a `MemoryError` or an `OSError` traceback.
"""

from __future__ import annotations

import errno
import json
import os
from typing import Any

from codedance_jax.errors import CheckpointError, MissingPathError, UserError

# The first line of every Git LFS pointer file (https://github.com/git-lfs/git-lfs/blob/main/docs/spec.md).
LFS_POINTER = b"version https://git-lfs.github.com/spec/"
LFS_FIX = ("fetch the real file: `git lfs pull` in the clone it came from, or download the checkpoint again "
           "(e.g. `huggingface-cli download`)")
RECOPY_FIX = "the copy or download is incomplete or damaged: copy the checkpoint again from its source"


def is_lfs_pointer(head: bytes) -> bool:
    """Whether a file that starts with `head` is a Git LFS pointer (a ~130-byte text stub)."""
    return head.startswith(LFS_POINTER)


def lfs_pointer_error(path: str, error: type[UserError] = CheckpointError) -> UserError:
    return error(f"{path}: a Git LFS pointer file ({os.path.getsize(path)} bytes), not the file itself", LFS_FIX)


def os_error(path: str, e: OSError, error: type[UserError] = CheckpointError) -> UserError:
    """An OSError met while opening `path` -> a user error naming it (a symlink loop, a dangling link,
    a missing file, no permission)."""
    if e.errno == errno.ELOOP:
        return error(f"{path}: a symbolic link loop (the link resolves to itself)",
                     "replace the link with the file it should point to")
    if e.errno == errno.ENOENT and os.path.islink(path):
        return MissingPathError(f"{path}: a dangling symbolic link (to {os.readlink(path)!r})",
                                "point the link at an existing file, or copy the file in its place")
    if e.errno == errno.ENOENT:
        return MissingPathError(f"{path}: no such file", RECOPY_FIX)
    if e.errno in (errno.EACCES, errno.EPERM):
        return error(f"{path}: permission denied", "make the file readable by this user")
    if e.errno == errno.EISDIR:
        return error(f"{path}: a directory where a file was expected", RECOPY_FIX)
    return error(f"{path}: cannot be read ({e.strerror or e})", RECOPY_FIX)


def open_binary(path: str, error: type[UserError] = CheckpointError):
    """`open(path, "rb")`, with the OSErrors people cause (loops, dangling links) as user errors."""
    try:
        return open(path, "rb")
    except OSError as e:
        raise os_error(path, e, error) from e


def read_json(path: str | os.PathLike, error: type[UserError] = CheckpointError) -> Any:
    """The parsed JSON file at `path`; a file that is not JSON (or not UTF-8, or an LFS pointer, or
    unreadable) raises `error` naming the file, the place and the fix."""
    path = os.fspath(path)
    with open_binary(path, error) as f:
        raw = f.read()
    if is_lfs_pointer(raw):
        raise lfs_pointer_error(path, error)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path}: not a JSON text file (byte 0x{raw[e.start]:02x} at offset {e.start} is not UTF-8)",
                    RECOPY_FIX) from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})", RECOPY_FIX) from e
