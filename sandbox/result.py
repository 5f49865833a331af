"""The result of one cell, as the trainer sees it."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ExecResult:
    """status: "ok" | "error" (an exception, exit(), os._exit, a disabled call) | "timeout"
    (wall-clock or CPU limit) | "crashed" (killed by a signal, out of memory, or the session was
    lost). On anything but "ok" the session's namespace and files are as after its last "ok" cell.

    stdout / stderr are truncated to the pool's `max_output_bytes` each, with a visible marker;
    sandbox notes (timeouts, rollbacks, dropped images) are appended to stderr as "[sandbox] ..."
    lines. images are PNG bytes, in the order they were shown."""

    status: str
    stdout: str
    stderr: str
    images: list[bytes]
    elapsed_s: float

    @property
    def ok(self) -> bool:
        return self.status == "ok"
