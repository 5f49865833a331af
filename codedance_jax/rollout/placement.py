"""The sampling layout: the mesh one host's rollouts run on, and the policy's parameters placed for it.

    mesh = sampling_mesh(-1)                      # every local device on `data`
    mesh = sampling_mesh(-1, tensor=2)            # or: pairs of devices share the weights
    model = mdef.model(sampling_params(params, mesh))
    engine = RolloutEngine(model, processor, cfg, sampling, mesh=mesh)

`sampling_mesh(data, tensor)` is a (data, 1, tensor) mesh over this process's own devices
(`jax.local_devices()`, never the global mesh): the engine splits every array with a row dimension
over `data` (`RolloutEngine(mesh=)`), so each data slice decodes its share of the rows, and with
`tensor` > 1 each slice's devices hold the policy split by attention heads, MLP columns and
vocabulary (for a policy larger than one chip) and its KV cache split by KV heads.

`sampling_params(params, mesh)` places the trainer's parameters (any `NamedSharding` over the
trainer's mesh, fsdp/tensor-sharded or not) for that mesh, on device only. The host never sees a
parameter: host<->device transfers are disallowed (`jax.transfer_guard_*("disallow_explicit")`)
for the whole placement.
* tensor = 1: replicated. One jitted identity all-gathers the leaves that are sharded (collectives
  over the trainer's mesh), and the copies that then sit on the sampling mesh's devices become the
  sampling arrays without a copy. A leaf already placed so is passed through; every leaf comes back
  with the one sharding `NamedSharding(mesh, P())`, so engines built from a trainer's state and
  from a checkpoint on the same mesh run the same compiled programs (the demo's evaluations and
  its GRPO rollouts). The whole leaf is what each sampling device needs here, so the gather moves
  nothing that is not kept, with one process or several.
* tensor > 1: each `nnx.Variable` split as the model's logical axes ask through the trainer's
  rules table, restricted to the sampling mesh: only `tensor` targets count (no fsdp, no data
  sharding of weights), a dimension that `tensor` does not divide stays whole (`sharding.fit_spec`,
  e.g. 2 KV heads on 4 devices); leaves without logical axes are replicated. Jitted identities
  lay the leaves out from the trainer's mesh onto a "cover" mesh: the trainer's devices in their
  order (jit takes no other order, nor a subset), reshaped so that a group of its axes gives each
  sampling device its index on the sampling mesh (`_factor_cover`: (n / tensor, tensor) when a
  host's chips are neighbours in that order, (8, 2, 8, 2) for v5e-256's 2 x 2 hosts); XLA then
  moves only the shards each device needs, and the sampling devices' shards are adopted without a
  copy. One program per PLACEMENT_CHUNK_BYTES of leaves bounds the temporaries. With several
  processes the cover spans every process's devices (the trainer's global mesh), so each host
  receives exactly its chips' shards; the program must be the same in every process, so the
  condition is checked for every process's sampling devices, taken at the local positions this
  process's have (every process builds its sampling mesh alike, as `sampling_mesh` does). Where no
  cover exists (no reshape of at most 4 axes gives every sampling device its index) the leaves are
  first made whole as for tensor = 1 and each device keeps its part. Every leaf comes back with
  exactly its target sharding. `placement_programs` returns the compiled programs, for their memory per device and what each device receives
  (tests/rollout/test_sampling_mesh_multiprocess.py: 2 processes, one program, no device receives a
  whole leaf that `tensor` splits; benchmarks/preflight_reshard.py: the 7B on a slice).

Not yet: XLA's partitioner moves a leaf split over fsdp on one dimension to a split over tensor on
another by gathering it whole and slicing it (it logs "Involuntary full rematerialization" when it
compiles the placement), so with such a trainer layout (e.g. a (1, n, 1) mesh) a chip briefly holds
whole leaves in the program's temporaries, as many as one program of PLACEMENT_CHUNK_BYTES has (the
7B onto v5e-256: 2.2 GiB). With the default rules `tensor` splits the same
dimension for trainer and sampler: the 2-process test's placements from (2, 2, 2) and (1, 4, 2)
hold the embedding and head (the largest leaves) only as shards, temporaries included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from codedance_jax import sharding
from codedance_jax.errors import ConfigError


def sampling_mesh(data: int = -1, tensor: int = 1, devices=None) -> jax.sharding.Mesh:
    """A (data, 1, tensor) mesh over the first data x tensor of this process's devices; data = -1: all
    of them that `tensor` leaves (their count must then divide by `tensor`). Tensor groups are
    neighbouring devices. `devices`: the devices to draw from (default `jax.local_devices()`)."""
    local = list(jax.local_devices() if devices is None else devices)
    data, tensor = int(data), int(tensor)
    if tensor < 1 or tensor > len(local) or (data == -1 and len(local) % tensor):
        raise ConfigError(f"config.rollout.mesh_tensor={tensor}: this process has {len(local)} devices, which do "
                          f"not split into groups of {tensor}",
                          f"set it to a divisor of {len(local)} (1: the policy whole on every device)")
    n = len(local) // tensor if data == -1 else data
    if not 1 <= n * tensor <= len(local):
        raise ConfigError(f"config.rollout.mesh_data={data}: this process has {len(local)} devices"
                          + (f" ({len(local) // tensor} groups of mesh_tensor={tensor})" if tensor > 1 else ""),
                          f"set it to -1 (all of them) or a count from 1 to {len(local) // tensor}")
    return sharding.make_mesh(n, 1, tensor, devices=local[: n * tensor])


def rollout_sampling_mesh(rollout) -> jax.sharding.Mesh:
    """The sampling mesh a run's `rollout` config block names: `mesh_data` (-1: every device that
    `mesh_tensor` leaves) x `mesh_tensor` of this process's devices, checked against the block's
    `batch_multiple` (the engine splits every row bucket over `data`). The GRPO loop and
    `launch.eval` build theirs here."""
    data, tensor = int(rollout.get("mesh_data", -1)), int(rollout.get("mesh_tensor", 1))
    sm = sampling_mesh(data, tensor)
    n, multiple = sm.shape["data"], int(rollout.batch_multiple)
    if multiple % n:
        raise ConfigError(f"config.rollout.batch_multiple={multiple} is not a multiple of the sampling mesh's {n} "
                          f"data slices (config.rollout.mesh_data={data}, mesh_tensor={tensor}): the rows of a "
                          "batch could not be split over them",
                          f"set config.rollout.batch_multiple to a multiple of {n}, or config.rollout.mesh_data "
                          f"to a divisor of {multiple}")
    return sm


def mesh_summary(mesh: jax.sharding.Mesh | None) -> dict[str, int] | None:
    """{axis: size} of a mesh (None without one), as the rollout stats record it."""
    return None if mesh is None else {str(k): int(v) for k, v in mesh.shape.items()}


def _identity(x):
    return x


@functools.lru_cache(maxsize=32)
def _gather(out_shardings: tuple) -> jax.stages.Wrapped:
    # One compiled all-gather per layout (a fresh jit wrapper per call would re-trace every step).
    return jax.jit(_identity, out_shardings=out_shardings)


def sampler_dtype(dtype, compute_dtype):
    """The dtype of a parameter's sampling copy: `compute_dtype` for a wider float (float32 weights of
    a bfloat16 model), else its own. The model casts every weight to its compute dtype where it uses
    it (`sharding.gather_param`, the embedding lookup, the vision tower's `dtype`), so the sampler's
    outputs are the same bit for bit, in half the memory and half the bytes moved."""
    dtype = np.dtype(dtype)
    if compute_dtype is None or not np.issubdtype(dtype, np.floating):
        return dtype
    compute_dtype = np.dtype(compute_dtype)
    return compute_dtype if dtype.itemsize > compute_dtype.itemsize else dtype


@functools.lru_cache(maxsize=32)
def _caster(dtypes: tuple, out_shardings: tuple) -> jax.stages.Wrapped:
    return jax.jit(lambda xs: tuple(x.astype(d) for x, d in zip(xs, dtypes, strict=True)), out_shardings=out_shardings)


def _cast(leaves: list, compute_dtype) -> list:
    """`leaves` in their `sampler_dtype`, each cast on its own devices in its own layout (the trainer's
    shards: nothing moves), before the placement moves them."""
    todo = [i for i, x in enumerate(leaves) if sampler_dtype(x.dtype, compute_dtype) != x.dtype]
    if not todo:
        return leaves
    dtypes = tuple(sampler_dtype(leaves[i].dtype, compute_dtype) for i in todo)
    got = _caster(dtypes, tuple(leaves[i].sharding for i in todo))(tuple(leaves[i] for i in todo))
    out = list(leaves)
    for i, x in zip(todo, got, strict=True):
        out[i] = x
    return out


def sampling_params(params, mesh: jax.sharding.Mesh, rules=None, *, compute_dtype=None):
    """`params` (a pytree of arrays, or an `nnx.State`) laid out for `mesh`, device to device (see the
    module docstring): replicated when the mesh's `tensor` axis is 1; else each `nnx.Variable` split
    over `tensor` as its logical axes ask (`rules`: the trainer's table, default
    `sharding.DEFAULT_RULES`; only its `tensor` targets count) and every other leaf replicated.
    `compute_dtype` (the model's): wider float leaves are cast to it first (`sampler_dtype`). Leaves
    already laid out so are returned as they are."""
    leaves, treedef = jax.tree.flatten(params)
    with _no_host_transfers():
        leaves = _cast(leaves, compute_dtype)
    params = jax.tree.unflatten(treedef, leaves)
    plan = _plan(params, mesh, rules)
    out = list(leaves)
    with _no_host_transfers():
        if plan.replicate is not None:
            return jax.tree.unflatten(treedef, _replicated(leaves, mesh))
        for i in plan.adopt:
            out[i] = _adopt(leaves[i], plan.targets[i])
        for cover, every in plan.direct.items():
            for idx in _chunks(every, leaves):
                got = _gather(tuple(_on_cover(cover, plan.targets[i].spec) for i in idx))(tuple(leaves[i] for i in idx))
                for i, x in zip(idx, got, strict=True):
                    out[i] = x if cover is mesh else _adopt(x, plan.targets[i])
        if plan.rest:  # whole on every sampling device first, then each device keeps its part (no transfer)
            whole = _replicated([leaves[i] for i in plan.rest], mesh)
            for i, x in zip(plan.rest, _gather(tuple(plan.targets[i] for i in plan.rest))(tuple(whole)), strict=True):
                out[i] = x
    return jax.tree.unflatten(treedef, out)


def sampling_model(model, mesh: jax.sharding.Mesh, rules=None):
    """`model` (an NNX module) with its parameters placed for `mesh` by `sampling_params`, in the
    model's compute dtype (`sampler_dtype`). The caller rebinds its name to the result: the loaded
    arrays are then unreferenced and freed, and one copy of the policy stays."""
    compute_dtype = model.cfg.compute_dtype if hasattr(model, "cfg") else None
    graphdef, state = nnx.split(model)
    del model
    return nnx.merge(graphdef, sampling_params(state, mesh, rules, compute_dtype=compute_dtype))


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How `sampling_params` moves each leaf (indices into the flat leaves)."""
    targets: list  # NamedSharding per leaf on the sampling mesh
    replicate: list | None = None  # tensor = 1: every leaf replicated (`_replicated`)
    adopt: list = dataclasses.field(default_factory=list)  # the right shards already, on another mesh
    direct: dict = dataclasses.field(default_factory=dict)  # cover mesh -> leaves one program lays out
    rest: list = dataclasses.field(default_factory=list)  # made whole first, then sliced


def _plan(params, mesh: jax.sharding.Mesh, rules) -> _Plan:
    leaves = jax.tree.leaves(params)
    if mesh.shape.get("tensor", 1) == 1:
        return _Plan([NamedSharding(mesh, PartitionSpec())] * len(leaves), replicate=list(range(len(leaves))))
    targets = [NamedSharding(mesh, sampler_spec(v, mesh, rules))
               for v in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))]
    if len(targets) != len(leaves):
        raise TypeError("sampling_params: each nnx.Variable must hold one array")
    plan = _Plan(targets)
    for i, x in enumerate(leaves):
        if x.sharding == targets[i]:
            continue
        if x.sharding.is_equivalent_to(targets[i], x.ndim):  # the right shards on another mesh
            plan.adopt.append(i)
            continue
        cover = _cover(x.sharding, mesh)
        (plan.rest if cover is None else plan.direct.setdefault(cover, [])).append(i)
    return plan


def placement_programs(params, mesh: jax.sharding.Mesh, rules=None) -> list[jax.stages.Compiled]:
    """The compiled programs `sampling_params(params, mesh, rules)` runs, in order (their memory per
    device: `memory_analysis()`; what each device receives: `output_shardings`). Compiling them
    compiles nothing twice: they are the placement's own jitted functions."""
    leaves = jax.tree.leaves(params)
    plan = _plan(params, mesh, rules)
    out = []
    for cover, every in plan.direct.items():
        for idx in _chunks(every, leaves):
            outs = tuple(_on_cover(cover, plan.targets[i].spec) for i in idx)
            out.append(_gather(outs).lower(tuple(leaves[i] for i in idx)).compile())
    whole = NamedSharding(mesh, PartitionSpec())
    todo = plan.replicate if plan.replicate is not None else plan.rest
    gather = [i for i in todo if not leaves[i].is_fully_replicated and not leaves[i].sharding.is_equivalent_to(whole, leaves[i].ndim)]
    if gather:  # `_replicated`'s all-gather
        outs = tuple(NamedSharding(leaves[i].sharding.mesh, PartitionSpec()) for i in gather)
        out.append(_gather(outs).lower(tuple(leaves[i] for i in gather)).compile())
    if plan.rest:
        args = tuple(jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype, sharding=whole) for i in plan.rest)
        out.append(_gather(tuple(plan.targets[i] for i in plan.rest)).lower(args).compile())
    return out


# The most bytes of whole leaves one placement program moves. XLA moves a leaf split over fsdp on one
# dimension to `tensor` on another by gathering it whole, and in one program for the whole policy it
# kept many such leaves at once: the 7B onto v5e-256 at tensor 4 needed 10.9 GiB of temporaries per
# chip (96% of HBM with the rest); in programs of at most 1 GiB, 2.2 GiB (the largest leaf, the bf16
# output layer, whole) and 41% (benchmarks/preflight_reshard.py).
PLACEMENT_CHUNK_BYTES = 1 << 30


def _chunks(idx: list, leaves: list, limit: float | None = None) -> list[list]:
    """`idx` in runs of leaves whose whole sizes add up to at most `limit` bytes (default
    PLACEMENT_CHUNK_BYTES; a larger leaf alone): one placement program each."""
    limit = PLACEMENT_CHUNK_BYTES if limit is None else limit
    out, size = [[]], 0
    for i in idx:
        b = int(np.prod(leaves[i].shape)) * np.dtype(leaves[i].dtype).itemsize
        if out[-1] and size + b > limit:
            out.append([])
            size = 0
        out[-1].append(i)
        size += b
    return out if out[0] else []


@contextlib.contextmanager
def _no_host_transfers():
    """Host<->device copies fail inside: a placement that would go through the host is a bug."""
    with jax.transfer_guard_host_to_device("disallow_explicit"), jax.transfer_guard_device_to_host("disallow_explicit"):
        yield


def _replicated(leaves: list, mesh: jax.sharding.Mesh) -> list:
    """`leaves` replicated over `mesh`: sharded ones all-gathered over their own (the trainer's) mesh
    by one jitted identity, then the copies that sit on `mesh`'s devices adopted without a copy."""
    target = NamedSharding(mesh, PartitionSpec())
    want = list(mesh.devices.flat)
    leaves = list(leaves)
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
        if x.sharding == target:
            out.append(x)
            continue
        local = {s.device: s.data for s in x.addressable_shards}
        if all(d in local for d in want):  # the copies are there already (maybe as `target`): adopt them
            out.append(jax.make_array_from_single_device_arrays(x.shape, target, [local[d] for d in want]))
        else:  # e.g. one device's weights onto several: copied device to device
            out.append(jax.device_put(x, target))
    return out


def sampler_spec(leaf, mesh: jax.sharding.Mesh, rules=None) -> PartitionSpec:
    """A parameter's PartitionSpec on a sampling mesh: its logical axes through `rules` with every
    target but `tensor` removed (no fsdp, and no data sharding of weights: each data slice runs the
    whole policy), dimensions that `tensor` does not divide replicated (`sharding.fit_spec`). A leaf
    without logical axes (not an `nnx.Variable`) is replicated. (The pod preflight sizes the sampler's
    copy with it too.)"""
    axes = leaf.get_metadata().get("out_sharding") if isinstance(leaf, nnx.Variable) else None
    if not axes:
        return PartitionSpec()
    table = []
    for name, target in sharding.DEFAULT_RULES if rules is None else rules:
        targets = () if target is None else ((target,) if isinstance(target, str) else tuple(target))
        table.append((name, "tensor" if "tensor" in targets else None))
    return sharding.fit_spec(sharding.logical_to_spec(axes, table, mesh), leaf.shape, mesh)


def _cover(src, mesh: jax.sharding.Mesh) -> jax.sharding.Mesh | None:
    """A mesh over the devices of `src`'s mesh in their order (what a jitted identity from `src` may
    lay its output out on: jit takes no other device order, nor a subset) on which each of `mesh`'s
    devices has its tensor index in `mesh`: `mesh` itself when the devices are the same; else the
    device list reshaped by `_factor_cover` (its `tensor` axis a group of axes; `_on_cover` maps a
    spec onto it). With several processes the program must be the same on all of them, so the
    condition is checked for every process's sampling devices (`_sampling_devices`). None where
    there is none."""
    if not isinstance(src, NamedSharding):
        return None
    have, want = tuple(src.mesh.devices.flat), tuple(mesh.devices.flat)
    if have == want:
        return mesh
    return _cover_of(have, want, mesh.shape["tensor"])


@functools.lru_cache(maxsize=32)
def _cover_of(have: tuple, want: tuple, t: int) -> jax.sharding.Mesh | None:
    # Cached: every leaf of a policy asks for the same cover, every step.
    every = _sampling_devices(want)
    if every is None:
        return None
    at = {d: q for q, d in enumerate(have)}
    if any(d not in at for w in every for d in w):
        return None
    index = {at[d]: p % t for w in every for p, d in enumerate(w)}  # flat position -> tensor index
    return _factor_cover(have, index, t)


def _factorizations(n: int, most: int) -> list[tuple[int, ...]]:
    """Ordered factorizations of n into at most `most` factors > 1 (n itself included)."""
    if n == 1:
        return [()]
    if most == 0:
        return []
    out = []
    for f in range(2, n + 1):
        if n % f == 0:
            out += [(f, *rest) for rest in _factorizations(n // f, most - 1)]
    return out


def _factor_cover(have: tuple, index: dict, t: int, most: int = 4) -> jax.sharding.Mesh | None:
    """`have` reshaped into a mesh of axes c0, c1, ... where some group of axes, read in order, gives
    each position in `index` its tensor index: e.g. (n / t, t) when a host's chips are neighbours in
    the order (v5p, ids 4h..4h+3), (8, 2, 8, 2) with axes (c1, c3) when a host owns a 2 x 2 block of a
    16 x 16 slice in row-major order (v5e-256: ids 0, 1, 16, 17 for host 0). The group is the
    `tensor` axis of `_on_cover`'s specs (named tile<i>). None when no reshape of at most `most`
    axes does it."""
    n = len(have)
    pos = np.asarray(sorted(index))
    want = np.asarray([index[q] for q in pos])
    for shape in _factorizations(n, most):
        digits = np.asarray(np.unravel_index(pos, shape))  # [axes, positions]
        for k in range(1, len(shape) + 1):
            for group in itertools.combinations(range(len(shape)), k):
                if int(np.prod([shape[a] for a in group])) != t:
                    continue
                got = np.ravel_multi_index(tuple(digits[a] for a in group), tuple(shape[a] for a in group))
                if np.array_equal(got, want):  # the group's axes are named tile<i>, the others c<i>
                    names = tuple(f"tile{a}" if a in group else f"c{a}" for a in range(len(shape)))
                    return jax.sharding.Mesh(np.asarray(have, dtype=object).reshape(shape), names)
    return None


def _on_cover(cover: jax.sharding.Mesh, spec: PartitionSpec) -> NamedSharding:
    """`spec` (a sampling-mesh spec: "tensor" or None per dimension) as a sharding on `cover`: the
    sampling mesh itself, or a `_factor_cover` mesh whose tile<i> axes play `tensor`."""
    if "tensor" in cover.axis_names:
        return NamedSharding(cover, spec)
    tiles = tuple(a for a in cover.axis_names if a.startswith("tile"))
    return NamedSharding(cover, PartitionSpec(*(tiles if e in ("tensor", ("tensor",)) else e for e in spec)))


def _sampling_devices(want: tuple) -> list[tuple] | None:
    """Every process's sampling devices, in mesh order: `want` (this process's) alone with one
    process; with several, each process's local devices at the positions `want` has among this
    process's (every process builds its sampling mesh alike: `sampling_mesh` takes the first devices
    of `jax.local_devices()`). None when `want` is not this process's own devices or a process has
    too few."""
    if jax.process_count() == 1:
        return [want]
    local = jax.local_devices()
    if any(d not in local for d in want):
        return None
    pos = [local.index(d) for d in want]
    every = []
    for p in range(jax.process_count()):
        theirs = jax.local_devices(process_index=p)
        if max(pos) >= len(theirs):
            return None
        every.append(tuple(theirs[k] for k in pos))
    return every


def _adopt(x, target: NamedSharding):
    """`x` (laid out on a cover mesh) as an array on `target`'s devices: their shards, not copied."""
    local = {s.device: s.data for s in x.addressable_shards}
    return jax.make_array_from_single_device_arrays(x.shape, target, [local[d] for d in target.mesh.devices.flat])


def placement_record(mesh: jax.sharding.Mesh | None, arrays) -> dict:
    """{"sampling_devices": how many devices `arrays` (a pytree: the KV cache, the parameters) live on,
    "sampling_mesh": {axis: size} of the engine's mesh or None}: what a rollout's stats record."""
    devices = set()
    for x in jax.tree.leaves(arrays):
        if isinstance(x, jax.Array):
            devices |= x.sharding.device_set
    return {"sampling_devices": len(devices), "sampling_mesh": mesh_summary(mesh)}
