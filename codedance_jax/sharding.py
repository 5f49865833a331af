"""Logical axis names -> mesh axes: one rules table, used for parameters, caches and batches.

Model code only names logical axes (`embed`, `mlp`, `q_heads`, ...). This table decides where
they go on a mesh with axes `data`, `fsdp`, `tensor` (any of which may have size 1). The mesh is
built with `AxisType.Explicit`-free defaults (`Auto`), so XLA's sharding propagation fills in
intermediate activations while parameters and inputs carry the shardings given here.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from codedance_jax.errors import ConfigError

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
