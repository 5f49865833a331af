"""The sampling layout: the mesh one host's rollouts run on, and the policy's parameters placed for it.

    mesh = sampling_mesh(-1)                      # every local device on `data`
    model = mdef.model(sampling_params(params, mesh))
    engine = RolloutEngine(model, processor, cfg, sampling, mesh=mesh)

`sampling_mesh(data)` is a (data, 1, 1) mesh over this process's own devices (`jax.local_devices()`,
never the global mesh): the engine splits every array with a row dimension over `data`
(`RolloutEngine(mesh=)`), so each device decodes its share of the rows with the whole policy.
`sampling_params(params, mesh)` places the trainer's parameters (any `NamedSharding` over the
trainer's mesh, fsdp/tensor-sharded or not) replicated over that mesh, on device only: one jitted
identity all-gathers the leaves that are sharded (collectives over the trainer's mesh), and the
copies that then sit on the sampling mesh's devices become the sampling arrays without a copy. A
leaf already placed so is passed through. The host never sees a parameter: host<->device transfers
are disallowed (`jax.transfer_guard_*("disallow_explicit")`) for the whole placement.

Not yet (issue 37): weights split over a `tensor` axis for a policy larger than one chip, and with
several processes each host still all-gathers whole copies over the global mesh (its chips then
hold the full policy, not only the shards they need).
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import NamedSharding, PartitionSpec

from codedance_jax import sharding
from codedance_jax.errors import ConfigError


def sampling_mesh(data: int = -1, devices=None) -> jax.sharding.Mesh:
    """A (data, 1, 1) mesh over the first `data` of this process's devices (-1: all of them).
    `devices`: the devices to draw from (default `jax.local_devices()`)."""
    local = list(jax.local_devices() if devices is None else devices)
    n = len(local) if int(data) == -1 else int(data)
    if not 1 <= n <= len(local):
        raise ConfigError(f"config.rollout.mesh_data={data}: this process has {len(local)} devices",
                          f"set it to -1 (all of them) or a count from 1 to {len(local)}")
    return sharding.make_mesh(n, 1, 1, devices=local[:n])


def mesh_summary(mesh: jax.sharding.Mesh | None) -> dict[str, int] | None:
    """{axis: size} of a mesh (None without one), as the rollout stats record it."""
    return None if mesh is None else {str(k): int(v) for k, v in mesh.shape.items()}


def _identity(x):
    return x


@functools.lru_cache(maxsize=32)
def _gather(out_shardings: tuple) -> jax.stages.Wrapped:
    # One compiled all-gather per layout (a fresh jit wrapper per call would re-trace every step).
    return jax.jit(_identity, out_shardings=out_shardings)


def sampling_params(params, mesh: jax.sharding.Mesh):
    """`params` (a pytree of arrays) replicated over `mesh`, device to device (see the module
    docstring). Leaves already replicated on exactly `mesh`'s devices are returned as they are."""
    target = NamedSharding(mesh, PartitionSpec())
    want = list(mesh.devices.flat)
    leaves, treedef = jax.tree.flatten(params)
    with jax.transfer_guard_host_to_device("disallow_explicit"), jax.transfer_guard_device_to_host("disallow_explicit"):
        todo = [i for i, x in enumerate(leaves)
                if not x.sharding.is_equivalent_to(target, x.ndim) and not x.is_fully_replicated]
        if todo:
            if not all(isinstance(leaves[i].sharding, NamedSharding) for i in todo):
                raise TypeError("sampling_params: a sharded parameter without a NamedSharding; place the parameters "
                                "on a mesh (`sharding.param_shardings`)")
            outs = tuple(NamedSharding(leaves[i].sharding.mesh, PartitionSpec()) for i in todo)
            got = _gather(outs)(tuple(leaves[i] for i in todo))
            for i, x in zip(todo, got, strict=True):
                leaves[i] = x
        out = []
        for x in leaves:  # now each leaf is whole on every device it lives on
            if x.sharding.is_equivalent_to(target, x.ndim):
                out.append(x)
                continue
            local = {s.device: s.data for s in x.addressable_shards}
            if all(d in local for d in want):  # the copies are there already: adopt them
                out.append(jax.make_array_from_single_device_arrays(x.shape, target, [local[d] for d in want]))
            else:  # e.g. one device's weights onto several: copied device to device
                out.append(jax.device_put(x, target))
    return jax.tree.unflatten(treedef, out)


def placement_record(mesh: jax.sharding.Mesh | None, arrays) -> dict:
    """{"sampling_devices": how many devices `arrays` (a pytree: the KV cache, the parameters) live on,
    "sampling_mesh": {axis: size} of the engine's mesh or None}: what a rollout's stats record."""
    devices = set()
    for x in jax.tree.leaves(arrays):
        if isinstance(x, jax.Array):
            devices |= x.sharding.device_set
    return {"sampling_devices": len(devices), "sampling_mesh": mesh_summary(mesh)}
