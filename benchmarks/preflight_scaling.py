"""Per-chip memory of a step as the TPU slice grows at a fixed per-chip batch (AOT, libtpu venv).

  /tmp/tpu-venv/bin/python benchmarks/preflight_scaling.py --config=configs/sft.py:tiny \
      --topologies=v5e:2x2,v5e:4x4,v5e:8x8,v5e:16x16 --rows_per_chip=2 --config.grad_accum=2
  /tmp/tpu-venv/bin/python benchmarks/preflight_scaling.py --config=configs/sft.py:qwen25vl_7b --depth=1,1 \
      --topologies=v5p:2x2x1,v5p:4x4x1,v5p:4x4x4,v5p:8x8x4 --rows_per_chip=1 --config.grad_accum=1

Prints a table and writes JSON to benchmarks/results/preflight_scaling_<preset>.json. Flat
temporaries (and arguments falling as the state splits over more chips) mean memory follows the
per-chip batch, not the global one.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/sft.py:tiny", "run config")
_TOPOS = flags.DEFINE_string("topologies", "v5e:2x2,v5e:4x4,v5e:8x8,v5e:16x16", "comma-separated slices")
_ROWS = flags.DEFINE_integer("rows_per_chip", 2, "rows per chip per micro-batch")
_BUCKET = flags.DEFINE_integer("bucket", 0, "bucket index")
_DEPTH = flags.DEFINE_list("depth", [], "TEXT,VISION: compile at this depth (a 7B step at full depth compiles for "
                           "tens of minutes here); empty = the model's")
_ONLY = flags.DEFINE_string("only", "", "GRPO: train | rollout (empty: both)")


def main(argv):
    del argv
    from codedance_jax.preflight import topology as pf

    topos = _TOPOS.value.split(",")
    pf.offline_tpu_env(topos[0])
    from codedance_jax.preflight import plan as preflight_plan
    from codedance_jax.train.batching import collate

    rows = []
    print("| topology | chips | global rows | function | args MiB | temp MiB | total MiB |\n|---|---|---|---|---|---|---|")
    for topo in topos:
        depth = tuple(int(x) for x in _DEPTH.value) or None
        plan = preflight_plan.plan_from_config(_CONFIG.value, topo, rows_per_chip=_ROWS.value, bucket=_BUCKET.value,
                                               empty_batch=lambda b, v: collate([], b, pad_id=0, vision_cfg=v),
                                               depth=depth, only=_ONLY.value)
        for r in preflight_plan.compile_plan(plan):
            rows.append(dict(topology=topo, global_rows=plan.rows, **r.as_dict()))
            print(f"| {topo} | {r.chips} | {plan.rows} | {r.name} | {r.argument_bytes / 2**20:.1f} | "
                  f"{r.temp_bytes / 2**20:.1f} | {r.total_bytes / 2**20:.1f} |", flush=True)
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                       f"preflight_scaling_{_CONFIG.value.model}" + ("_depth" + "_".join(_DEPTH.value) if _DEPTH.value else "")
                       + ".json")
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    app.run(main)
