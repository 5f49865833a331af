"""From a run config to the jitted functions the run will compile, with abstract arguments.

The same builders as the runs (`train.sft.make_train_step`, `train.grpo.make_grpo_step`,
`train.grpo.make_logprob_fn`), the same state shardings (`train.state`) and the batch contract
given by the caller (`empty_batch`: the data layer's `collate` at zero rows), so what compiles here
is what the run compiles. Only shapes travel: nothing is allocated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from codedance_jax.model import flash
from codedance_jax.model.config import ModelConfig
from codedance_jax.preflight import rollout as preflight_rollout
from codedance_jax.preflight import topology as pf
from codedance_jax.rl.grpo_loss import GRPOLossConfig
from codedance_jax.train import flops, grpo, optim, sft
from codedance_jax.train import state as st


@dataclasses.dataclass
class Entry:
    name: str
    jitted: Callable
    args: tuple
    model_flops: float = 0.0  # over the devices it runs on, `train.flops` formula
    note: str = ""
    kwargs: dict = dataclasses.field(default_factory=dict)  # static keyword arguments of the call
    chips: int = 0  # devices it runs on (0 = the whole slice)
    resident_bytes: int = 0  # per chip, held by the caller during the call besides the arguments
    uncounted_flops: float = 0.0  # over the devices: kernel work XLA's cost model does not see (flash backward)


@dataclasses.dataclass
class Plan:
    kind: str
    topology: str
    chip: pf.Chip
    chips: int
    mesh_shape: dict
    model: str
    rows: int
    grad_accum: int
    bucket: tuple
    entries: list[Entry]
    rollout: str = ""  # how the rollout functions were placed (`preflight_rollout.RolloutShape.describe`)
    rollout_shape: preflight_rollout.RolloutShape | None = None
    rollout_copies: preflight_rollout.WeightCopies | None = None  # at the model's full depth

    def describe(self) -> str:
        per_chip = self.rows / (self.mesh_shape["data"] * self.mesh_shape["fsdp"] * self.grad_accum)
        train = (f"{self.kind} {self.model}: global batch {self.rows} rows x bucket {tuple(self.bucket)} "
                 f"(tokens, image tokens, windows), grad_accum {self.grad_accum} -> {per_chip:g} rows per chip per "
                 f"micro-batch; mesh {self.mesh_shape}")
        return "\n".join(x for x in (train, self.rollout) if x)


PRESETS = {"tiny": ModelConfig.tiny, "qwen25vl_3b": ModelConfig.qwen25vl_3b, "qwen25vl_7b": ModelConfig.qwen25vl_7b}


def model_config(config) -> tuple[ModelConfig, str]:
    """The run's ModelConfig from its preset name (checkpoints are not read: shapes are the preset's)."""
    name = config.model
    note = ""
    if name == "toy":  # the toy world's model needs its generated tokenizer; the tiny preset has the same layout
        name, note = "tiny", "toy model preflighted as the tiny preset (same layout, Qwen vocabulary)"
    if name not in PRESETS:
        raise ValueError(f"config.model={config.model!r}: preflight knows the presets {sorted(PRESETS)}")
    # Compiled for a TPU: "auto" attention is the TPU kernel there, as on the pod.
    cfg = PRESETS[name]().replace(dtype=config.dtype, param_dtype=config.param_dtype, remat=config.remat,
                                  attention=flash.resolve(config.get("attention", "auto"), platform="tpu"))
    return cfg, note


def with_depth(cfg: ModelConfig, text_layers: int, vision_depth: int) -> ModelConfig:
    """The same model at a smaller depth; the vision tower keeps one full-attention block (its last).

    Used to extrapolate a deep model's compile linearly in depth when compiling it whole is too
    slow for the machine: each (rematerialized) layer adds its parameter shards, optimizer moments
    and saved residual, while the transient peak of one layer's recompute is the same at any depth.
    """
    text = dataclasses.replace(cfg.text, num_hidden_layers=text_layers)
    vision = dataclasses.replace(cfg.vision, depth=vision_depth, fullatt_block_indexes=(vision_depth - 1,))
    return cfg.replace(text=text, vision=vision)


def abstract_train_state(cfg: ModelConfig, tx, mesh, rules=None):
    """(ModelDef, abstract TrainState with shardings, TrainState of shardings), as `create_train_state`."""
    mdef, ab = st.abstract_params(cfg)
    p_sh = jax.tree.map(lambda v: v.get_value() if isinstance(v, nnx.Variable) else v,
                        st.param_shardings(ab, mesh, rules), is_leaf=lambda x: isinstance(x, nnx.Variable))

    def wrap(p):
        return st.TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=tx.init(p),
                             rng=jax.random.key_data(jax.random.key(0)))

    sh = st.state_shardings(jax.eval_shape(wrap, ab), p_sh, mesh, tx)
    return mdef, jax.jit(wrap, out_shardings=sh).eval_shape(ab), sh


def batch_shapes(empty: dict, rows: int) -> dict:
    """Zero-row batch from `collate` -> {field: ShapeDtypeStruct} with `rows` rows."""
    out = {}
    for k, v in empty.items():
        if k == "num_tokens":
            continue
        shape = list(v.shape)
        shape[sft.batch_axes(k, v.ndim).index("batch")] = rows
        out[k] = jax.ShapeDtypeStruct(tuple(shape), v.dtype)
    return out


def with_shardings(shapes: dict, mesh, rules=None) -> tuple[dict, dict]:
    sh = sft.batch_shardings(shapes, mesh, rules)
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh[k]) for k, v in shapes.items()}, sh


def plan_from_config(config, topology: str, *, empty_batch, rows_per_chip: int = 0, bucket: int = -1,
                     devices=None, depth: tuple[int, int] | None = None, only: str = "",
                     rollout_chips: int = 0, rollout_tensor: int = 0, cost_model: bool = False) -> Plan:
    """The Plan of an SFT (configs/sft.py) or GRPO (configs/grpo.py) config on `topology`.

    A GRPO plan also holds the rollout engine's functions at one host's shapes on its sampling
    mesh (`preflight_rollout`; `rollout_chips`: chips of a host the rollout uses, data x tensor;
    `rollout_tensor`: the weights split over groups of that many; 0 = `config.rollout.mesh_data` /
    `mesh_tensor`), with the trainer's state counted beside it, and the weight reshard's size at
    the model's full depth (`Plan.rollout_copies`). `only`: "train" (the training steps) or
    "rollout" (the rollout functions); "" = both.

    cost_model: the training steps as one micro-batch with the output layer in one chunk (no loop),
    for XLA's cost analysis, which counts a loop body once: the micro-batch scan and the
    vocabulary-chunk loop made its flops and time cover 1/grad_accum of the step and one chunk of
    the output layer. Same rows per chip; the memory of this variant is not the run's."""
    if only not in ("", "train", "rollout"):
        raise ValueError(f"--only={only!r}: expected train or rollout (or nothing for both)")
    chip, dims = pf.parse_topology(topology)
    devices = pf.topology_devices(topology) if devices is None else devices
    mesh = pf.topology_mesh(devices, config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
    rules = tuple(tuple(r) for r in config.sharding_rules) if config.sharding_rules else None
    cfg, note = model_config(config)
    full_cfg = cfg
    if depth is not None:
        cfg = with_depth(cfg, *depth)
    kind = "grpo" if "prompts_per_step" in config else "sft"
    if only == "rollout" and kind == "sft":
        raise ValueError("--only=rollout: an SFT config has no rollout; use a configs/grpo.py preset")
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    accum = int(config.grad_accum)
    rows = config.prompts_per_step * config.group_size if kind == "grpo" else config.batch_size
    if rows_per_chip:
        rows = rows_per_chip * shards * accum
    buckets = config.buckets if kind == "grpo" else config.data.buckets
    bk = tuple(buckets[bucket])
    entries, rollout, shape, copies = [], "", None, None
    if kind == "grpo" and only != "train":
        # The trainer's state stays on every chip while the host rolls out (both copies counted).
        tx, _ = optim.make_optimizer(config.optim, config.total_steps)
        trainer = abstract_train_state(cfg, tx, mesh, rules)[1]
        host = None  # compile a host's programs on a one-host slice where libtpu wants whole slices (v5e)
        if chip.host_topology and len(devices) > preflight_rollout.CHIPS_PER_HOST:
            host = pf.topology_devices(f"{chip.name}:{chip.host_topology}")
        shape, calls = preflight_rollout.rollout_calls(config, cfg, devices, rollout_chips, rollout_tensor,
                                                       trainer_bytes=preflight_rollout.per_chip_bytes(trainer),
                                                       host=host)
        full = trainer if full_cfg is cfg else abstract_train_state(full_cfg, tx, mesh, rules)[1]
        copies = preflight_rollout.weight_copies(config, full_cfg, devices, shape, full, chip)
        rollout = shape.describe() + (f"; compiled on a one-host {chip.name}:{chip.host_topology} slice (libtpu "
                                      "compiles a v5e program only over a whole slice)" if host else "")
        for i, c in enumerate(calls):  # the preset's note (e.g. toy -> tiny) once, on the first row
            why = "; ".join(x for x in (c.note, note if i == 0 else "") if x)
            entries.append(Entry(c.name, c.jitted, c.args, c.model_flops, why, c.kwargs, shape.rollout_chips,
                                 c.resident_bytes))
    if only == "rollout":
        return Plan(kind, topology, chip, len(devices), dict(mesh.shape), config.model, rows, accum, bk, entries,
                    rollout, shape, copies)
    if rows % (shards * accum):
        raise ValueError(f"global batch {rows} rows does not split into mesh data*fsdp={shards} x grad_accum={accum}; "
                         f"set --config.grad_accum to a divisor of {rows // shards if rows >= shards else rows} or "
                         "--rows_per_chip")
    chunk = 512  # the steps' default token chunk of the output layer
    if cost_model:
        rows, accum, chunk = rows // accum, 1, bk[0]
    shapes = batch_shapes(empty_batch(bk, cfg.vision), rows)
    tx, sched = optim.make_optimizer(config.optim, config.total_steps)
    mdef, state, state_sh = abstract_train_state(cfg, tx, mesh, rules)
    replicated = NamedSharding(mesh, PartitionSpec())
    key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding=replicated)
    t, nb = bk[0], bk[1]
    train_flops = flops.train_flops(cfg, rows * t, t, rows * nb * cfg.vision.merge_unit)
    bwd_kernel = flash_backward_flops(cfg, rows, t, bk[2])
    train_entries = []
    if kind == "sft":
        batch, bsh = with_shardings({k: v for k, v in shapes.items() if k in sft.BATCH_FIELDS}, mesh, rules)
        step = sft.make_train_step(mdef, tx, sched, state_sh, bsh, mesh, accum_steps=accum, chunk=chunk, rules=rules)
        train_entries.append(Entry("sft.train_step", step, (state, batch, key), train_flops, note,
                                   uncounted_flops=bwd_kernel))
    else:
        m = config.rollout.max_turns
        extra = {"old_logprobs": jax.ShapeDtypeStruct((rows, t), np.float32),
                 "turn_ids": jax.ShapeDtypeStruct((rows, t), np.int32),
                 "a_seq": jax.ShapeDtypeStruct((rows,), np.float32),
                 "a_turn": jax.ShapeDtypeStruct((rows, m), np.float32)}
        if config.loss.kl_coef > 0:
            extra["ref_logprobs"] = extra["old_logprobs"]
        batch, bsh = with_shardings({**shapes, **extra}, mesh, rules)
        lp_batch = {k: v for k, v in batch.items() if k in sft.BATCH_FIELDS}
        lp_fn = grpo.make_logprob_fn(mdef, state_sh.params, {k: bsh[k] for k in lp_batch}, mesh,
                                     temperature=config.rollout.temperature, accum_steps=accum, chunk=chunk, rules=rules)
        train_entries.append(Entry("grpo.old_logprobs", lp_fn, (state.params, lp_batch), train_flops / 3, note))
        step = grpo.make_grpo_step(mdef, tx, sched, GRPOLossConfig(clip_eps=float(config.loss.clip_eps), aggregation=config.loss.aggregation,
                                                  kl_coef=float(config.loss.kl_coef)), state_sh, bsh, mesh, accum_steps=accum,
                                   temperature=config.rollout.temperature, chunk=chunk, rules=rules)
        train_entries.append(Entry("grpo.train_step", step, (state, batch, key), train_flops, note,
                                   uncounted_flops=bwd_kernel))
    return Plan(kind, topology, chip, len(devices), dict(mesh.shape), config.model, rows, accum, bk,
                train_entries + entries, rollout, shape, copies)


def _full_blocks(v) -> int:
    """The vision tower's full-attention blocks."""
    return len([i for i in v.fullatt_block_indexes if i < v.depth])


def flash_backward_flops(cfg: ModelConfig, rows: int, tokens: int, windows: int) -> float:
    """Flops of the flash kernel's backward (dq and dk/dv kernels) in one training step, which XLA's
    cost model does not count: the Pallas backward calls carry no cost estimate, and XLA costs
    them by their operand bytes only. ~2.5x the forward's two matmuls: 5 T^2 D per causal text
    layer (half the blocks), 10 S^2 D per full-attention vision block. 0 with XLA attention."""
    if cfg.attention != "flash":
        return 0.0
    t, v = cfg.text, cfg.vision
    total = 0.0
    if flash.tiles_fit(tokens):
        total += t.num_hidden_layers * rows * 5.0 * tokens**2 * t.hidden_size
    s = windows * v.window_patches  # a row's patch slots in the vision tower
    if flash.tiles_fit(s):
        total += _full_blocks(v) * rows * 10.0 * s**2 * v.hidden_size
    return total


def compile_plan(plan: Plan) -> list[pf.Report]:
    """Compiles the entries one at a time (each frees its executable before the next)."""
    return [pf.compile_report(e.name, e.jitted, e.args, chip=plan.chip, chips=e.chips or plan.chips,
                              model_flops_total=e.model_flops, note=e.note, kwargs=e.kwargs,
                              resident_bytes=e.resident_bytes, uncounted_flops_total=e.uncounted_flops)
            for e in plan.entries]


# Base depth and the two one-layer steps that measure a text layer's and a vision block's share; the
# last, two text layers up, measures the temporaries' per-layer share past the first layer
# (`topology.extrapolate`'s plus_text2).
DEPTH_POINTS = ((1, 1), (2, 1), (1, 2), (3, 1))


def compile_extrapolated(make_plan, text_layers: int, vision_depth: int, log=print, *,
                         cfg: ModelConfig | None = None) -> tuple[Plan, list[pf.Report]]:
    """Compile at DEPTH_POINTS (make_plan(depth) -> Plan) and extrapolate every entry linearly to full depth.

    The depth points' towers hold one full-attention block and the added vision block is a window
    block, so the extrapolated tower has 1 full block where the model (`cfg`) has more (7B: 4 of 32).
    With `cfg`, the training steps' time gets the missing full blocks' attention work at peak flops
    (forward twice under remat, and the backward; `uncounted_seconds`): a lower bound on their
    time. Memory needs no such term: one block's attention working set is transient."""
    runs = []
    for d in DEPTH_POINTS:
        plan = make_plan(d)
        log(f"compiling at depth (text {d[0]}, vision {d[1]}) ...")
        runs.append(compile_plan(plan))
        log(pf.format_table(runs[-1], plan.topology))
    out = []
    for base, text1, vis1, text2 in zip(*runs, strict=True):
        out.append(pf.extrapolate(base, text1, vis1, text_layers - 1, vision_depth - 1, plus_text2=text2))
    if cfg is not None:
        v = cfg.vision
        missing = _full_blocks(v) - 1
        s = plan.bucket[2] * v.window_patches  # a row's patch slots
        per_row = missing * (2 * 4.0 + 10.0) * s**2 * v.hidden_size  # 2 forwards (remat) + backward
        for r in out:
            if missing > 0 and r.name.endswith("train_step"):
                r.uncounted_seconds += per_row * plan.rows / r.chips / r.peak_flops
                r.note = "; ".join(x for x in (r.note, f"+{missing} full-attention vision blocks' attention at peak") if x)
    return plan, out
