"""Logical axis names -> mesh axes: one rules table, used for parameters, caches and batches.

Model code only names logical axes (`embed`, `mlp`, `q_heads`, ...). This table decides where
they go on a mesh with axes `data`, `fsdp`, `tensor` (any of which may have size 1). The mesh is
built with `AxisType.Explicit`-free defaults (`Auto`), so XLA's sharding propagation fills in
intermediate activations while parameters and inputs carry the shardings given here.

A parameter dimension that a mesh axis does not divide cannot be sharded over it. `param_shardings`
then replicates that dimension, counts what it replicated, and raises `ShardingError` (naming each
parameter, dimension and mesh axis) when those parameters hold more than `tolerance` of all
parameter elements (MaxText's `sharding_tolerance`). Below the tolerance it logs a warning: a few
small odd-shaped tensors (biases of 2 KV heads on a 4-way tensor axis) are fine to replicate; a 7B
model whose attention falls back to replication on every device is a mesh mistake.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from codedance_jax.errors import ConfigError

log = logging.getLogger(__name__)

# Largest fraction of parameter elements that may sit in parameters with a replicated fallback
# dimension (as MaxText's default `sharding_tolerance`).
DEFAULT_SHARDING_TOLERANCE = 0.02

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


_MESH_FIX = "set the mesh sizes (--config.mesh.data/fsdp/tensor or --mesh) so that their product is the device count; one may be -1 for the rest"


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, devices=None) -> jax.sharding.Mesh:
    """A (data, fsdp, tensor) mesh; one size may be -1 to take the remaining devices."""
    devices = np.asarray(jax.devices() if devices is None else devices)
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1:
        raise ConfigError(f"mesh data,fsdp,tensor = {sizes}: at most one size may be -1", _MESH_FIX)
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        if devices.size % known:
            raise ConfigError(f"mesh data,fsdp,tensor = {sizes}: {devices.size} devices do not split into these sizes",
                              _MESH_FIX)
        sizes[sizes.index(-1)] = devices.size // known
    if int(np.prod(sizes)) != devices.size:
        raise ConfigError(f"mesh data*fsdp*tensor = {sizes} needs {int(np.prod(sizes))} devices, have {devices.size}",
                          _MESH_FIX)
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
    """NamedSharding for logical `axes`; with `shape`, axes that do not divide it are dropped.

    One array, no check: parameters go through `param_shardings`, which counts the drops.
    """
    spec = logical_to_spec(axes, rules, mesh)
    return NamedSharding(mesh, spec if shape is None else fit_spec(spec, shape, mesh))


@dataclasses.dataclass(frozen=True)
class DroppedAxis:
    """One dimension left replicated because its mesh axes do not divide it."""

    param: str  # "layers/0/attn/k_kernel"
    shape: tuple[int, ...]
    dim: int
    logical: str | None  # the dimension's logical name
    mesh_axes: tuple[str, ...]
    mesh_size: int  # product of mesh_axes' sizes

    def __str__(self):
        return (f"{self.param} {self.shape} dim {self.dim} ({self.logical}={self.shape[self.dim]}) "
                f"not divisible by mesh axis {'*'.join(self.mesh_axes)}={self.mesh_size}")


class ShardingError(ConfigError):
    """The mesh cannot shard the parameters as the rules ask (past the tolerance)."""


@dataclasses.dataclass(frozen=True)
class ShardingReport:
    """What `param_shardings` had to replicate; `fraction` is by parameter elements."""

    dropped: tuple[DroppedAxis, ...]
    params: int  # parameters (tensors)
    elements: int  # parameter elements in all
    dropped_params: int  # tensors with at least one replicated fallback dimension
    dropped_elements: int  # their elements

    @property
    def fraction(self) -> float:
        return self.dropped_elements / max(self.elements, 1)

    def summary(self, limit: int = 5) -> str:
        head = "; ".join(str(d) for d in self.dropped[:limit])
        more = f"; ... {len(self.dropped) - limit} more" if len(self.dropped) > limit else ""
        return (f"{self.dropped_params} of {self.params} parameters ({self.dropped_elements:,} of {self.elements:,} "
                f"elements, {self.fraction:.2%}) keep a dimension unsharded: {head}{more}")


def dropped_dims(spec: PartitionSpec, shape, mesh) -> list[tuple[int, tuple[str, ...], int]]:
    """(dim, mesh axes, their size) for each dimension of `shape` that `spec`'s axes do not divide."""
    out = []
    for dim, (n, s) in enumerate(zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)), strict=True)):
        axes = () if s is None else ((s,) if isinstance(s, str) else tuple(s))
        size = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
        if n % size:
            out.append((dim, axes, size))
    return out


def fit_spec(spec: PartitionSpec, shape, mesh) -> PartitionSpec:
    """`spec` with the mesh axes of non-dividing dimensions removed (that dimension replicated)."""
    drop = {d for d, _, _ in dropped_dims(spec, shape, mesh)}
    padded = tuple(spec) + (None,) * (len(shape) - len(spec))
    return PartitionSpec(*(None if i in drop else s for i, s in enumerate(padded)))


def param_shardings(state, mesh, rules=None, *, tolerance: float = DEFAULT_SHARDING_TOLERANCE):
    """NamedSharding per `nnx.Variable` of `state` (abstract or real) from its logical axes.

    Returns (the same tree with each Variable replaced by its NamedSharding, ShardingReport).
    Raises ShardingError when the parameters that keep a dimension unsharded hold more than
    `tolerance` of the elements; 0 allows none, 1 allows all.
    """
    dropped: list[DroppedAxis] = []
    counts = {"params": 0, "elements": 0, "dropped_params": 0, "dropped_elements": 0}

    def one(path, var):
        axes = var.get_metadata().get("out_sharding")
        spec = logical_to_spec(axes, rules, mesh)
        bad = dropped_dims(spec, var.shape, mesh)
        n = int(np.prod(var.shape))
        counts["params"] += 1
        counts["elements"] += n
        if bad:
            name = "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
            counts["dropped_params"] += 1
            counts["dropped_elements"] += n
            dropped.extend(DroppedAxis(name, tuple(var.shape), d, (axes or (None,) * len(var.shape))[d], ax, size)
                           for d, ax, size in bad)
        return NamedSharding(mesh, fit_spec(spec, var.shape, mesh))

    tree = jax.tree_util.tree_map_with_path(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    report = ShardingReport(tuple(dropped), **counts)
    if report.fraction > tolerance:
        raise ShardingError(
            f"mesh {dict(mesh.shape)} cannot shard the parameters as the rules ask: {report.summary()}. Past the "
            f"tolerance {tolerance:.2%}: change the mesh (config.mesh.*), the rules (config.sharding_rules) or raise "
            f"config.sharding_tolerance.")
    if report.dropped:
        log.warning("mesh %s: %s (tolerance %.2f%%)", dict(mesh.shape), report.summary(), 100 * tolerance)
    return tree, report


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


def _axes_size(mesh, entry) -> int:
    """Devices along one PartitionSpec entry (a mesh axis name or a tuple of them)."""
    return int(np.prod([mesh.shape[a] for a in ((entry,) if isinstance(entry, str) else entry)]))


def constrain_batch(x, batch_dim: int = 0):
    """Under `compute_sharding`: keep the batch dimension of an activation on the batch mesh axes."""
    ctx = _COMPUTE.get()
    if ctx is None:
        return x
    mesh, rules = ctx
    b = logical_to_spec(("batch",), rules, mesh)[0] if _batch_mesh_axes(mesh, rules) else None
    if b is not None and x.shape[batch_dim] % _axes_size(mesh, b):
        return x
    spec = [PartitionSpec.UNCONSTRAINED] * x.ndim
    spec[batch_dim] = b
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*spec)))


def kernel_specs(batch: int, heads: int):
    """Under `compute_sharding`: (mesh, batch mesh axes, head mesh axis) for a `shard_map`ped kernel
    over [batch, heads, ...] operands (flash attention), each None where it does not divide; None
    outside the context. XLA cannot partition a Pallas call itself (see `model.flash`)."""
    ctx = _COMPUTE.get()
    if ctx is None:
        return None
    mesh, rules = ctx

    def fit(s, n):
        return s if s is not None and n % _axes_size(mesh, s) == 0 else None

    b = logical_to_spec(("batch",), rules, mesh)
    h = logical_to_spec(("q_heads",), rules, mesh)
    return mesh, fit(b[0] if len(b) else None, batch), fit(h[0] if len(h) else None, heads)


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


# ---------------------------------------------------------------- rows over the data axis (inference)
# Batched generation (evaluation rollouts) splits its rows over the mesh's `data` axis: each data
# slice decodes its own rows against the parameters laid out by `param_shardings` (replicated over
# `data`). Only the row dimension is given; XLA propagates it through the jitted cache steps.


def row_sharding(mesh: jax.sharding.Mesh, shape, batch_dim: int = 0, axis: str = "data") -> NamedSharding:
    """Dimension `batch_dim` of `shape` split over the mesh `axis`, the rest replicated. A scalar, or
    rows that the axis does not divide, are fully replicated."""
    spec = [None] * len(shape)
    if len(shape) > batch_dim and shape[batch_dim] % mesh.shape[axis] == 0:
        spec[batch_dim] = axis
    return NamedSharding(mesh, PartitionSpec(*spec))


def kv_sharding(mesh: jax.sharding.Mesh, shape) -> NamedSharding:
    """A KV cache's keys or values [B, K, S, H]: rows over `data` (as `row_sharding`), KV heads over
    `tensor` (as the `kv_heads` of the key/value kernels), each only where the axis divides the
    dimension; the rest replicated. The head split keeps each device's cache beside the heads its
    share of the attention weights computes (inference on a sampling mesh, `rollout.placement`)."""
    spec = list(row_sharding(mesh, shape).spec)  # one entry per dimension
    t = mesh.shape.get("tensor", 1)
    if t > 1 and len(shape) > 1 and shape[1] % t == 0:
        spec[1] = "tensor"
    return NamedSharding(mesh, PartitionSpec(*spec))


def place_rows(x, mesh: jax.sharding.Mesh, batch_dim: int = 0, axis: str = "data"):
    """`x` (host or device array) on `mesh` with its rows split over `axis` (see `row_sharding`)."""
    return jax.device_put(x, row_sharding(mesh, np.shape(x), batch_dim, axis))
