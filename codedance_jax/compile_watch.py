"""Compilations after a warm-up: each one is a program outside the run's shape plan.

    with UnplannedCompiles() as watch:      # entered once the plan is compiled
        ... steps ...
        watch.drain()  # [(program, shapes)] since the last drain, each already logged as a warning

While it is open, JAX's own compile logging (`jax_log_compiles`) is switched on and its records are
taken from JAX's loggers before they print: each "Compiling <program> with global shapes ..." becomes
one warning of ours naming the program and its argument shapes (the parameters' shapes left out),
and the timing lines JAX adds are dropped. On exit the flag and the loggers are as they were.
"""

from __future__ import annotations

import logging
import re
import threading

import jax

log = logging.getLogger(__name__)

_LOGGERS = ("jax._src.interpreters.pxla", "jax._src.dispatch", "jax._src.compiler")
_COMPILING = re.compile(r"Compiling (\S+) with global shapes and types \((.*?)\)\. Argument mapping", re.S)
_SHAPE = re.compile(r"ShapedArray\(([a-z0-9_]+\[[0-9,]*\])")


def describe(message: str, keep: int = 8) -> tuple[str, str] | None:
    """(program, shapes) of a JAX "Compiling ..." log message (its last `keep` argument shapes: the
    batch's, after the parameters), or None for any other message."""
    m = _COMPILING.search(message)
    if m is None:
        return None
    shapes = _SHAPE.findall(m.group(2))
    tail = shapes[-keep:]
    return m.group(1), ("... " if len(shapes) > keep else "") + " ".join(tail)


class UnplannedCompiles(logging.Filter):
    """See the module docstring."""

    def __init__(self):
        super().__init__()
        self._lock = threading.Lock()
        self._seen: list[tuple[str, str]] = []
        self.total = 0
        self._prev = None

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        got = describe(msg)
        if got is not None:
            with self._lock:
                self._seen.append(got)
                self.total += 1
            log.warning("compiled outside the shape plan: %s with %s", *got)
            return False
        return not msg.startswith(("Finished tracing", "Finished jaxpr", "Finished XLA compilation",
                                   "Persistent compilation cache", "Not writing persistent cache"))

    def __enter__(self) -> UnplannedCompiles:
        self._prev = jax.config.jax_log_compiles
        jax.config.update("jax_log_compiles", True)
        for name in _LOGGERS:
            logging.getLogger(name).addFilter(self)
        return self

    def __exit__(self, *exc) -> None:
        for name in _LOGGERS:
            logging.getLogger(name).removeFilter(self)
        jax.config.update("jax_log_compiles", bool(self._prev))

    def drain(self) -> list[tuple[str, str]]:
        """The compilations seen since the last drain."""
        with self._lock:
            out, self._seen = self._seen, []
        return out
