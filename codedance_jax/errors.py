"""User errors: bad input from the person running us, as opposed to bugs.

Library code raises a `UserError` where it detects bad input (a missing path, a checkpoint of
another architecture, malformed data, a config field that cannot work, a mesh that cannot hold
the batch, a workdir that belongs to another run). The message names the file, field or flag and
what is wrong; `fix` says what to do. Every launcher goes through `launch.runner`, which prints
such an error as one or two lines on stderr and exits with status 2 (no traceback unless
`--verbose` or `CODEDANCE_VERBOSE=1`); any other exception is a bug and keeps its traceback
(status 1).

The subclasses also derive from the builtin type a caller would expect (`ValueError`,
`FileNotFoundError`, `KeyError`), so code that catches those keeps working.

A full disk is the user's to fix too, wherever it surfaces: `disk_full(e)` finds it anywhere in an
exception's chain (orbax reports it from a writer thread, wrapped, as text), and the runner prints
it in one line like a `UserError`.
"""

from __future__ import annotations

import errno


class UserError(Exception):
    """Bad input. `message` names the culprit and what is wrong; `fix` (optional) what to do."""

    exit_code = 2

    def __init__(self, message: str, fix: str = ""):
        super().__init__(message)
        self.message, self.fix = message, fix

    def __str__(self) -> str:  # KeyError would repr-quote the message otherwise
        return self.message + (f" (fix: {self.fix})" if self.fix else "")


class ConfigError(UserError, ValueError):
    """A config field or flag that does not exist, has the wrong type or cannot work (mesh, batch)."""


class MissingPathError(UserError, FileNotFoundError):
    """A file or directory named by a flag or config field does not exist or is incomplete."""


class CheckpointError(UserError, ValueError):
    """A checkpoint of another architecture, with missing or mis-shaped tensors, or corrupt files."""


class CheckpointMissingTensorsError(CheckpointError, KeyError):
    """Tensors the model needs are not in the checkpoint."""


class DataError(UserError, ValueError):
    """Malformed or empty data (records, images, prompt files)."""


class WorkdirConflictError(UserError):
    """The workdir holds another run (a saved config that differs in a field that changes the run)."""


class DiskFullError(UserError, OSError):
    """The disk filled up while writing (a checkpoint, metrics): nothing half-written is kept."""


# ENOSPC and EDQUOT as their texts: orbax re-raises tensorstore's write failures as a ValueError
# ("RESOURCE_EXHAUSTED: ... No space left on device [os_error_code='28']"), not as an OSError.
_DISK_FULL_TEXTS = ("No space left on device", "Disk quota exceeded", "os_error_code='28'", "os_error_code='122'")


def disk_full(e: BaseException | None) -> bool:
    """Whether `e`, or an exception it was raised from or while handling, is a full disk."""
    seen = set()
    todo = [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(t in str(x) for t in _DISK_FULL_TEXTS):
            return True
        todo += [x.__cause__, x.__context__, *getattr(x, "exceptions", ())]
    return False
