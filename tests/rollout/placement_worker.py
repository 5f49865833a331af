"""One process of tests/rollout/test_sampling_mesh_multiprocess.py: 4 CPU devices, joined to the
others by gloo on 127.0.0.1. argv: coordinator port, process count, process id, trainer mesh
(data,fsdp,tensor over all processes' devices), sampling tensor sizes. Prints one JSON line per
sampling mesh; any failed check exits non-zero."""

import json
import os
import sys

import jax

jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, n_proc, pid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n_proc, process_id=pid)

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model_helpers import tiny_small_vocab  # noqa: E402

from codedance_jax import sharding  # noqa: E402
from codedance_jax.model import Qwen25VL  # noqa: E402
from codedance_jax.rollout.placement import placement_programs, sampling_mesh, sampling_params  # noqa: E402

trainer_mesh = sharding.make_mesh(*(int(v) for v in sys.argv[4].split(",")))
seed = int(sys.argv[6])
model = Qwen25VL(tiny_small_vocab(vocab=1024), rngs=nnx.Rngs(seed))  # the same weights in every process
_, state = nnx.split(model)
host = jax.tree.map(np.asarray, state)
shardings, _ = sharding.param_shardings(state, trainer_mesh)
leaves, treedef = jax.tree.flatten(host)
trainer = jax.tree.unflatten(treedef, [jax.make_array_from_callback(h.shape, s, lambda i, h=h: h[i])
                                       for h, s in zip(leaves, jax.tree.leaves(shardings), strict=True)])
gathered = [np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in jax.tree.leaves(trainer)]
for g, h in zip(gathered, jax.tree.leaves(host), strict=True):  # the trainer's leaves, gathered by the test
    np.testing.assert_array_equal(g, h)

for data, t in (tuple(int(v) for v in m.split("x")) for m in sys.argv[5].split(",")):
    mesh = sampling_mesh(data, t)
    with jax.transfer_guard("disallow"):
        placed = sampling_params(trainer, mesh)
    split, whole = set(), set()  # the shapes of the leaves `tensor` splits, and of those it leaves whole
    shard_bytes = 0  # one device's bytes of the placed parameters (its shards)
    variables = jax.tree.leaves(placed, is_leaf=lambda x: isinstance(x, nnx.Variable))
    for var, want in zip(variables, gathered, strict=True):
        x = var.get_value()
        assert x.sharding == NamedSharding(mesh, x.sharding.spec), x.sharding
        spec = tuple(x.sharding.spec)
        if "tensor" in spec:
            split.add(x.shape)
            d = spec.index("tensor")
            assert all(s.data.shape[d] == x.shape[d] // t for s in x.addressable_shards)
        else:
            whole.add(x.shape)
        assert x.sharding.device_set == set(mesh.devices.flat) <= set(jax.local_devices())
        for s in x.addressable_shards:  # bit for bit the trainer's slice
            np.testing.assert_array_equal(np.asarray(s.data), want[s.index])
        shard_bytes += x.addressable_shards[0].data.nbytes
    again = sampling_params(placed, mesh)
    assert all(a is b for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(placed), strict=True))
    # What the placement's programs put on each device: shards of the split leaves, never one whole.
    programs = placement_programs(trainer, mesh)
    whole_split = [x.shape for c in programs for sh, x in zip(c.output_shardings, c.out_info, strict=True)
                   if x.shape in split - whole and sh.shard_shape(x.shape) == x.shape]
    mem = [c.memory_analysis() for c in programs]
    # The embedding and the head (vocabulary 1024: no other leaf has that dimension) are never whole
    # in the programs, temporaries included. (Other shapes are ambiguous: one leaf's whole shape is
    # another's trainer shard.)
    hlo = "\n".join(c.as_text() for c in programs)
    whole_in_hlo = [list(shape) for shape in split - whole
                    if 1024 in shape and f"f32[{','.join(map(str, shape))}]" in hlo]
    print("RESULT " + json.dumps({
        "process": pid, "data": data, "tensor": t, "split": len(split), "programs": len(programs),
        "whole_split": [list(s) for s in whole_split], "whole_in_hlo": whole_in_hlo, "shard_bytes": shard_bytes, "leaves": len(variables),
        "output_bytes": sum(m.output_size_in_bytes for m in mem), "temp_bytes": max(m.temp_size_in_bytes for m in mem)}),
        flush=True)
jax.distributed.shutdown()
