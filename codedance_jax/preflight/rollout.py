"""The rollout engine's jitted functions at the shapes one host of a slice runs, for the pod preflight.

A GRPO step samples `prompts_per_step x group_size` trajectories, split over the slice's hosts:
each host rolls out its share of the prompts with its own `RolloutEngine` (SPEC: rows are
host-local; only the update is global). So the rollout functions are compiled for ONE host:
`hosts = chips / CHIPS_PER_HOST` (4 chips per TPU VM host on v4, v5p, v5e and v6e multi-host
slices; a slice of fewer chips is one host), rows per host = the host's prompts x group_size
rounded up to `rollout.batch_multiple`, as `RolloutEngine.rollout` pads them. The host's rows are
split over a `data` mesh of `rollout_chips` of its chips with the parameters replicated, which is
`RolloutEngine(mesh=)`'s placement (`sharding.row_sharding` for the cache, logits and chunk
inputs); `rollout_chips=1` is one chip holding the whole host's batch.

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
from jax.sharding import NamedSharding, PartitionSpec

from codedance_jax import sharding
from codedance_jax.model import generate
from codedance_jax.model.config import ModelConfig
from codedance_jax.preflight import topology as pf
from codedance_jax.rollout.config import RolloutConfig
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

    def describe(self) -> str:
        return (f"rollout: {self.hosts} host(s) x {self.chips_per_host} chips; per host {self.prompts_per_host} "
                f"prompts x {self.group_size} = {self.rows} rows ({self.prompt_rows} prefill rows), "
                f"{self.rows // self.rollout_chips} rows per chip over a data mesh of {self.rollout_chips} chip(s), "
                f"parameters replicated; cache {self.cache_slots} slots; vision of the shape plan: one call per "
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


def rollout_shape(config, rcfg: RolloutConfig, mcfg: ModelConfig, chips: int, rollout_chips: int = 0) -> RolloutShape:
    per_host = min(CHIPS_PER_HOST, chips)
    hosts = chips // per_host
    rollout_chips = rollout_chips or per_host
    if rollout_chips > per_host:
        raise ValueError(f"--rollout_chips={rollout_chips}: a host has {per_host} chips")
    if rcfg.batch_multiple % rollout_chips:
        raise ValueError(f"rollout.batch_multiple={rcfg.batch_multiple} is not a multiple of the rollout's "
                         f"{rollout_chips} chips (RolloutEngine(mesh=) splits the rows over them)")
    prompts = -(-int(config.prompts_per_step) // hosts)
    g = int(config.group_size)
    plan = rollout_plan(rcfg, mcfg, rows=prompts * g, prompts=prompts, prompt_max_pixels=prompt_max_pixels(config))
    units, windows = plan.vision("append", plan.rows)
    p_units, p_windows = plan.vision("prefill", plan.prompt_rows)
    images = units // max(1, plan.obs_image[0])
    return RolloutShape(hosts, per_host, rollout_chips, prompts, g, plan.rows, plan.prompt_rows, plan.cache_sizes[-1],
                        images, units, windows, p_units, p_windows, len(plan.programs()), plan.obs_image,
                        plan.prompt_image)


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


def rollout_calls(config, mcfg: ModelConfig, devices, rollout_chips: int = 0) -> tuple[RolloutShape, list[RolloutCall]]:
    """The engine's jitted functions with abstract arguments on one host's mesh (module docstring)."""
    rcfg = RolloutConfig.from_block(config.rollout)  # as the GRPO run builds its engine's
    shape = rollout_shape(config, rcfg, mcfg, len(devices), rollout_chips)
    mesh = pf.topology_mesh(devices[: shape.rollout_chips], shape.rollout_chips, 1, 1)
    replicated = NamedSharding(mesh, PartitionSpec())

    def rep(_shape):
        return replicated

    def rows(batch_dim=0):
        return lambda s: sharding.row_sharding(mesh, s, batch_dim)

    # The policy as the run hands it to the engine: the training parameters (param dtype), here
    # replicated over the host's data mesh.
    mdef, params = st.abstract_params(mcfg)
    model = mdef.model(_abstract(params, rep))
    b, n, s = shape.rows, shape.prompt_rows, shape.cache_slots
    cache = _abstract(jax.eval_shape(lambda: model.init_cache(b, s)), rows())
    small = _abstract(jax.eval_shape(lambda: model.init_cache(n, s)), rows())

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
                                 {"last_only": True}, fwd_flops(n, length), cache_note, held_cache))
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
    return shape, calls
