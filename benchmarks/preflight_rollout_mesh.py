"""The rollout's sampling layouts on a TPU slice, side by side (AOT, libtpu venv; issue 37, item 4).

  TPU_SKIP_MDS_QUERY=1 TPU_WORKER_HOSTNAMES=localhost /tmp/tpuvenv/bin/python benchmarks/preflight_rollout_mesh.py \
      --config=configs/grpo.py:qwen25vl_7b --topology=v5p:2x4x4 --layouts=4x2,1x1

For each layout CHIPSxTENSOR of one host (`launch.preflight --rollout_chips=CHIPS --rollout_tensor=TENSOR`;
1x1 = one chip per host holding the host's batch and the whole policy) it compiles the rollout
functions named by `--functions` at depth points and extrapolates them to the model's depth, one
function at a time (`plan.compile_extrapolated`), so that a slow machine leaves the functions it
finished in the JSON. Then the summary row of `preflight.rollout.summary` (per-chip memory with both
copies of the weights, the cost model's decode tokens/s per chip, the weight reshard's bytes and
time) over the functions compiled. Writes benchmarks/results/preflight/rollout_sampling_mesh_<topology>.json
(or --out).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/grpo.py:qwen25vl_7b", "a configs/grpo.py preset")
_TOPOLOGY = flags.DEFINE_string("topology", "v5p:2x4x4", "TPU slice CHIP:AxB[xC]")
_LAYOUTS = flags.DEFINE_list("layouts", ["4x2", "1x1"], "CHIPSxTENSOR of one host's sampling mesh")
_FUNCTIONS = flags.DEFINE_list("functions", ["decode_chunk", "append@1024", "prefill@4096", "vision.append",
                                             "vision.prefill"],
                               "rollout functions to compile (a name contains one of these), in this order")
_OUT = flags.DEFINE_string("out", "", "JSON path (default benchmarks/results/preflight/rollout_sampling_mesh_<topology>.json)")


def main(argv):
    del argv
    from codedance_jax.preflight import topology as pf

    topo = _TOPOLOGY.value
    pf.offline_tpu_env(topo)
    from codedance_jax.preflight import plan as plans
    from codedance_jax.preflight import rollout as pr
    from codedance_jax.train.batching import collate

    config = _CONFIG.value
    cfg, _ = plans.model_config(config)
    out = _OUT.value or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "preflight",
                                     f"rollout_sampling_mesh_{topo.replace(':', '_')}.json")
    result = {"topology": topo, "config": config.model, "layouts": []}
    for layout in _LAYOUTS.value:
        chips, tensor = (int(x) for x in layout.split("x"))
        row = {"layout": layout, "rollout_chips": chips, "tensor": tensor, "reports": []}
        result["layouts"].append(row)
        reports, plan = [], None
        for want in _FUNCTIONS.value:
            def make_plan(depth=None, want=want, chips=chips, tensor=tensor):
                p = plans.plan_from_config(config, topo, empty_batch=lambda b, v: collate([], b, pad_id=0, vision_cfg=v),
                                           depth=depth, only="rollout", rollout_chips=chips, rollout_tensor=tensor)
                p.entries = [e for e in p.entries if want in e.name][:1]
                return p

            plan, got = plans.compile_extrapolated(make_plan, cfg.text.num_hidden_layers, cfg.vision.depth,
                                                   log=lambda m: print(m, flush=True), cfg=cfg)
            reports += got
            row["plan"] = plan.rollout
            row["reports"] = [r.as_dict() for r in reports]
            if any(r.name.startswith("rollout.decode_chunk") for r in reports):
                row["summary"] = pr.summary(plan.rollout_shape, plan.rollout_copies, reports, plan.chip)
                row["summary"]["functions_compiled"] = [r.name for r in reports]
            with open(out, "w") as f:
                json.dump(result, f, indent=1)
            print(pf.format_table(reports, topo), flush=True)
            if "summary" in row:
                print(pr.format_summary(row["summary"]), flush=True)
    print("wrote", out)


if __name__ == "__main__":
    app.run(main)
