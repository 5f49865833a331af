"""Pod preflight: the real TPU compiler (libtpu) on this CPU machine, for compile-only TPU devices.

The compile tests need libtpu, which lives only in the optional TPU venv (requirements-tpu.txt;
`.ci/run` builds it and runs this file with it); in the main venv they skip, saying so.
"""

import os
import subprocess
import sys

import pytest

from codedance_jax.preflight import topology as pf

LIBTPU = pf.libtpu_available()
needs_libtpu = pytest.mark.skipif(LIBTPU is not None, reason=str(LIBTPU))
if LIBTPU is None:
    pf.offline_tpu_env("v5e:2x2")  # before any TPU plugin loads; no metadata server, no hosts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_parse_topology_and_offline_env_names_the_slice():
    chip, dims = pf.parse_topology("v5p:4x4x4")
    assert chip.name == "v5p" and dims == (4, 4, 4)
    with pytest.raises(ValueError, match="CHIP:AxB"):
        pf.parse_topology("v5p-128")
    env = {}
    old = dict(os.environ)
    try:
        for k in ("TPU_ACCELERATOR_TYPE", "TPU_SKIP_MDS_QUERY", "TPU_WORKER_HOSTNAMES"):
            os.environ.pop(k, None)
        env = pf.offline_tpu_env("v5p:4x4x4")
    finally:
        os.environ.clear()
        os.environ.update(old)
    assert env["TPU_ACCELERATOR_TYPE"] == "v5p-128"  # type names count TensorCores: 2 per v5p chip
    assert env["TPU_SKIP_MDS_QUERY"] == "1" and env["TPU_WORKER_HOSTNAMES"] == "localhost"


def test_largest_buffers_reads_optimized_hlo_lines():
    hlo = "\n".join([
        '  %fusion.1 = bf16[2,4096,152064]{2,1,0} fusion(%p), metadata={op_name="jit(step)/dot_general"}',
        "  ROOT %tuple = (f32[], f32[]) tuple(%a, %b)",
        "  %p.2 = f32[128]{0} parameter(2)",
    ])
    (size, label), (size2, _) = pf.largest_buffers(hlo, n=2)
    assert size == 2 * 4096 * 152064 * 2 and "jit(step)/dot_general" in label and size2 == 512


def _plan(topology, rows_per_chip=1, preset="tiny", config_file="configs/sft.py", only="", cost_model=False, **overrides):
    import importlib.util

    from codedance_jax.preflight import plan as preflight_plan
    from codedance_jax.train.batching import collate

    spec = importlib.util.spec_from_file_location("cfg_" + os.path.basename(config_file)[:-3],
                                                  os.path.join(ROOT, config_file))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    config = mod.get_config(preset)
    for k, v in overrides.items():  # dotted names reach nested blocks: rollout__obs_buckets -> rollout.obs_buckets
        node, *path = k.split("__")
        target = config
        for p in [node, *path][:-1]:
            target = target[p]
        target[([node, *path])[-1]] = v
    return preflight_plan.plan_from_config(
        config, topology, rows_per_chip=rows_per_chip, bucket=0, only=only, cost_model=cost_model,
        empty_batch=lambda b, v: collate([], b, pad_id=0, vision_cfg=v))


def preflight_plan_compile(plan):
    from codedance_jax.preflight import plan as preflight_plan

    return preflight_plan.compile_plan(plan)


@needs_libtpu
@pytest.mark.parametrize("config_file", ["configs/sft.py", "configs/grpo.py"])
def test_per_chip_memory_is_flat_from_4_to_16_chips(config_file):
    """Fixed rows per chip: per-chip temporaries must not follow the global batch (issue 19)."""
    kw = dict(grad_accum=2, only="train")
    small_plan = _plan("v5e:2x2", 2, config_file=config_file, **kw)
    assert small_plan.chips == 4 and small_plan.rows == 2 * 4 * 2
    small = preflight_plan_compile(small_plan)
    large = preflight_plan_compile(_plan("v5e:4x4", 2, config_file=config_file, **kw))
    for a in small:  # the tiny preset compiles for v5e 2x2 and fits, with XLA's counts
        assert a.fits and a.argument_bytes > 0 and a.temp_bytes > 0 and a.xla_flops > 0 and a.model_flops > 0
    for a, b in zip(small, large, strict=True):
        assert a.name == b.name
        # Arguments shrink (state split 16 ways instead of 4); temporaries may only grow by the
        # collectives' buffers, never by 4x as the global batch does.
        assert b.temp_bytes <= 1.25 * a.temp_bytes + 8 * 2**20, (a.name, a.temp_bytes, b.temp_bytes)
        assert b.total_bytes <= 1.1 * a.total_bytes + 8 * 2**20, (a.name, a.total_bytes, b.total_bytes)


@needs_libtpu
def test_launcher_prints_the_table_and_exits_2_naming_buffers_when_a_step_does_not_fit():
    cmd = [sys.executable, "-m", "launch.preflight", "--config=configs/sft.py:tiny", "--topology=v5e:2x2",
           "--bucket=0", "--rows_per_chip=2048"]
    big = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert big.returncode == 2, big.stderr[-2000:]
    assert "| sft.train_step |" in big.stdout and "| NO |" in big.stdout
    assert "does not fit v5e:2x2" in big.stderr and "largest buffers" in big.stdout


@needs_libtpu
def test_launcher_all_buckets_compiles_the_step_of_every_bucket(tmp_path):
    """--all_buckets: one training-step row per bucket of the config (the run's whole update plan)."""
    out = tmp_path / "plan.json"
    cmd = [sys.executable, "-m", "launch.preflight", "--config=configs/sft.py:tiny", "--topology=v5e:2x2",
           "--all_buckets", f"--json_out={out}"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-2000:]
    import json

    names = [x["name"] for x in json.loads(out.read_text())["reports"]]
    assert names == ["sft.train_step @(128, 16, 8)", "sft.train_step @(256, 32, 16)"], names
    assert "the whole update plan: 2 buckets" in r.stdout


def test_launcher_exits_2_with_one_line_on_a_bad_topology():
    cmd = [sys.executable, "-m", "launch.preflight", "--config=configs/sft.py:tiny", "--topology=v5p-128"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("preflight: --topology='v5p-128'")


@needs_libtpu
def test_grpo_rollout_functions_compile_for_one_host_with_rows_split_over_its_chips():
    """The rollout engine's own jitted functions (prefill, share, decode chunk, append, compact,
    vision) compile for v5e 2x2 at the tiny preset's per-host batch, each fitting a chip (issue 19)."""
    plan = _plan("v5e:2x2", config_file="configs/grpo.py", only="rollout", rollout__prompt_buckets=(128,),
                 rollout__obs_buckets=(64,))
    # One host of 4 chips: 4 prompts x 4 = 16 rows, 4 per chip; the prefill runs one row per prompt (padded to 8).
    assert "1 host(s) x 4 chips" in plan.rollout
    assert "16 rows (8 prefill rows), 4 rows per data slice over a sampling mesh data=4 x tensor=1" in plan.rollout
    names = [e.name for e in plan.entries]
    assert names[:5] == ["rollout.prefill@128", "rollout.share_prompts", "rollout.decode_chunk x16", "rollout.append@64",
                         "rollout.compact_cache"]
    # the shape plan's two vision calls (rollout/shapes.py): the host's prompts', every row's observation images
    assert [n.split("@")[0] for n in names[5:]] == ["rollout.vision.prefill", "rollout.vision.append"], names
    assert "rollout programs" in plan.rollout
    reports = preflight_plan_compile(plan)
    for r in reports:
        assert r.chips == 4 and r.fits, (r.name, r.total_bytes)
        assert 0 < r.total_bytes < r.hbm_bytes and r.argument_bytes > 0, r.name
    by = {r.name: r for r in reports}
    # The KV cache is split over the 4 chips: the whole-batch steps hold a quarter of it per chip,
    # next to the replicated parameters (tiny preset: 2 layers, 2 KV heads x 16, 512 slots, float32).
    cache_per_chip = 2 * 2 * 16 * 512 * 2 * 16 * 4 // 4  # layers, k/v, rows, slots, KV heads, head dim, bytes
    for name in ("rollout.decode_chunk x16", "rollout.append@64"):
        assert by[name].alias_bytes >= cache_per_chip, (name, by[name].alias_bytes)  # the cache is donated
    assert by[names[5]].xla_flops > 0 and by[names[6]].xla_flops > 0 and by["rollout.prefill@128"].xla_flops > 0


@needs_libtpu
def test_flash_attention_kernel_runs_per_chip_and_the_cost_model_variant_counts_the_whole_step():
    """attention="auto" compiles the Pallas TPU kernel for a TPU, inside shard_map: each chip's
    kernel call takes its own rows (2), never the global batch (16). The cost-model variant (one
    micro-batch, one output-layer chunk) leaves no loop for XLA's cost analysis to undercount."""
    import re

    plan = _plan("v5e:2x2", 2, grad_accum=2, only="train")
    e = plan.entries[0]
    compiled = e.jitted.lower(*e.args).compile()
    calls = [ln for ln in compiled.as_text().splitlines() if "tpu_custom_call" in ln and "flash" in ln]
    assert calls, "no flash-attention kernel in the compiled step"
    rows = {int(m.group(1)) for ln in calls for m in [re.search(r"= \(?[a-z0-9]+\[(\d+),", ln)] if m}
    assert rows == {2}, rows  # per chip: 2 rows; 16 would mean the kernel was gathered to every chip
    (xla,) = preflight_plan_compile(_plan("v5e:2x2", 2, grad_accum=2, only="train", attention="xla"))
    assert compiled.memory_analysis().temp_size_in_bytes < xla.temp_bytes  # no [B, N, T, T] scores in HBM
    assert xla.loops_undercounted  # grad_accum 2: XLA counts one of the two micro-batches
    cost_plan = _plan("v5e:2x2", 2, grad_accum=2, only="train", cost_model=True)
    assert cost_plan.grad_accum == 1 and cost_plan.rows == 8  # one micro-batch: 2 rows x 4 chips
    (cost,) = preflight_plan_compile(cost_plan)
    assert cost.uncounted_seconds > 0  # the kernel's backward, which XLA does not cost
    assert not cost.loops_undercounted and cost.xla_flops >= cost.model_flops, (cost.xla_flops, cost.model_flops)


def _cpu_mesh(data, fsdp, tensor):
    import jax

    from codedance_jax import sharding

    return sharding.make_mesh(data, fsdp, tensor, devices=jax.devices("cpu")[: data * fsdp * tensor])


def test_reshard_bytes_are_what_each_chip_lacks_of_its_sampling_shard():
    """Trainer rows split over fsdp=4 -> sampler columns split over tensor=2 on the same 4 devices:
    each device holds 2x6 of an [8, 6] float32 leaf and needs 8x3, of which its own rows give 2x3."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from codedance_jax.preflight import rollout as pr

    trainer, sampler = _cpu_mesh(1, 4, 1), _cpu_mesh(2, 1, 2)
    src = NamedSharding(trainer, P("fsdp", None))
    need, whole = pr.reshard_bytes([((8, 6), 4, src, NamedSharding(sampler, P(None, "tensor")))])
    assert set(need.values()) == {(8 * 3 - 2 * 3) * 4} and set(whole.values()) == {(8 * 6 - 2 * 6) * 4}
    # Replicated on the sampler (tensor = 1): every device lacks the 6 rows it does not hold.
    need, _ = pr.reshard_bytes([((8, 6), 4, src, NamedSharding(_cpu_mesh(4, 1, 1), P()))])
    assert set(need.values()) == {(8 - 2) * 6 * 4}
    # Already in place: nothing moves; and the bytes add up over leaves.
    need, _ = pr.reshard_bytes([((8, 6), 4, src, src), ((8, 6), 2, src, src)])
    assert set(need.values()) == {0}


def test_tensor_split_halves_the_samplers_weights_per_chip():
    """The sampler's copy on (data 2, tensor 2) holds about half of the policy per chip: every
    large matrix (embedding, output layer, attention, MLP) is split; norms and biases stay whole."""
    from codedance_jax.model.config import ModelConfig
    from codedance_jax.preflight import rollout as pr
    from codedance_jax.preflight import topology
    from codedance_jax.train import state as st

    _, params = st.abstract_params(ModelConfig.tiny())
    one = pr.sampler_param_shardings(params, _cpu_mesh(4, 1, 1))
    two = pr.sampler_param_shardings(params, _cpu_mesh(2, 1, 2))
    values = [v.get_value() for v in jax_leaves(params)]
    b1 = pr.per_chip_bytes(topology.abstract(values, jax_leaves(one)))
    b2 = pr.per_chip_bytes(topology.abstract(values, jax_leaves(two)))
    total = sum(x.size * x.dtype.itemsize for x in values)
    assert b1 == total  # tensor = 1: the whole policy on every chip
    assert 0.5 * total <= b2 <= 0.52 * total, (b2, total)
    assert all(set(s.spec) <= {None, "tensor"} for s in jax_leaves(two))  # never fsdp, never data


def jax_leaves(tree):
    import jax
    from flax import nnx

    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


@needs_libtpu
def test_sampling_mesh_tensor_2_halves_weights_keeps_cache_and_counts_the_trainer_copy():
    """One host of v5e 2x2, tiny preset: on data=2 x tensor=2 the sampler's weights per chip halve
    against data=4 x tensor=1, the KV cache per chip stays (rows over 2, KV heads over 2), the
    trainer's state is held beside every call (both copies), and the reshard moves what each chip lacks."""
    from codedance_jax.preflight import rollout as pr

    kw = dict(config_file="configs/grpo.py", only="rollout", rollout__prompt_buckets=(128,),
              rollout__obs_buckets=(64,))
    p1, p2 = _plan("v5e:2x2", **kw, rollout__mesh_tensor=1), _plan("v5e:2x2", **kw, rollout__mesh_tensor=2)
    assert "data=4 x tensor=1" in p1.rollout and "data=2 x tensor=2" in p2.rollout
    c1, c2 = p1.rollout_copies, p2.rollout_copies
    assert 0.5 * c1.sampler_bytes <= c2.sampler_bytes <= 0.52 * c1.sampler_bytes, (c1, c2)
    # keys and values: the same share per chip; valid / next_pos are split by rows only (data 4 -> 2), a few KiB
    assert 0 < c1.cache_bytes <= c2.cache_bytes <= 1.01 * c1.cache_bytes
    assert c1.trainer_bytes == c2.trainer_bytes > c1.trainer_param_bytes
    # fsdp=4 trainer: tensor=1 lacks 3/4 of each leaf; tensor=2 lacks its half less what its quarter covers.
    assert c1.reshard_bytes == c1.reshard_whole_bytes and c2.reshard_bytes < c2.reshard_whole_bytes
    assert c2.reshard_seconds == c2.reshard_bytes / 200e9  # v5e: 1,600 Gbps into a chip
    (d1,), (d2,) = ([e for e in p.entries if e.name.startswith("rollout.decode_chunk")] for p in (p1, p2))
    assert d1.resident_bytes == c1.trainer_bytes and d2.resident_bytes == c2.trainer_bytes
    r1, r2 = (preflight_plan_compile(_only(p, d)) for p, d in ((p1, d1), (p2, d2)))
    drop = c1.sampler_bytes - c2.sampler_bytes
    # The compiled decode's arguments fall by the weights' half (logits and row inputs: data 4 -> 2, small).
    assert abs((r1[0].argument_bytes - r2[0].argument_bytes) - drop) < 0.1 * drop, (r1[0].argument_bytes,
                                                                                   r2[0].argument_bytes, drop)
    row = pr.summary(p2.rollout_shape, c2, r2, p2.chip)
    assert row["peak_bytes"] == r2[0].total_bytes == (row["sampler_bytes"] + row["cache_bytes"] + row["trainer_bytes"]
                                                     + row["other_bytes"])
    assert row["decode_tokens_per_s_per_chip"] == 16 / 4 / r2[0].seconds and row["within_limit"]


def _only(plan, entry):
    import dataclasses

    return dataclasses.replace(plan, entries=[entry])


def test_extrapolated_temporaries_never_fall_below_a_depth_point():
    """A transient working set (one chunk's attention scores) exists at any depth: when the compiler's
    temporaries fall from 1 to 2 layers, the line would extrapolate below them; the largest stays."""
    def rep(temp, args):
        return pf.Report("f", 4, 16 * pf.GIB, args, 0, 0, temp, 0, 0.0, 0.0, 0.0, 1.0)

    base, text1, vis1 = rep(40 * pf.GIB, 10), rep(39 * pf.GIB, 20), rep(40 * pf.GIB, 11)
    out = pf.extrapolate(base, text1, vis1, 27, 31)
    assert out.temp_bytes == 40 * pf.GIB and out.argument_bytes == 10 + 27 * 10 + 31 * 1
    grow = pf.extrapolate(rep(1 * pf.GIB, 0), rep(2 * pf.GIB, 0), rep(1 * pf.GIB, 0), 27, 0)
    assert grow.temp_bytes == 28 * pf.GIB  # growing temporaries extrapolate as before


def test_extrapolated_temporaries_take_the_increment_past_the_first_layer():
    """With a compile two text layers up, the temporaries grow by the 2 -> 3 layer increment: flat
    past the first layer (the 7B append: 8.75, 10.63, 10.63 GiB) stays flat; growing grows."""
    def rep(temp, args=0):
        return pf.Report("f", 4, 16 * pf.GIB, args, 0, 0, temp, 0, 0.0, 0.0, 0.0, 1.0)

    flat = pf.extrapolate(rep(8 * pf.GIB, 10), rep(10 * pf.GIB, 20), rep(8 * pf.GIB, 11), 27, 31,
                          plus_text2=rep(10 * pf.GIB, 30))
    assert flat.temp_bytes == 10 * pf.GIB and flat.argument_bytes == 10 + 27 * 10 + 31 * 1
    grow = pf.extrapolate(rep(1 * pf.GIB), rep(3 * pf.GIB), rep(1 * pf.GIB), 27, 0, plus_text2=rep(4 * pf.GIB))
    assert grow.temp_bytes == (3 + 26) * pf.GIB
    vision = pf.extrapolate(rep(1 * pf.GIB), rep(2 * pf.GIB), rep(1.5 * pf.GIB), 2, 2, plus_text2=rep(2 * pf.GIB))
    assert vision.temp_bytes == int(2 * pf.GIB + 2 * 0.5 * pf.GIB)
    assert "+1/+2 layer" in flat.note
