"""Test setup: an 8-device CPU platform and a compilation cache before JAX starts; the tiny reference pair."""

import os

# Must precede the first `import jax` anywhere in the test session. LLVM -O0 for XLA's CPU
# kernels: the tests' tiny programs compile for seconds and run for milliseconds. One process each,
# empty cache: test_engine + test_kv_cache + test_eval_sharding 305 -> 246 s of CPU, all passing.
# Subprocesses get the same level (`launch_env.launcher_env`, `serve_helpers.server_env`).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# A persistent compilation cache for the session, set as environment variables so the launcher
# subprocesses (test_sft_launch, test_grpo_loop, test_launch_eval) inherit it: the same step
# compiled by another test, a resumed run or a second process is read back instead of rebuilt.
# Every entry counts (no minimum compile time or size); the directory is the repo's ignored tmp/.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tmp", "jax_compilation_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import pytest  # noqa: E402

# The files that take longest on 2 cores (pytest --durations on a fresh clone), run first: under
# `pytest -n auto --dist loadfile` (the README's command) each file goes whole to one worker, in
# collection order, so starting the long ones first keeps a worker from ending the run alone with
# one of them. Order only: a file missing here runs after these, as collected.
_LONG_FIRST = (
    "train/test_grpo_loop.py", "train/test_sft_launch.py",
    "demo/test_demo.py", "test_launch_errors.py", "train/test_grpo_step.py", "train/test_sft_step.py",
    "eval/test_eval_sharding.py", "rollout/test_engine.py", "test_model_parity.py",
    "train/test_packing.py", "serve/test_server.py",
)


def pytest_collection_modifyitems(config, items):
    def rank(item):
        rel = os.path.relpath(str(item.path), os.path.dirname(os.path.abspath(__file__)))
        return _LONG_FIRST.index(rel) if rel in _LONG_FIRST else len(_LONG_FIRST)

    items.sort(key=rank)  # stable: within a file and among the rest, the collected order stays


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: without it installed, unused
def pytest_xdist_auto_num_workers(config):
    # One worker per core, at most 4: several tests start multi-process runs of their own.
    return max(1, min(4, len(os.sched_getaffinity(0))))


@pytest.fixture(scope="session")
def tiny_pair():
    """(reference torch model, our NNX model, cfg) with identical random weights, float32.

    Norm scales and biases are randomized too (the reference initializes them to 1 and 0, which
    would hide a transposed or dropped bias).
    """
    torch = pytest.importorskip("torch")
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from codedance_jax.checkpoint.build import model_from_tensors
    from codedance_jax.model.config import ModelConfig
    from codedance_jax.model.params import canonical_hf_name

    cfg = ModelConfig.tiny()
    torch.manual_seed(1234)
    ref = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**cfg.to_hf_config())).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            base = 1.0 if ("norm" in name or "ln_q" in name) else 0.0
            p.copy_(base + 0.05 * torch.randn_like(p))
    sd = {canonical_hf_name(k): v.detach().numpy() for k, v in ref.state_dict().items()}
    ours = model_from_tensors(cfg, lambda r: sd[r.hf_name])
    return ref, ours, cfg


_CACHE_EVENTS = {"/jax/compilation_cache/compile_requests_use_cache": 0, "/jax/compilation_cache/cache_hits": 0}
# XLA backend compilations in the test processes (a persistent-cache read counts as one, briefly), summed
# over xdist workers for the summary: what share of the suite's time is compiling rather than running.
_COMPILES = {"n": 0, "s": 0.0}
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


def pytest_configure(config):
    # xdist would otherwise order files by their number of tests, not by _LONG_FIRST's order.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    import gc

    import jax

    # Python's cyclic GC walks every live object on each full collection, and a test process holds
    # torch, transformers, TF and hundreds of compiled programs: with the default thresholds it
    # spent 5.0 s of a 141-s run of test_sft_step + test_model_parity collecting, 1.7 s with these
    # (objects alive now frozen out of the walk; collections ~8x rarer). Only timing changes.
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)

    def count(event, **kwargs):
        if event in _CACHE_EVENTS:
            _CACHE_EVENTS[event] += 1

    def timed(event, duration, **kwargs):
        if event == _BACKEND_COMPILE:
            _COMPILES["n"] += 1
            _COMPILES["s"] += duration

    jax.monitoring.register_event_listener(count)
    jax.monitoring.register_event_duration_secs_listener(timed)


def pytest_sessionfinish(session):
    out = getattr(session.config, "workeroutput", None)  # set in an xdist worker: report to the controller
    if out is not None:
        out["jax_cache_events"] = list(_CACHE_EVENTS.values())
        out["jax_compiles"] = dict(_COMPILES)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist, in the controller: add up what each worker saw
def pytest_testnodedown(node, error):
    out = getattr(node, "workeroutput", {})
    for key, n in zip(_CACHE_EVENTS, out.get("jax_cache_events", ()), strict=False):
        _CACHE_EVENTS[key] += n
    for key in _COMPILES:
        _COMPILES[key] += out.get("jax_compiles", {}).get(key, 0)


def pytest_terminal_summary(terminalreporter):
    asked, hits = _CACHE_EVENTS.values()
    if asked:
        terminalreporter.write_line(f"JAX compilation cache ({os.environ['JAX_COMPILATION_CACHE_DIR']}): "
                                    f"{hits} of {asked} compilations read back; {_COMPILES['n']} backend "
                                    f"compilations took {_COMPILES['s']:.0f} s (test processes only, not their "
                                    "subprocesses)")
