"""The trainer -> sampler weight placement compiled for a TPU slice: its memory per chip (AOT, libtpu venv).

  TPU_SKIP_MDS_QUERY=1 TPU_WORKER_HOSTNAMES=localhost /tmp/tpuvenv/bin/python benchmarks/preflight_reshard.py \
      --config=configs/grpo.py:qwen25vl_7b --topology=v5p:2x4x4 --tensor=4

`placement.sampling_params` runs one jitted program per step over every process's devices: the
trainer's parameters (fsdp over the slice) cast to the compute dtype and laid out on a "cover" mesh
(the slice's devices in the trainer mesh's order, reshaped), each leaf split over `tensor` as
`sampler_spec` asks. This compiles that program at full depth on the slice's
compile-only devices, with the trainer mesh in the device order a run builds (`sharding.make_mesh`:
`jax.devices()`, by id), finds the placement's cover there (`placement._factor_cover`: a reshape of
the device list on which each host's chips keep their tensor index; without one the placement
gathers whole leaves first) and prints arguments, outputs and
temporaries per chip beside HBM, with the trainer's optimizer state (held meanwhile) added. One slice
per process (libtpu reads its environment once). Writes
benchmarks/results/preflight/reshard_<chip>_<date>.json (or --out).
"""

import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/grpo.py:qwen25vl_7b", "a configs/grpo.py preset")
_TOPOLOGY = flags.DEFINE_string("topology", "v5p:2x4x4", "TPU slice CHIP:AxB[xC]")
_TENSOR = flags.DEFINE_integer("tensor", 4, "the sampling mesh's tensor size (chips of a host sharing the weights)")
_CHUNK = flags.DEFINE_float("chunk_gib", -1.0, "compile the placement in programs of at most this many GiB of whole "
                            "(sampler-dtype) leaves each and report the largest one's temporaries (-1: the "
                            "placement's own PLACEMENT_CHUNK_BYTES; 0: one program)")
_OUT = flags.DEFINE_string("out", "", "JSON path")


def measure(config, topology: str, tensor: int) -> dict:
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from codedance_jax import sharding
    from codedance_jax.preflight import plan as plans
    from codedance_jax.preflight import rollout as pr
    from codedance_jax.preflight import topology as pf
    from codedance_jax.rollout import placement
    from codedance_jax.rollout.placement import sampler_dtype
    from codedance_jax.train import optim
    from codedance_jax.train import state as st

    cfg, _ = plans.model_config(config)
    chip, _ = pf.parse_topology(topology)
    devices = sorted(pf.topology_devices(topology), key=lambda d: d.id)  # jax.devices() order
    mesh = sharding.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor, devices=devices)
    tx, _ = optim.make_optimizer(config.optim, config.total_steps)
    _, state, _ = plans.abstract_train_state(cfg, tx, mesh, None)
    have = list(mesh.devices.flat)
    at = {d: q for q, d in enumerate(have)}
    hosts: dict = {}
    for d in devices:
        hosts.setdefault(d.process_index, []).append(d)
    # The placement's own cover (`placement._cover` for a run's processes): each host's first
    # `tensor` chips, in the slice's order, at tensor index 0..tensor-1.
    index = {at[d]: p for hs in hosts.values() for p, d in enumerate(hs[:tensor])}
    cover = placement._factor_cover(tuple(have), index, tensor)
    cover_ok = cover is not None
    if cover is None:  # the program measured is then the simple reshape's, which the run cannot use
        cover = Mesh(np.asarray(have).reshape(-1, 1, tensor), ("data", "fsdp", "tensor"))
    first = next(iter(hosts.values()))[:tensor]
    host_mesh = Mesh(np.asarray(first).reshape(1, 1, tensor), ("data", "fsdp", "tensor"))
    _, abstract = st.abstract_params(cfg)
    specs = jax.tree.leaves(pr.sampler_param_shardings(abstract, host_mesh, None))
    leaves = jax.tree.leaves(state.params)
    dtypes = [sampler_dtype(x.dtype, cfg.compute_dtype) for x in leaves]
    outs = tuple(placement._on_cover(cover, s.spec) for s in specs)
    limit = placement.PLACEMENT_CHUNK_BYTES if _CHUNK.value < 0 else (_CHUNK.value * 2**30 or float("inf"))
    cast = [jax.ShapeDtypeStruct(x.shape, d) for x, d in zip(leaves, dtypes, strict=True)]
    groups = placement._chunks(range(len(leaves)), cast, limit)  # the placement's own programs
    args = out_b = temp = alias = 0
    largest = []
    for idx in groups:
        ds = [dtypes[i] for i in idx]
        fn = jax.jit(lambda xs, ds=ds: tuple(x.astype(d) for x, d in zip(xs, ds, strict=True)),
                     out_shardings=tuple(outs[i] for i in idx))
        compiled = fn.lower(tuple(leaves[i] for i in idx)).compile()
        mem = compiled.memory_analysis()
        args, out_b, alias = args + mem.argument_size_in_bytes, out_b + mem.output_size_in_bytes, alias + mem.alias_size_in_bytes
        if mem.temp_size_in_bytes >= temp:
            temp, largest = mem.temp_size_in_bytes, pf.largest_buffers(compiled.as_text())[:6]
    held = pr.per_chip_bytes(state) - pr.per_chip_bytes(state.params)  # the optimizer state, not an argument
    # Without a cover the placement makes every leaf whole on each sampling device first (`_replicated`).
    whole = sum(int(np.prod(x.shape)) * np.dtype(d).itemsize for x, d in zip(leaves, dtypes, strict=True))
    # Every trainer shard (arguments, not donated) and every sampler shard (outputs, kept) at the end,
    # with the largest program's temporaries: an upper bound on the peak.
    total = args + temp + out_b - alias + held
    return {"topology": topology, "chips": len(devices), "hosts": len(hosts), "tensor": tensor, "cover_exists": cover_ok,
            "cover_mesh": {str(k): int(v) for k, v in cover.shape.items()},
            "programs": len(groups), "chunk_bytes": limit if limit == float("inf") else int(limit),
            "argument_bytes": int(args), "output_bytes": int(out_b),
            "temp_bytes": int(temp), "alias_bytes": int(alias), "held_bytes": int(held),
            "total_bytes": int(total), "hbm_bytes": int(chip.hbm_bytes), "hbm_frac": total / chip.hbm_bytes,
            "whole_policy_bytes": int(whole),
            "largest": [[int(b), k] for b, k in largest]}


def main(argv):
    del argv
    from codedance_jax.preflight import topology as pf

    topo = _TOPOLOGY.value
    pf.offline_tpu_env(topo)
    rows = [measure(_CONFIG.value, topo, _TENSOR.value)]
    g = 2**30
    print("| slice | hosts | tensor | cover mesh | trainer params (args) | temporaries | sampler copy (out) | optimizer state held | total | % HBM | whole policy (no cover) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cover = " x ".join(f"{k} {v}" for k, v in r["cover_mesh"].items()) if r["cover_exists"] else "none"
        print(f"| {r['topology']} | {r['hosts']} | {r['tensor']} | {cover} | {r['argument_bytes'] / g:.2f} | "
              f"{r['temp_bytes'] / g:.2f} | {r['output_bytes'] / g:.2f} | {r['held_bytes'] / g:.2f} | {r['total_bytes'] / g:.2f} | "
              f"{100 * r['hbm_frac']:.1f} | {r['whole_policy_bytes'] / g:.2f} |")
        if not r["cover_exists"]:
            print(f"- {r['topology']}: in this device order a host's chips do not keep their tensor index on the cover "
                  "mesh, so `sampling_params` would take its fallback: every leaf whole on each sampling chip "
                  f"({r['whole_policy_bytes'] / g:.2f} GiB) before each keeps its part. The compiled row is the "
                  "cover program the run cannot use here.")
    out = _OUT.value or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "preflight",
                                     f"reshard_{topo.split(':')[0]}_{datetime.date.today().isoformat()}.json")
    with open(out, "w") as f:
        json.dump({"config": _CONFIG.value.model, "rows": rows}, f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    app.run(main)
