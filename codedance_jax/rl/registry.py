"""Algorithms registered by name, so a run config can say `advantage="rbat"`, `loss="grpo"`.

Each entry is a pure function of arrays plus a frozen config; nothing here holds state beyond the
name → function tables.
"""

from __future__ import annotations

from collections.abc import Callable

_ADVANTAGES: dict[str, Callable] = {}
_LOSSES: dict[str, Callable] = {}


def register_advantage(name: str) -> Callable[[Callable], Callable]:
    def deco(fn: Callable) -> Callable:
        if name in _ADVANTAGES:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        _ADVANTAGES[name] = fn
        return fn

    return deco


def register_loss(name: str) -> Callable[[Callable], Callable]:
    def deco(fn: Callable) -> Callable:
        if name in _LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        _LOSSES[name] = fn
        return fn

    return deco


def get_advantage(name: str) -> Callable:
    try:
        return _ADVANTAGES[name]
    except KeyError:
        raise KeyError(f"unknown advantage estimator {name!r}; registered: {sorted(_ADVANTAGES)}") from None


def get_loss(name: str) -> Callable:
    try:
        return _LOSSES[name]
    except KeyError:
        raise KeyError(f"unknown policy loss {name!r}; registered: {sorted(_LOSSES)}") from None
