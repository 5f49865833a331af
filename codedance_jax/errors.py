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
"""

from __future__ import annotations


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
