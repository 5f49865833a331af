"""benchmarks/gpu.py runs without a GPU: its smoke mode (every section on a cut-down toy model, on CPU)
writes a JSON with a finite, positive figure for each section, so the one-command GPU script cannot
rot unseen; and its table finds the peaks of the GPUs it names."""

import importlib.util
import json
import math
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load_script():
    spec = importlib.util.spec_from_file_location("benchmarks_gpu", ROOT / "benchmarks" / "gpu.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _finite(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def test_smoke_mode_writes_every_section_with_finite_numbers(tmp_path):
    gpu = _load_script()
    peaks = {k: gpu.device_peaks(k, None, None) for k in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H200",
                                                         "NVIDIA A100-SXM4-80GB", "cpu")}
    assert [(p["tflops"], p["hbm_gbps"]) for p in peaks.values()] == [
        (989.0, 3350.0), (756.0, 2000.0), (989.0, 4800.0), (312.0, 2000.0), (None, None)]
    assert gpu.device_peaks("NVIDIA H100 80GB HBM3", None, 3000.0)["hbm_gbps"] == 3000.0  # a flag overrides

    out = tmp_path / "gpu_smoke.json"
    # Peaks given as flags: a CPU is in no table, and the floors and MFU are part of what is checked.
    ret = gpu.main(["--smoke", "--peak_tflops", "0.5", "--hbm_gbps", "20", "--out", str(out)])
    res = json.loads(out.read_text())
    assert ret["sections"].keys() == res["sections"].keys() == set(gpu.SECTIONS)
    for name, sec in res["sections"].items():
        assert "error" not in sec and "skipped" not in sec, (name, sec.get("error") or sec.get("skipped"))
    cases = res["sections"]["inference"]["cases"]
    assert cases and all("error" not in c and "skipped" not in c for c in cases), cases
    for c in cases:
        for k in ("prefill_tok_s", "decode_tok_s", "prefill_floor_tok_s", "decode_floor_tok_s", "compile_s"):
            assert _finite(c[k]), (k, c[k])
        assert c["prefill_tok_s"] > 0 and c["decode_tok_s"] > 0
        assert 0 < c["decode_frac_of_floor"] and 0 < c["prefill_frac_of_floor"]
    for kind in ("sft", "grpo"):
        s = res["sections"][kind]
        for k in ("step_s", "tokens_per_s", "model_tflops_per_s", "mfu", "loss"):
            assert _finite(s[k]), (kind, k, s[k])
        assert s["step_s"] > 0 and s["mfu"] > 0
    ro = res["sections"]["rollout"]
    for k in ("gen_tok_s", "wall_s", "decode_s", "trajectories_per_s"):
        assert _finite(ro[k]) and ro[k] > 0, (k, ro[k])
    assert ro["executions"] > 0 and ro["appends"] > 0  # the scripted code cells ran and came back
    assert res["smoke"] and res["peaks"]["source"] == "flags"
