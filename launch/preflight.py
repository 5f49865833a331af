r"""Compile a run's jitted steps for a TPU slice on this (CPU) machine: memory and cost model per chip.

  python -m launch.preflight --config=configs/sft.py:qwen25vl_7b --config.grad_accum=2 --topology=v5p:4x4x4
  python -m launch.preflight --config=configs/grpo.py:qwen25vl_7b --topology=v5p:4x4x4
  python -m launch.preflight --config=configs/grpo.py:qwen25vl_7b --topology=v5p:4x4x4 --only=rollout
  python -m launch.preflight --config=configs/grpo.py:qwen25vl_7b --topology=v5e:16x16 --only=rollout --rollout_tensor=4
  python -m launch.preflight --config=configs/grpo.py:tiny --topology=v5e:2x2 --all_buckets   # every bucket's steps
  python -m launch.preflight --config=configs/sft.py:qwen25vl_7b --config.grad_accum=2 --extrapolate_depth --cost_model

--cost_model compiles the training steps as one micro-batch with the output layer in one chunk:
XLA's cost analysis counts a loop body once, so only this variant's MFU column covers the step.
With attention "auto" (the configs' default) the steps use the Pallas flash kernel, as on a pod.

A GRPO config also compiles the rollout engine's jitted functions (prefill at each prompt bucket,
decode chunk, append at each observation bucket, vision) for ONE host of the slice (4 chips per
host) at its share of the rollout batch, on the host's sampling mesh (`--rollout_chips` chips as
data x `--rollout_tensor`; default the config's rollout.mesh_data x mesh_tensor), with the
trainer's state counted beside the sampler's copy; it then prints per-chip memory, the cost
model's decode tokens/s per chip and the weight reshard's bytes and time
(`codedance_jax/preflight/rollout.py`).

Needs libtpu (`pip install -r requirements-tpu.txt`, best in a venv of its own). Nothing runs on a
TPU and nothing reaches a network. Exit 0: everything fits; 2: something does not (its largest
buffers are named) or the command line is wrong (one line on stderr).
"""

from __future__ import annotations

import json
import sys

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "configs/sft.py:<preset> or configs/grpo.py:<preset>")
_TOPOLOGY = flags.DEFINE_string("topology", "v5p:4x4x4", "TPU slice CHIP:AxB[xC], e.g. v5p:4x4x4, v5e:2x2")
_ROWS = flags.DEFINE_integer("rows_per_chip", 0, "rows per chip per micro-batch; sets the global batch to "
                             "rows x data*fsdp x grad_accum (0 = keep the config's batch)")
_BUCKET = flags.DEFINE_integer("bucket", -1, "which of the config's (tokens, image tokens, windows) buckets")
_ALL_BUCKETS = flags.DEFINE_bool("all_buckets", False, "compile the training steps at every bucket of the "
                                   "config (the run's whole update plan; multi-host GRPO runs use only the unpacked "
                                   "layout compiled here), not only --bucket; the rollout once")
_DEPTH = flags.DEFINE_bool("extrapolate_depth", False, "compile at 1-3 layers and extrapolate linearly to the "
                           "model's depth (for machines where compiling the whole model takes too long)")
_ONLY = flags.DEFINE_enum("only", "", ["", "train", "rollout"], "GRPO: compile only the training steps or only the "
                          "rollout engine's functions (default: both)")
_ROLLOUT_CHIPS = flags.DEFINE_integer("rollout_chips", 0, "GRPO: chips of one host the rollout runs on, data x "
                                      "tensor (0 = config.rollout.mesh_data x mesh_tensor, mesh_data -1 = all of the "
                                      "host's chips; 1 = one chip holds the host's batch and the whole policy)")
_ROLLOUT_TENSOR = flags.DEFINE_integer("rollout_tensor", 0, "GRPO: the rollout's weights split over groups of this "
                                       "many chips (KV cache by KV heads; 0 = config.rollout.mesh_tensor)")
_COST = flags.DEFINE_bool("cost_model", False, "compile the training steps as one micro-batch with the output layer "
                          "in one chunk, so that XLA's cost analysis (which counts a loop body once) covers the whole "
                          "step: use its MFU column; its memory is not the run's")
_JSON = flags.DEFINE_string("json_out", "", "also write the reports as JSON here")


def _fail(msg: str):
    print(f"preflight: {msg}", file=sys.stderr)
    raise SystemExit(2)


def main(argv):
    del argv
    from codedance_jax.preflight import topology as pf

    config = _CONFIG.value
    if config is None:
        _fail("--config is required, e.g. --config=configs/sft.py:qwen25vl_7b")
    try:
        pf.parse_topology(_TOPOLOGY.value)
    except ValueError as e:
        _fail(str(e))
    pf.offline_tpu_env(_TOPOLOGY.value)  # before the TPU plugin loads
    reason = pf.libtpu_available()
    if reason:
        _fail(reason)

    from codedance_jax.preflight import plan as plans
    from codedance_jax.train.batching import collate  # the real batch contract, at zero rows

    buckets = config.buckets if "prompts_per_step" in config else config.data.buckets
    picks = list(range(len(buckets))) if _ALL_BUCKETS.value and _ONLY.value != "rollout" else [_BUCKET.value]
    plan, reports, described = None, [], []
    for n, pick in enumerate(picks):
        def make_plan(depth=None, pick=pick, only=(_ONLY.value if n == 0 else "train")):
            return plans.plan_from_config(config, _TOPOLOGY.value, rows_per_chip=_ROWS.value, bucket=pick,
                                         empty_batch=lambda bucket, vcfg: collate([], bucket, pad_id=0, vision_cfg=vcfg),
                                         depth=depth, only=only, rollout_chips=_ROLLOUT_CHIPS.value,
                                         rollout_tensor=_ROLLOUT_TENSOR.value, cost_model=_COST.value)

        try:
            if _DEPTH.value:
                cfg, _ = plans.model_config(config)
                plan, got = plans.compile_extrapolated(make_plan, cfg.text.num_hidden_layers, cfg.vision.depth, cfg=cfg)
            else:
                plan = make_plan()
                got = plans.compile_plan(plan)
        except ValueError as e:
            _fail(str(e))
        if len(picks) > 1:  # one row per (program, bucket)
            for r in got:
                if not r.name.startswith("rollout"):
                    r.name = f"{r.name} @{tuple(plan.bucket)}"
        reports += got
        described.append(plan.describe())
    if len(picks) > 1:
        print(f"the whole update plan: {len(picks)} buckets {[tuple(b) for b in buckets]}")
    print("\n".join(dict.fromkeys(x for d in described for x in d.split("\n"))))
    print(pf.format_table(reports, _TOPOLOGY.value))
    summary = None
    if plan.rollout_copies is not None:
        from codedance_jax.preflight import rollout as preflight_rollout

        summary = preflight_rollout.summary(plan.rollout_shape, plan.rollout_copies, reports, plan.chip)
        print(preflight_rollout.format_summary(summary))
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump({"topology": _TOPOLOGY.value, "plan": "\n".join(described), "reports": [r.as_dict() for r in reports],
                       "rollout_summary": summary}, f, indent=1)
    bad = [r for r in reports if not r.fits]
    if bad:
        print(f"preflight: does not fit {_TOPOLOGY.value}: " + ", ".join(
            f"{r.name} needs {r.total_bytes / pf.GIB:.1f} GiB of {r.hbm_bytes / pf.GIB:.1f}" for r in bad), file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    app.run(main)
