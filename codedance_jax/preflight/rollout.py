"""The rollout engine's jitted functions at the shapes one host of a slice runs, for the pod preflight.

A GRPO step samples `prompts_per_step x group_size` trajectories, split over the slice's hosts:
each host rolls out its share of the prompts with its own `RolloutEngine` (SPEC: rows are
host-local; only the update is global). So the rollout functions are compiled for ONE host:
`hosts = chips / CHIPS_PER_HOST` (4 chips per TPU VM host on v4, v5p, v5e and v6e multi-host
slices; a slice of fewer chips is one host), rows per host = the host's prompts x group_size
rounded up to `rollout.batch_multiple`, as `RolloutEngine.rollout` pads them. The host's rows run
on its sampling mesh (`rollout/placement.py`): `rollout_chips` of its chips as data x tensor, rows
split over `data`, the policy's weights split over `tensor` as `placement.sampling_params` places
them (attention heads, MLP columns, vocabulary; the trainer's rules with only their `tensor`
targets; replicated when tensor = 1), the KV cache split by KV heads over `tensor`
(`device_batch.RowPlacement.layout`: `sharding.kv_sharding`; logits and chunk inputs by rows).
`rollout_chips=1` is one chip holding the whole host's batch and the whole policy (the layout of a
run without a sampling mesh).

Both copies of the weights are counted: while the host rolls out, the trainer's state (its
parameters and optimizer moments, fsdp/tensor-split over the slice's mesh) stays on every chip, so
each function's `resident_bytes` includes the chip's share of it (`WeightCopies`). The weight
reshard (trainer layout -> sampling layout) is sized exactly from the two shardings' index maps:
the bytes each of the host's chips must receive that it does not already hold (`reshard_bytes`),
and their time at the chip's ICI bandwidth (`topology.Chip.ici_bytes_per_s`).

The functions are the engine's own jitted ones, called as the engine calls them:
  prefill   `generate.extend_jit` (last_only) at each prompt bucket, on the fresh cache of the
            host's prompts (one row per prompt: the engine prefills a prompt once for its group);
  share     `generate.broadcast_rows`: the prompt rows copied to their group members' rows;
  decode    `Sampler.chunk_call`: one `decode_chunk` of `rollout.decode_chunk` steps over all rows;
  append    `generate.extend_jit` (last_only) at each observation bucket over all rows;
  compact   `generate.compact_cache` (the full cache's slots moved in place);
  vision    `generate.encode_into_jit` at the shape plan's two one-image calls (`rollout/shapes.py`):
            a prompt image and an observation image, each as large as its pixel budget allows,
            written into the chunk's feature buffer (every prompt of the host, `prompt_images`
            each; every row, `obs_max_images` each, at most `append_images` per append).
Calls over a subset of the rows (a row bucket: `take_rows` / `put_rows`) are smaller than the
whole-batch ones compiled here. Prefill and append carry image features of the vision bucket.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from codedance_jax import sharding
from codedance_jax.model import generate
from codedance_jax.model.config import ModelConfig
from codedance_jax.preflight import topology as pf
from codedance_jax.rollout.config import RolloutConfig
from codedance_jax.rollout.device_batch import RowPlacement
from codedance_jax.rollout.placement import sampler_dtype, sampler_spec
from codedance_jax.rollout.sampler import Sampler, SamplingConfig, StopTable
from codedance_jax.rollout.shapes import rollout_plan
from codedance_jax.train import flops
from codedance_jax.train import state as st

CHIPS_PER_HOST = 4
# Stand-in shape of the stop-string table (the real one depends on the tokenizer, which a
# preflight does not load): E forms of up to K tokens; its [E, V] bool head table is < 3 MiB at 152k.
STOP_FORMS, STOP_TOKENS = 16, 6


@dataclasses.dataclass(frozen=True)
class RolloutShape:
    hosts: int
    chips_per_host: int
    rollout_chips: int
    prompts_per_host: int
    group_size: int
    rows: int  # the engine's batch (rows per host, padded to batch_multiple)
    prompt_rows: int  # rows of the prefill (one per prompt, padded to batch_multiple)
    cache_slots: int
    vision_images: int
    vision_units: int  # the append's feature buffer (the plan's, for the whole batch)
    vision_windows: int
    prefill_units: int = 0  # the prefill's feature buffer
    prefill_windows: int = 0
    plan_programs: int = 0  # programs in the run's rollout shape plan (`rollout/shapes.py`)
    obs_image: tuple[int, int] = (0, 0)  # (units, windows) of one observation image's vision call
    prompt_image: tuple[int, int] = (0, 0)  # of one prompt image's
    tensor: int = 1  # the sampling mesh's tensor axis (weights and KV heads split over it)

    @property
    def data(self) -> int:
        """The sampling mesh's data axis: slices of `tensor` chips, each with its share of the rows."""
        return self.rollout_chips // self.tensor

    def describe(self) -> str:
        weights = (f"weights split over tensor={self.tensor} (KV cache by KV heads)" if self.tensor > 1
                   else "parameters replicated")
        return (f"rollout: {self.hosts} host(s) x {self.chips_per_host} chips; per host {self.prompts_per_host} "
                f"prompts x {self.group_size} = {self.rows} rows ({self.prompt_rows} prefill rows), "
                f"{self.rows // self.data} rows per data slice over a sampling mesh data={self.data} x "
                f"tensor={self.tensor} ({self.rollout_chips} chip(s)), {weights}; cache {self.cache_slots} slots; "
                f"vision of the shape plan: one call per "
                f"image ({self.prompt_image[0]} units for a prompt image, {self.obs_image[0]} for an observation's) "
                f"into buffers of {self.prefill_units} (prefill) and {self.vision_units} (append, "
                f"{self.vision_images} image(s)) units; the plan has {self.plan_programs} rollout programs, of which "
                f"the whole-batch call of each kind at the largest cache size is compiled here")


@dataclasses.dataclass
class RolloutCall:
    name: str
    jitted: Callable
    args: tuple
    kwargs: dict
    model_flops: float
    note: str = ""
    resident_bytes: int = 0  # per chip: what the engine holds during the call besides its arguments


def sampling_layout(config, per_host: int, rollout_chips: int = 0, tensor: int = 0) -> tuple[int, int]:
    """(chips, tensor) of one host's sampling mesh: `tensor` (0: `config.rollout.mesh_tensor`) and
    `rollout_chips` = data x tensor (0: `config.rollout.mesh_data` x tensor, mesh_data -1 = all the
    host's chips, as `placement.sampling_mesh` reads them)."""
    r = config.rollout
    tensor = int(tensor or r.get("mesh_tensor", 1))
    if not rollout_chips:
        data = int(r.get("mesh_data", -1))
        rollout_chips = per_host if data == -1 else data * tensor
    if tensor < 1 or rollout_chips > per_host or rollout_chips % tensor:
        raise ValueError(f"--rollout_chips={rollout_chips} --rollout_tensor={tensor}: a host has {per_host} chips, "
                         "and the rollout's chips must be whole groups of rollout_tensor of them")
    return rollout_chips, tensor


def rollout_shape(config, rcfg: RolloutConfig, mcfg: ModelConfig, chips: int, rollout_chips: int = 0,
                  tensor: int = 0) -> RolloutShape:
    per_host = min(CHIPS_PER_HOST, chips)
    hosts = chips // per_host
    rollout_chips, tensor = sampling_layout(config, per_host, rollout_chips, tensor)
    data = rollout_chips // tensor
    if rcfg.batch_multiple % data:
        raise ValueError(f"rollout.batch_multiple={rcfg.batch_multiple} is not a multiple of the sampling mesh's "
                         f"{data} data slices (RolloutEngine(mesh=) splits the rows over them)")
    prompts = -(-int(config.prompts_per_step) // hosts)
    g = int(config.group_size)
    plan = rollout_plan(rcfg, mcfg, rows=prompts * g, prompts=prompts, prompt_max_pixels=prompt_max_pixels(config))
    units, windows = plan.vision("append", plan.rows)
    p_units, p_windows = plan.vision("prefill", plan.prompt_rows)
    images = units // max(1, plan.obs_image[0])
    return RolloutShape(hosts, per_host, rollout_chips, prompts, g, plan.rows, plan.prompt_rows, plan.cache_sizes[-1],
                        images, units, windows, p_units, p_windows, len(plan.programs()), plan.obs_image,
                        plan.prompt_image, tensor)


def prompt_max_pixels(config) -> int:
    """The processor's pixel budget for prompt images: `config.data.max_pixels` when the run sets
    one, else the Qwen2.5-VL processor's default."""
    from codedance_jax.processing.image import ImageConfig

    return int(config.data.get("max_pixels", 0) or ImageConfig().max_pixels)


def per_chip_bytes(tree) -> int:
    """Bytes one chip holds of a tree of ShapeDtypeStructs with shardings (its shard of each)."""
    return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _abstract(tree, sharding_of):
    """Every array leaf as a ShapeDtypeStruct with `sharding_of(shape)` (lowering needs no arrays)."""
    def one(x):
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding_of(np.shape(x)))

    return jax.tree.map(one, tree)


def host_devices(devices, per_host: int) -> list:
    """The first host's chips of a slice: the devices of `devices[0]`'s process (compile-only
    topologies know which chips share a host), in the slice's order; else the first `per_host`."""
    devices = list(devices)
    first = getattr(devices[0], "process_index", None)
    mine = [d for d in devices if getattr(d, "process_index", None) == first]
    return mine if len(mine) == per_host else devices[:per_host]


def host_mesh(devices, shape: RolloutShape) -> jax.sharding.Mesh:
    """One host's sampling mesh, as `placement.sampling_mesh` builds it from the host's devices:
    (data, 1, tensor) over the first data x tensor of them, tensor groups neighbouring devices."""
    local = host_devices(devices, shape.chips_per_host)
    return sharding.make_mesh(shape.data, 1, shape.tensor, devices=local[: shape.rollout_chips])


def sampler_param_shardings(params, mesh: jax.sharding.Mesh, rules=None):
    """The sampler's copy's NamedSharding per `nnx.Variable` of `params` (abstract or real), as
    `placement.sampling_params` places it: the logical axes through the trainer's rules with every
    target but `tensor` removed (no fsdp, no data split of weights), a dimension that `tensor` does
    not divide replicated; replicated when the mesh's tensor axis is 1."""
    def one(v):
        if not isinstance(v, nnx.Variable) or mesh.shape.get("tensor", 1) == 1:
            return NamedSharding(mesh, PartitionSpec())
        return NamedSharding(mesh, sampler_spec(v, mesh, rules))

    return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _sampler_model(mcfg: ModelConfig, mesh, rules):
    """The policy as the engine gets it on `mesh`: the trainer's arrays placed, in the compute dtype
    (`placement.sampler_dtype`: float32 weights of a bfloat16 model are cast before they move)."""
    mdef, params = st.abstract_params(mcfg)
    shardings = sampler_param_shardings(params, mesh, rules)

    def value(v):
        x = v.get_value() if isinstance(v, nnx.Variable) else v
        return jax.ShapeDtypeStruct(x.shape, sampler_dtype(x.dtype, mcfg.compute_dtype))

    values = jax.tree.map(value, params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return mdef.model(pf.abstract(values, shardings))


def _cache_layout(mesh, tree):
    """The engine's layout of a batch's arrays (`RowPlacement.layout`: rows over data, KV heads over
    tensor); a one-chip mesh holds them whole."""
    if mesh.devices.size == 1:
        return jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), tree)
    return RowPlacement(mesh).layout(tree)


def _slices(index, shape) -> list[tuple[int, int]]:
    return [sl.indices(n)[:2] for sl, n in zip(index, shape, strict=True)] if index else [(0, n) for n in shape]


def _volume(bounds) -> int:
    return int(np.prod([max(0, b - a) for a, b in bounds])) if bounds else 1


def reshard_bytes(leaves) -> tuple[dict, dict]:
    """Bytes each destination device must receive to hold its shard of every leaf.

    `leaves`: (shape, itemsize, source NamedSharding, destination NamedSharding) per array, both
    over the same devices (the slice's). Returns ({device: bytes received when each device gets
    exactly the part of its destination shard that its own source shard does not hold},
    {device: bytes received when the whole array is first gathered to it, as a replicated copy
    would be: the array less its own source shard}). Pure index arithmetic: nothing is allocated."""
    need: dict = {}
    whole: dict = {}
    for shape, itemsize, src, dst in leaves:
        shape = tuple(shape)
        have = src.devices_indices_map(shape)
        full = _volume([(0, n) for n in shape])
        for dev, idx in dst.devices_indices_map(shape).items():
            want = _slices(idx, shape)
            own = _slices(have[dev], shape) if dev in have else [(0, 0)] * len(shape)
            overlap = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(want, own, strict=True)]
            need[dev] = need.get(dev, 0) + (_volume(want) - _volume(overlap)) * itemsize
            whole[dev] = whole.get(dev, 0) + (full - _volume(own)) * itemsize
    return need, whole


@dataclasses.dataclass(frozen=True)
class WeightCopies:
    """Per chip of the host's sampling mesh, at the model's full depth: the two copies of the
    weights during a rollout, the KV cache, and the reshard between them."""

    sampler_bytes: int  # the sampler's copy of the policy (its shard on this chip)
    trainer_bytes: int  # the trainer's state: parameters + optimizer moments (its shard on this chip)
    trainer_param_bytes: int  # of which the parameters
    cache_bytes: int  # the batch's KV cache (its shard)
    reshard_bytes: int  # received by the busiest chip: its sampler shard less what its trainer shard holds
    reshard_whole_bytes: int  # received by the busiest chip when whole leaves are gathered first
    ici_bytes_per_s: float  # one direction, per chip (`topology.Chip`); 0 = not known

    @property
    def reshard_seconds(self) -> float:
        return self.reshard_bytes / self.ici_bytes_per_s if self.ici_bytes_per_s else 0.0

    @property
    def reshard_whole_seconds(self) -> float:
        return self.reshard_whole_bytes / self.ici_bytes_per_s if self.ici_bytes_per_s else 0.0


def weight_copies(config, mcfg: ModelConfig, devices, shape: RolloutShape, trainer_state, chip: pf.Chip) -> WeightCopies:
    """`WeightCopies` of `mcfg` (give the full-depth config) for the host's sampling mesh, against
    `trainer_state`: the abstract `TrainState` with its shardings over the slice (`plan.abstract_train_state`)."""
    mesh = host_mesh(devices, shape)
    rules = tuple(tuple(r) for r in config.sharding_rules) if config.sharding_rules else None
    model = _sampler_model(mcfg, mesh, rules)
    _, sampler, _ = nnx.split(model, nnx.Param, ...)
    cache_shape = jax.eval_shape(lambda: model.init_cache(shape.rows, shape.cache_slots))
    cache = pf.abstract(cache_shape, _cache_layout(mesh, cache_shape))
    pairs = [(x.shape, x.dtype.itemsize, t.sharding, x.sharding)
             for x, t in zip(jax.tree.leaves(sampler), jax.tree.leaves(trainer_state.params), strict=True)]
    need, whole = reshard_bytes(pairs)
    return WeightCopies(per_chip_bytes(sampler), per_chip_bytes(trainer_state), per_chip_bytes(trainer_state.params),
                        per_chip_bytes(cache), max(need.values()), max(whole.values()), chip.ici_bytes_per_s)


def rollout_calls(config, mcfg: ModelConfig, devices, rollout_chips: int = 0, tensor: int = 0,
                  trainer_bytes: int = 0, host=None) -> tuple[RolloutShape, list[RolloutCall]]:
    """The engine's jitted functions with abstract arguments on one host's sampling mesh (module
    docstring). `devices`: the slice's; `host`: the devices to compile on when they are not the
    slice's first host (`topology.Chip.host_topology`). `trainer_bytes`: per chip, the trainer's
    state held meanwhile (counted in each call's `resident_bytes`)."""
    rcfg = RolloutConfig.from_block(config.rollout)  # as the GRPO run builds its engine's
    shape = rollout_shape(config, rcfg, mcfg, len(devices), rollout_chips, tensor)
    mesh = host_mesh(devices if host is None else host, shape)
    replicated = NamedSharding(mesh, PartitionSpec())
    rules = tuple(tuple(r) for r in config.sharding_rules) if config.sharding_rules else None

    def rep(_shape):
        return replicated

    def rows(batch_dim=0):
        return lambda s: sharding.row_sharding(mesh, s, batch_dim)

    # The policy as the run hands it to the engine: the training parameters (param dtype), placed
    # on the host's sampling mesh (split over tensor, else replicated).
    model = _sampler_model(mcfg, mesh, rules)
    b, n, s = shape.rows, shape.prompt_rows, shape.cache_slots
    cache_shape = jax.eval_shape(lambda: model.init_cache(b, s))
    cache = pf.abstract(cache_shape, _cache_layout(mesh, cache_shape))
    small_shape = jax.eval_shape(lambda: model.init_cache(n, s))
    small = pf.abstract(small_shape, _cache_layout(mesh, small_shape))

    # The plan's vision calls (`rollout/shapes.py`): one stand-in image, the call's shape is the plan's.
    m = mcfg.vision.spatial_merge_size
    grid = np.array([[1, m, m]], np.int64)
    pv = np.zeros((mcfg.vision.merge_unit, mcfg.vision.patch_dim), np.float32)
    vis = _abstract(generate.vision_inputs(pv, grid, mcfg, num_windows=shape.obs_image[1],
                                           num_units=shape.obs_image[0]), rep)
    vis_p = _abstract(generate.vision_inputs(pv, grid, mcfg, num_windows=shape.prompt_image[1],
                                             num_units=shape.prompt_image[0]), rep)
    d_model, fdt = mcfg.text.hidden_size, jnp.dtype(mcfg.compute_dtype)
    feats = _abstract(jax.ShapeDtypeStruct((1, shape.vision_units + shape.obs_image[0], d_model), fdt), rep)
    feats_p = _abstract(jax.ShapeDtypeStruct((1, shape.prefill_units + shape.prompt_image[0], d_model), fdt), rep)
    offset = _abstract(jax.ShapeDtypeStruct((), jnp.int32), rep)

    def chunk(batch, length):
        i32 = jax.ShapeDtypeStruct((batch, length), jnp.int32)
        ids, mask = _abstract(i32, rows()), _abstract(i32, rows())
        pos = _abstract(jax.ShapeDtypeStruct((3, batch, length), jnp.int32), rows(1))
        return ids, mask, pos

    d, v = mcfg.text.hidden_size, mcfg.text.vocab_size

    def fwd_flops(batch, length):  # forward over the chunk; the output layer only at each row's last token
        return flops.train_flops(mcfg, batch * length, s) / 3 - 2 * d * v * batch * (length - 1)

    prompt_buckets = sorted(x for x in rcfg.prompt_buckets if x <= rcfg.max_total_tokens)
    logits_n = _abstract(generate.extend_jit.eval_shape(model, small, *chunk(n, prompt_buckets[0]), feats_p,
                                                        last_only=True)[0], rows())
    logits_b = _abstract(jax.ShapeDtypeStruct((b, logits_n.shape[1]), logits_n.dtype), rows())
    # What the engine keeps alive around a call besides its arguments: the batch's cache, allocated
    # before the prefill and replaced only by `share_prompts`' output (the old one is not donated);
    # the batch's logits during appends, the vision call and compactions.
    held_cache, held_logits = per_chip_bytes(cache), per_chip_bytes(logits_b)
    cache_note = "the engine holds the batch's KV cache meanwhile"

    calls = []
    for length in prompt_buckets:
        calls.append(RolloutCall(f"rollout.prefill@{length}", generate.extend_jit, (model, small, *chunk(n, length), feats_p),
                                 {"last_only": True, "fresh": True}, fwd_flops(n, length), cache_note, held_cache))
    i32_b = _abstract(jax.ShapeDtypeStruct((b,), jnp.int32), rows())
    on_b = _abstract(jax.ShapeDtypeStruct((b,), jnp.bool_), rows())
    calls.append(RolloutCall("rollout.share_prompts", generate.broadcast_rows, (small, logits_n, i32_b, on_b), {}, 0.0,
                             cache_note, held_cache))

    stops = StopTable(("",) * STOP_FORMS, np.full((STOP_FORMS, STOP_TOKENS), -1, np.int32),
                      np.zeros((STOP_FORMS,), np.int32), np.ones((STOP_FORMS, v), bool), np.zeros((STOP_FORMS,), bool))
    banned = (mcfg.image_token_id, mcfg.video_token_id, mcfg.vision_start_token_id, mcfg.vision_end_token_id)
    r = config.rollout
    sampler = Sampler(model, stops, SamplingConfig(temperature=float(r.temperature), top_p=float(r.top_p),
                                                   top_k=int(r.top_k)), v, rcfg.decode_chunk, banned)
    steps = rcfg.decode_chunk
    hist = _abstract(jax.ShapeDtypeStruct((b, stops.history), jnp.int32), rows())
    forced = _abstract(jax.ShapeDtypeStruct((b, steps), jnp.int32), rows())
    fn, args, kwargs = sampler.chunk_call(cache, logits_b, on_b, i32_b, hist, forced, i32_b, i32_b)
    args = (*args[:9], *_abstract(args[9:], rep))  # sampling scalars, key and stop table: replicated
    calls.append(RolloutCall(f"rollout.decode_chunk x{steps}", fn, args, kwargs, steps * fwd_flops(b, 1),
                             f"one chunk of {steps} one-token steps (a while loop: XLA counts one step)"))

    for length in sorted(rcfg.obs_buckets):
        calls.append(RolloutCall(f"rollout.append@{length}", generate.extend_jit, (model, cache, *chunk(b, length), feats),
                                 {"last_only": True}, fwd_flops(b, length), "the engine holds the logits meanwhile",
                                 held_logits))
    calls.append(RolloutCall("rollout.compact_cache", generate.compact_cache, (cache,), {}, 0.0,
                             "the engine holds the logits meanwhile", held_logits))
    q = mcfg.vision.merge_unit
    calls.append(RolloutCall(f"rollout.vision.prefill@{shape.prompt_image[0]}", generate.encode_into_jit,
                             (model, feats_p, vis_p, offset), {},
                             flops.train_flops(mcfg, 0, 1, shape.prompt_image[0] * q) / 3,
                             "one prompt image (called once per image); the engine holds the batch's KV cache",
                             held_cache))
    calls.append(RolloutCall(f"rollout.vision.append@{shape.obs_image[0]}", generate.encode_into_jit,
                             (model, feats, vis, offset), {}, flops.train_flops(mcfg, 0, 1, shape.obs_image[0] * q) / 3,
                             "one observation image (called once per image); the engine holds the batch's KV cache "
                             "and logits", held_cache + held_logits))
    if trainer_bytes:
        for c in calls:
            c.resident_bytes += trainer_bytes
            c.note = "; ".join(x for x in (c.note, "the trainer's state stays on the chip (both copies counted)") if x)
    return shape, calls


def decode_tokens_per_s(shape: RolloutShape, report: pf.Report) -> float:
    """Decode tokens per second per chip by the cost model: XLA's cost analysis counts the chunk's
    while loop once, so the decode chunk's report times one step, which gives every row of the host
    one token on its `rollout_chips` chips."""
    return shape.rows / shape.rollout_chips / report.seconds if report.seconds > 0 else 0.0


def summary(shape: RolloutShape, copies: WeightCopies, reports: list[pf.Report], chip: pf.Chip,
            hbm_limit: float = 0.85) -> dict:
    """One row of the sampling-layout table: per-chip memory at the rollout's peak (the sampler's
    weights, the KV cache, the trainer's state, the rest: temporaries, inputs, logits, code), the
    cost model's decode tokens/s per chip, the reshard's bytes and time."""
    mine = [r for r in reports if r.name.startswith("rollout.")]
    peak = max(mine, key=lambda r: r.total_bytes)
    decode = next(r for r in mine if r.name.startswith("rollout.decode_chunk"))
    steps = int(decode.name.rsplit("x", 1)[1])
    counted = decode.xla_flops * steps / decode.model_flops if decode.model_flops else 0.0
    known = copies.sampler_bytes + copies.cache_bytes + copies.trainer_bytes
    return dict(
        layout="sampling mesh" if shape.rollout_chips > 1 else "one chip per host", hosts=shape.hosts,
        data=shape.data, tensor=shape.tensor, rollout_chips=shape.rollout_chips, rows_per_host=shape.rows,
        rows_per_data_slice=shape.rows // shape.data, cache_slots=shape.cache_slots,
        sampler_bytes=copies.sampler_bytes, cache_bytes=copies.cache_bytes, trainer_bytes=copies.trainer_bytes,
        trainer_param_bytes=copies.trainer_param_bytes, peak_function=peak.name, peak_bytes=peak.total_bytes,
        other_bytes=peak.total_bytes - known, hbm_bytes=chip.hbm_bytes, peak_hbm_frac=peak.total_bytes / chip.hbm_bytes,
        within_limit=peak.total_bytes <= hbm_limit * chip.hbm_bytes, hbm_limit=hbm_limit,
        decode_step_seconds=decode.seconds, decode_tokens_per_s_per_chip=decode_tokens_per_s(shape, decode),
        decode_flops_counted=counted,
        # For scale: a step that reads the chip's weights and KV cache once from HBM, nothing else.
        decode_hbm_floor_tokens_per_s_per_chip=shape.rows / shape.rollout_chips
        / ((copies.sampler_bytes + copies.cache_bytes) / chip.hbm_bytes_per_s),
        reshard_bytes=copies.reshard_bytes, reshard_seconds=copies.reshard_seconds,
        reshard_whole_bytes=copies.reshard_whole_bytes, reshard_whole_seconds=copies.reshard_whole_seconds,
        ici_bytes_per_s=copies.ici_bytes_per_s)


def format_summary(row: dict) -> str:
    """The summary row as lines under the preflight's table."""
    g = pf.GIB
    t = row["ici_bytes_per_s"]
    secs = (lambda x: f"{x:.3f} s") if t else (lambda _x: "- (no ICI figure for this chip)")
    return "\n".join([
        f"rollout sampling layout: {row['layout']}, per host data={row['data']} x tensor={row['tensor']} "
        f"({row['rollout_chips']} chip(s)), {row['rows_per_host']} rows per host",
        f"- per chip at the peak ({row['peak_function']}): {row['peak_bytes'] / g:.2f} GiB = sampler weights "
        f"{row['sampler_bytes'] / g:.2f} + KV cache {row['cache_bytes'] / g:.2f} + trainer state "
        f"{row['trainer_bytes'] / g:.2f} (params {row['trainer_param_bytes'] / g:.2f}) + other {row['other_bytes'] / g:.2f}"
        f" -> {100 * row['peak_hbm_frac']:.1f}% of HBM "
        f"({'within' if row['within_limit'] else 'OVER'} {100 * row['hbm_limit']:.0f}%)",
        f"- decode (cost model): {row['decode_step_seconds'] * 1e3:.2f} ms per step -> "
        f"{row['decode_tokens_per_s_per_chip']:.0f} tokens/s per chip (reading the weights and cache once per step "
        f"from HBM would allow {row['decode_hbm_floor_tokens_per_s_per_chip']:.0f})",
        f"- weight reshard trainer -> sampler: {row['reshard_bytes'] / g:.2f} GiB received per chip, "
        f"{secs(row['reshard_seconds'])} at {t / 1e9:.0f} GB/s ICI in; whole leaves gathered first: "
        f"{row['reshard_whole_bytes'] / g:.2f} GiB, {secs(row['reshard_whole_seconds'])}",
    ])
