"""Logical axis names -> mesh axes: one rules table, used for parameters, caches and batches.

Model code only names logical axes (`embed`, `mlp`, `q_heads`, ...). This table decides where
they go on a mesh with axes `data`, `fsdp`, `tensor` (any of which may have size 1). The mesh is
built with `AxisType.Explicit`-free defaults (`Auto`), so XLA's sharding propagation fills in
intermediate activations while parameters and inputs carry the shardings given here.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

# (logical axis, mesh axis or tuple of mesh axes or None). First match wins.
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("vision_embed", "fsdp"),
    ("vision_mlp", "tensor"),
    ("vision_heads", "tensor"),
    ("vision_merged", "fsdp"),
    ("vision_merged_out", "tensor"),
    ("patch", None),
)


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, devices=None) -> jax.sharding.Mesh:
    """A (data, fsdp, tensor) mesh; one size may be -1 to take the remaining devices."""
    devices = np.asarray(jax.devices() if devices is None else devices)
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1:
        raise ValueError("at most one of data/fsdp/tensor may be -1")
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        if devices.size % known:
            raise ValueError(f"{devices.size} devices do not split into data*fsdp*tensor with fixed sizes {sizes}")
        sizes[sizes.index(-1)] = devices.size // known
    if int(np.prod(sizes)) != devices.size:
        raise ValueError(f"mesh data*fsdp*tensor = {sizes} needs {int(np.prod(sizes))} devices, have {devices.size}")
    return jax.sharding.Mesh(devices.reshape(sizes), ("data", "fsdp", "tensor"))


def logical_to_spec(axes, rules=None, mesh: jax.sharding.Mesh | None = None) -> PartitionSpec:
    """PartitionSpec for a tuple of logical names; a mesh axis is used at most once per array."""
    table = dict(DEFAULT_RULES if rules is None else rules)
    used: set[str] = set()
    spec = []
    for name in axes or ():
        target = table.get(name) if name is not None else None
        if target is None:
            spec.append(None)
            continue
        targets = (target,) if isinstance(target, str) else tuple(target)
        targets = tuple(t for t in targets if t not in used and (mesh is None or mesh.shape.get(t, 1) > 1))
        used.update(targets)
        spec.append(targets[0] if len(targets) == 1 else (targets or None))
    return PartitionSpec(*spec)


def named_sharding(mesh, axes, rules=None, shape=None) -> NamedSharding:
    """NamedSharding for logical `axes`; with `shape`, axes that do not divide it are dropped."""
    spec = logical_to_spec(axes, rules, mesh)
    return NamedSharding(mesh, spec if shape is None else fit_spec(spec, shape, mesh))


def fit_spec(spec: PartitionSpec, shape, mesh) -> PartitionSpec:
    """Drops mesh axes that do not divide a dimension (tiny test models on 8 devices)."""
    out = []
    for dim, s in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)), strict=True):
        axes = () if s is None else ((s,) if isinstance(s, str) else tuple(s))
        size = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
        out.append(s if dim % size == 0 else None)
    return PartitionSpec(*out)


# ---------------------------------------------------------------- compute-time sharding (FSDP)
# Parameters are stored sharded over `fsdp` on their `embed`-like dimension, and batches are
# sharded over (data, fsdp) on their batch dimension: both sides of every matmul use the same mesh
# axis. Left to propagation, XLA may resolve that conflict by keeping the weight sharded and
# gathering the *activations* over the batch instead (each chip then computes partial sums for the
# global batch): per-chip memory grows with the slice (issue 19: 13x from 4 to 64 v5p chips). Under
# `compute_sharding`, a parameter is cast to the compute dtype and all-gathered at its use (FSDP),
# activations keep their batch sharding, and gradients are reduce-scattered back to the parameters'
# layout. Outside the context (single device, tests, eager code) every function here is the identity.
_COMPUTE: contextvars.ContextVar = contextvars.ContextVar("codedance_compute_sharding", default=None)


@contextlib.contextmanager
def compute_sharding(mesh: jax.sharding.Mesh, rules=None):
    """Trace a step under this to get FSDP gathers of parameters at use (see above)."""
    token = _COMPUTE.set((mesh, rules))
    try:
        yield
    finally:
        _COMPUTE.reset(token)


def compute_sharding_active() -> bool:
    return _COMPUTE.get() is not None


def with_compute_sharding(fn, mesh, rules=None):
    """fn traced under `compute_sharding(mesh, rules)` (wrap before `jax.jit`)."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with compute_sharding(mesh, rules):
            return fn(*args, **kwargs)

    return wrapped


def _batch_mesh_axes(mesh, rules) -> set[str]:
    spec = logical_to_spec(("batch",), rules, mesh)
    s = spec[0] if len(spec) else None
    return set() if s is None else ({s} if isinstance(s, str) else set(s))


def _param_spec(var, shape, mesh, rules) -> PartitionSpec:
    return fit_spec(logical_to_spec(var.get_metadata().get("out_sharding"), rules, mesh), shape, mesh)


def gather_param(var, dtype):
    """An nnx.Param's value cast to `dtype` and, under `compute_sharding`, gathered over the batch axes."""
    x = var[...].astype(dtype)
    ctx = _COMPUTE.get()
    if ctx is None:
        return x
    mesh, rules = ctx
    drop = _batch_mesh_axes(mesh, rules)

    def keep(s):
        axes = () if s is None else ((s,) if isinstance(s, str) else tuple(s))
        axes = tuple(a for a in axes if a not in drop)
        return None if not axes else (axes[0] if len(axes) == 1 else axes)

    spec = PartitionSpec(*(keep(s) for s in _param_spec(var, x.shape, mesh, rules)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def constrain_batch(x, batch_dim: int = 0):
    """Under `compute_sharding`: keep the batch dimension of an activation on the batch mesh axes."""
    ctx = _COMPUTE.get()
    if ctx is None:
        return x
    mesh, rules = ctx
    b = logical_to_spec(("batch",), rules, mesh)[0] if _batch_mesh_axes(mesh, rules) else None
    if b is not None:
        size = int(np.prod([mesh.shape[a] for a in ((b,) if isinstance(b, str) else b)]))
        if x.shape[batch_dim] % size:
            return x
    spec = [PartitionSpec.UNCONSTRAINED] * x.ndim
    spec[batch_dim] = b
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*spec)))


def constrain_like_params(tree):
    """Under `compute_sharding`: a pytree of nnx Variables (e.g. gradients) laid out as the parameters."""
    ctx = _COMPUTE.get()
    if ctx is None:
        return tree
    mesh, rules = ctx

    def one(v):
        if not hasattr(v, "get_metadata"):
            return v
        sh = NamedSharding(mesh, _param_spec(v, v.shape, mesh, rules))
        return v.replace(jax.lax.with_sharding_constraint(v[...], sh))

    return jax.tree.map(one, tree, is_leaf=lambda x: hasattr(x, "get_metadata"))
