"""How the demo's report writes numbers: rates as percentages with their 95% interval, differences
and their intervals in percentage points, p-values, a value that was not measured (NaN: no code
ran) as "n/a"."""

from __future__ import annotations

import math

RATES = ("accuracy", "exec_success", "tool_rate")

COUNTS = ("n", "n_items", "samples_per_item")

METRICS = ("accuracy", "avg_turns", "exec_success", "tool_calls", "tool_rate", "n")

def to_float(v) -> float | None:
    """A finite float, or None (missing, NaN, not a number)."""
    if isinstance(v, bool) or v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None

def fmt_metric(metric: str, v) -> str:
    """Rates as percentages (one decimal), turns and calls with two decimals, counts as integers."""
    f = to_float(v)
    if f is None:
        return "n/a"
    if metric in RATES:
        return f"{100 * f:.1f}%"
    if metric in COUNTS:
        return str(int(f))
    return f"{f:.2f}"

def to_interval(v) -> tuple[float, float] | None:
    """A finite [lo, hi] pair, or None."""
    if not isinstance(v, list | tuple) or len(v) != 2:
        return None
    lo, hi = to_float(v[0]), to_float(v[1])
    return None if lo is None or hi is None else (lo, hi)

def fmt_ci(metric: str, v, ci) -> str:
    """A rate with its 95% interval, `91.7% [85.3, 95.5]` (the bare value without an interval)."""
    text = fmt_metric(metric, v)
    c = to_interval(ci)
    if metric not in RATES or c is None or to_float(v) is None:
        return text
    return f"{text} [{100 * c[0]:.1f}, {100 * c[1]:.1f}]"

def fmt_interval(ci) -> str:
    """An interval of a difference in percentage points, `[+1.2, +13.8] *` (`*`: it excludes 0);
    "n/a" without one."""
    c = to_interval(ci)
    if c is None:
        return "n/a"
    star = " *" if c[0] > 0 or c[1] < 0 else ""
    return f"[{100 * c[0]:+.1f}, {100 * c[1]:+.1f}]{star}"

def fmt_diff(d, ci) -> str:
    """A difference in percentage points with its interval; `*` when the interval excludes 0."""
    d = to_float(d)
    if d is None:
        return "n/a"
    if to_interval(ci) is None:
        return f"{100 * d:+.1f} pts"
    return f"{100 * d:+.1f} pts {fmt_interval(ci)}"

def fmt_p(p) -> str:
    """A p-value: three decimals, or two significant digits below 0.001; "n/a" without one."""
    f = to_float(p)
    if f is None:
        return "n/a"
    return f"{f:.3f}" if f >= 0.001 else f"{f:.1e}"
