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
    assert "1 host(s) x 4 chips" in plan.rollout and "16 rows (8 prefill rows), 4 rows per chip" in plan.rollout
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
