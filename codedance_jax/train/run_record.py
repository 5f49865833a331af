"""A workdir remembers its run: `WORKDIR/run_config.json` holds the kind of run and its config.

`check(config, workdir, kind)` runs first in a training loop and only reads: when the workdir
holds a run of another kind, or a saved config that differs in a field that changes the run
(model, data, batch, sizes, optimizer, seeds), it raises `WorkdirConflictError` listing the
fields, unless `allow_config_change(True)` was called (the launchers' `--allow_config_change`).
`remember(config, workdir, kind)` writes the record once the run is about to train, so that a
run that fails before any work leaves the workdir as it was.

Fields that only say where or how fast the run goes (mesh, sharding, checkpoint and logging
cadence, `total_steps` so that a finished run can be extended, `grad_accum` and `remat`, which
change memory but not the loss, evaluation settings) are not compared (`IGNORED`).

The module also knows the workdir of the run in progress, so that the launcher's error report can
say which checkpoint is intact and how to resume (`resume_hint`).
"""

from __future__ import annotations

import json
import os
from typing import Any

from codedance_jax.errors import WorkdirConflictError

FILE = "run_config.json"
IGNORED = (
    "mesh", "sharding_rules", "checkpoint", "log_every", "tensorboard", "peak_tflops_per_device", "total_steps",
    "grad_accum", "remat", "attention", "export_policy", "eval", "trajectories_every", "data.tfds_dir", "sandbox.num_workers",
    "rollout.decode_chunk", "rollout.append_min_frac", "rollout.mesh_data", "rollout.mesh_tensor",
    "data.pack", "data.pack_row_multiple",
)
_state: dict[str, Any] = {"allow": False, "workdir": None}  # workdir: of the run that passed `check`


def allow_config_change(allow: bool = True) -> None:
    """Let `check` continue (with a warning) when the saved config differs."""
    _state["allow"] = bool(allow)


def flatten(config) -> dict[str, Any]:
    """A ConfigDict (or dict) -> {"a.b": JSON value}, tuples as lists (what JSON gives back)."""
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    out: dict[str, Any] = {}

    def walk(prefix, v):
        if isinstance(v, dict):
            for k in sorted(v):
                walk(f"{prefix}{k}.", v[k])
        else:
            out[prefix[:-1]] = json.loads(json.dumps(v, default=str))

    walk("", d)
    return out


def _ignored(key: str) -> bool:
    return any(key == f or key.startswith(f + ".") for f in IGNORED)


def differences(saved: dict[str, Any], now: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(field, saved value, new value) for compared fields present in both."""
    return [(k, saved[k], now[k]) for k in sorted(saved.keys() & now.keys()) if not _ignored(k) and saved[k] != now[k]]


def _path(workdir: str) -> str:
    return os.path.join(workdir, FILE)


def check(config, workdir: str, kind: str) -> None:
    """Refuse to start `kind` in a workdir that holds another run (see the module docstring). Reads only."""
    _check(config, workdir, kind)
    _state["workdir"] = workdir  # from here on, errors report the workdir's checkpoints (resume_hint)


def _check(config, workdir: str, kind: str) -> None:
    path = _path(workdir)
    if not os.path.isfile(path):
        return
    with open(path) as f:
        saved = json.load(f)
    if saved.get("kind") != kind:
        raise WorkdirConflictError(
            f"{workdir} holds a {saved.get('kind')!r} run ({path}), not a {kind!r} one",
            f"give this {kind} run its own --workdir",
        )
    diff = differences(saved.get("config", {}), flatten(config))
    if not diff:
        return
    listed = "; ".join(f"config.{k}: {a!r} (saved) -> {b!r}" for k, a, b in diff[:8])
    more = f" and {len(diff) - 8} more" if len(diff) > 8 else ""
    if _state["allow"]:
        import logging

        logging.getLogger(__name__).warning("continuing %s despite config changes: %s%s", workdir, listed, more)
        return
    raise WorkdirConflictError(
        f"{workdir} holds a run with another config ({path}): {listed}{more}",
        "use a new --workdir, restore those fields, or pass --allow_config_change to continue anyway",
    )


def remember(config, workdir: str, kind: str) -> None:
    """Write the run's record (process 0); after an allowed change it holds the new config."""
    import jax

    if jax.process_index() != 0:
        return
    os.makedirs(workdir, exist_ok=True)
    tmp = _path(workdir) + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"kind": kind, "config": flatten(config)}, f, indent=1, sort_keys=True)
    os.replace(tmp, _path(workdir))  # atomic: a kill never leaves half a record


def checkpoint_steps(workdir: str) -> list[int]:
    """Finalized checkpoint steps in WORKDIR/checkpoints (orbax renames a finished save to its step)."""
    d = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(d):
        return []
    return sorted(int(n) for n in os.listdir(d) if n.isdigit())


def resume_hint() -> str:
    """After an error: which checkpoint is intact and how to resume; "" when there is none."""
    workdir = _state["workdir"]
    steps = checkpoint_steps(workdir) if workdir else []
    if not steps:
        return ""
    metrics = os.path.join(workdir, "metrics.jsonl")
    also = f", metrics so far in {metrics}" if os.path.isfile(metrics) else ""
    return (f"nothing lost: the last checkpoint (step {steps[-1]}) is intact in {workdir}/checkpoints{also}; "
            "fix the cause and re-run the same command to resume from it")
