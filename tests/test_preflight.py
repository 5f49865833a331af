"""Pod preflight: the real TPU compiler (libtpu) on this CPU machine, for compile-only TPU devices.

The compile tests need libtpu, which lives only in the optional TPU venv (requirements-tpu.txt;
`.ci/run` builds it and runs this file with it); in the main venv they skip, saying so.
"""

import os
import subprocess
import sys

import pytest

from codedance_jax import preflight as pf

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


def _plan(topology, rows_per_chip=1, preset="tiny", config_file="configs/sft.py", **overrides):
    import importlib.util

    from codedance_jax import preflight_plan
    from codedance_jax.train.batching import collate

    spec = importlib.util.spec_from_file_location("cfg_" + os.path.basename(config_file)[:-3],
                                                  os.path.join(ROOT, config_file))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    config = mod.get_config(preset)
    config.update(overrides)
    return preflight_plan.plan_from_config(
        config, topology, rows_per_chip=rows_per_chip, bucket=0,
        empty_batch=lambda b, v: collate([], b, pad_id=0, vision_cfg=v))


def preflight_plan_compile(plan):
    from codedance_jax import preflight_plan

    return preflight_plan.compile_plan(plan)


@needs_libtpu
@pytest.mark.parametrize("config_file", ["configs/sft.py", "configs/grpo.py"])
def test_per_chip_memory_is_flat_from_4_to_16_chips(config_file):
    """Fixed rows per chip: per-chip temporaries must not follow the global batch (issue 19)."""
    kw = dict(grad_accum=2)
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


def test_launcher_exits_2_with_one_line_on_a_bad_topology():
    cmd = [sys.executable, "-m", "launch.preflight", "--config=configs/sft.py:tiny", "--topology=v5p-128"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("preflight: --topology='v5p-128'")
