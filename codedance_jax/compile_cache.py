"""The persistent XLA compilation cache the launchers enable, so re-runs and ablations reuse steps.

    from codedance_jax import compile_cache; compile_cache.enable()

Directory: `$CODEDANCE_COMPILATION_CACHE` if set ("off" or "" disables), else
`$JAX_COMPILATION_CACHE_DIR` if set, else `~/.cache/codedance_jax/xla`. Every compilation is
cached (JAX's default skips those under 1 s, which is most of a toy run's jitted steps on CPU).
Entries are keyed by the computation, the jax/jaxlib versions and the backend, so a stale entry
is never reused for a different program.
"""

from __future__ import annotations

import os

DEFAULT_DIR = os.path.join("~", ".cache", "codedance_jax", "xla")


def cache_dir() -> str | None:
    """The directory `enable` uses, or None when disabled."""
    d = os.environ.get("CODEDANCE_COMPILATION_CACHE")
    if d is None:
        d = os.environ.get("JAX_COMPILATION_CACHE_DIR") or DEFAULT_DIR
    if d.strip().lower() in ("", "off", "0", "none"):
        return None
    return os.path.abspath(os.path.expanduser(d))


def enable(directory: str | None = None) -> str | None:
    """Turns the cache on (before the first compilation); returns its directory, or None if disabled."""
    import jax

    d = os.path.abspath(os.path.expanduser(directory)) if directory else cache_dir()
    if d is None:
        return None
    os.makedirs(d, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", d)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return d
