"""One command on one GPU: inference, update-step and rollout speed at the Qwen2.5-VL presets (issue 36).

    python benchmarks/gpu.py                                     # one GPU; a 420 s budget (untimed on a GPU)
    python benchmarks/gpu.py --peak_tflops 756 --hbm_gbps 2000   # a GPU the table below does not know
    python benchmarks/gpu.py --sections inference --presets 7b   # one part only
    python benchmarks/gpu.py --smoke                             # every section on a toy model, CPU, ~20 s

Every model has random weights (nothing is downloaded): speed does not depend on their values. The
sections share one time budget (`--budget_s`): each gets its weight's share of what is left when it
starts, and a section starts only with `--min_start_s` left (else it is recorded as skipped). A case
compiles in a warm-up call (the update steps ahead of it), then repeats its timed call until it has
`--reps` of them or its share is spent (one at least). A compile cannot be cut short, so the run may
end past the budget by the case then running. A case that fails (out of memory above all) is
recorded in the JSON with its error, and the run goes on with the next.

  inference  bfloat16 weights and compute at `ModelConfig.qwen25vl_3b()` and `qwen25vl_7b()`, batch 1
             and 32: prefill of a `--prompt_len`-token text prompt into a fresh KV cache
             (`generate.extend_host` with last-token logits, as generation prefills; the host's M-RoPE
             ids included), then `--decode_steps` greedy steps (`generate.greedy_decode`: one compiled
             loop of one-token `Qwen25VL.extend` calls, the KV-cache path the rollout sampler runs).
             Beside each, the roofline floor on this GPU: time >= max(FLOPs / peak, bytes / HBM
             bandwidth). Prefill: 2 x matmul weights x tokens + causal attention + the last token's
             output layer. A decode step reads every decoder weight and the output layer once and the
             KV cache of the valid context (its mean over the steps; the static cache's empty slots,
             which the step also reads, are not counted).
  sft, grpo  one update of `train.sft.make_train_step` / `train.grpo.make_grpo_step` (GRPO takes the
             old log-probs from its own forward, as the loop does) at the 3B preset with the numerics
             and optimizers of the qwen25vl_3b presets of configs/sft.py and configs/grpo.py (bfloat16
             compute, float32 master weights and AdamW moments, full remat), on a synthetic batch of
             `--train_batch` rows x `--train_seq` tokens, each row one 448 x 448 image (256 image
             tokens) and text, its second half trained. MFU = model FLOPs (`codedance_jax/train/flops.py`:
             6 x params x tokens + attention + 6 x vision params x patches) / step time / peak. XLA's
             memory plan of each step (`compiled_memory_gb`) is recorded even when the step then fails.
  rollout    `RolloutEngine.rollout`, the turn loop of the GRPO step and the demo, at the 3B preset with
             the GRPO preset's numerics (the loop samples with the float32 master weights) and its
             decode chunk, append threshold and temperature, shorter token budgets, on
             `--rollout_prompts` x `--rollout_group` rows in one row bucket, one 448 x 448 image per
             prompt. Scripted as benchmarks/rollout.py: row r forces r % 4 code cells (forced tokens
             cost a decode step like sampled ones), answered by the fake sandbox of the tests
             (tests/rollout/fakes.py: `--fake_delay` s per cell, a printed line and one 224 x 224
             image), then samples its last turn to the turn budget (random weights write no stop).
             Generated tokens/s = sampled and forced tokens / wall time of the call.

Peaks (bfloat16 dense TFLOP/s, HBM GB/s) come from `GPUS` by `jax.devices()[0].device_kind`;
`--peak_tflops` / `--hbm_gbps` set or override them; without either, floors and MFU are left out.
JAX preallocates 95% of GPU memory here (`XLA_PYTHON_CLIENT_MEM_FRACTION`; its default 0.75 leaves
the 3B train state, ~60 GB of float32 weights, moments and gradients, without room). The persistent
compilation cache (`codedance_jax/compile_cache.py`) is on unless `--no_compile_cache`: a rerun
compiles little, so its compile times read near zero.

--smoke runs every section at small sizes on the `smoke` preset: the demo's toy model (toy
tokenizer, `ModelConfig.toy`) cut to 2 decoder layers and one vision block, in about 20 s on 2 CPU
cores (tests/test_gpu_script.py runs it).

Prints a table; writes benchmarks/results/gpu/<device kind>_<date>.json (`--out` to choose).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from codedance_jax import sharding as shd  # noqa: E402
from codedance_jax.model import rope  # noqa: E402
from codedance_jax.model.config import ModelConfig  # noqa: E402
from codedance_jax.model.generate import extend_host, greedy_decode  # noqa: E402
from codedance_jax.model.qwen25vl import Qwen25VL, num_params  # noqa: E402
from codedance_jax.rl.grpo_loss import GRPOLossConfig  # noqa: E402
from codedance_jax.train import batching, flops, grpo, optim, sft  # noqa: E402
from codedance_jax.train import state as st  # noqa: E402

SECTIONS = ("inference", "sft", "grpo", "rollout")
# Each section's share of the budget left when it starts (compiles at 3B and 7B dominate the first two).
WEIGHTS = {"inference": 0.45, "sft": 0.15, "grpo": 0.15, "rollout": 0.25}
# (words all in device_kind, name, bfloat16 dense TFLOP/s, HBM GB/s); the first match wins. From the
# vendors' data sheets (dense, without sparsity).
GPUS = (
    (("h200",), "H200", 989.0, 4800.0),
    (("h100", "pcie"), "H100 PCIe", 756.0, 2000.0),
    (("h100",), "H100 SXM", 989.0, 3350.0),
    (("a100", "80gb"), "A100 80GB", 312.0, 2000.0),
    (("a100",), "A100 40GB", 312.0, 1555.0),
)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Every size the run uses: `FULL` for a GPU, `SMOKE` for the smoke preset on CPU."""

    presets: tuple[str, ...]  # inference models
    batches: tuple[int, ...]
    prompt_len: int
    decode_steps: int
    train_preset: str
    train_batch: int
    train_seq: int
    image_side: int  # patches per side of each training row's image (32: 448 px, 256 image tokens)
    rollout_preset: str
    rollout_prompts: int
    rollout_group: int
    rollout_image_px: int
    obs_image_px: int
    rollout: dict  # RolloutConfig fields besides the preset's


FULL = Sizes(presets=("3b", "7b"), batches=(1, 32), prompt_len=1024, decode_steps=256, train_preset="3b",
             train_batch=4, train_seq=1024, image_side=32, rollout_preset="3b", rollout_prompts=4, rollout_group=8,
             rollout_image_px=448, obs_image_px=224,
             rollout=dict(max_turns=4, max_turn_tokens=128, max_new_tokens=512, max_total_tokens=2048,
                          prompt_buckets=(512,), obs_buckets=(256,)))
SMOKE = Sizes(presets=("smoke",), batches=(8,), prompt_len=64, decode_steps=8, train_preset="smoke", train_batch=4,
              train_seq=128, image_side=8, rollout_preset="smoke", rollout_prompts=2, rollout_group=4,
              rollout_image_px=112, obs_image_px=56,
              rollout=dict(max_turns=3, max_turn_tokens=96, max_new_tokens=192, max_total_tokens=512,
                           prompt_buckets=(256,), obs_buckets=(64,)))
PRESETS = ("3b", "7b", "tiny", "toy", "smoke")
CELL = ('<think>look closer</think>\n<code>\n```python\nfrom PIL import Image\nim = Image.open("image.png")\n'
        "crop = im.crop((0, 0, im.size[0] // 2, im.size[1] // 2))\nshow({w}, {w})\n"
        'print("the corner is plain")\n```\n</code>')
_TOY_DIR: list[str] = []


def toy_processor_dir() -> str:
    """The toy world's processor files (a byte-level BPE trained on the prompt and cell texts, in
    milliseconds), made once per process: the smoke run's tokenizer and `ModelConfig.toy` sizes."""
    if not _TOY_DIR:
        from codedance_jax.protocol import rl_question
        from data.toyworld import write_toy_processor_files

        d = tempfile.mkdtemp(prefix="gpu_bench_toy_")
        texts = [rl_question(f"What is in the corner? ({i})") for i in range(4)] + [CELL.format(w=56)] * 4
        write_toy_processor_files(d, texts, max_pixels=SMOKE.rollout_image_px**2)
        _TOY_DIR.append(d)
    return _TOY_DIR[0]


def preset_config(name: str) -> ModelConfig:
    """`ModelConfig` of a preset name: 3b, 7b, tiny (the tests' model, Qwen's 152k-row vocabulary), toy
    (the demo's sizes on the toy tokenizer) or smoke (toy cut to 2 decoder layers and one vision block,
    full attention: the same mechanisms, about a third less to compile, so the smoke test stays short)."""
    if name in ("toy", "smoke"):
        from data.toyworld import toy_model_config

        c = toy_model_config(toy_processor_dir())
        if name == "smoke":
            c = c.replace(text=dataclasses.replace(c.text, num_hidden_layers=2),
                          vision=dataclasses.replace(c.vision, depth=1, fullatt_block_indexes=(0,)))
        return c
    return {"tiny": ModelConfig.tiny, "3b": ModelConfig.qwen25vl_3b, "7b": ModelConfig.qwen25vl_7b}[name]()


def text_ids(cfg: ModelConfig) -> tuple[int, int]:
    """The id range random text draws from: below every special id (Qwen's and the toy's come last)."""
    return 10, min(cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id,
                   cfg.bos_token_id, cfg.eos_token_id)


# ----------------------------------------------------------------------------------- the machine
def device_peaks(kind: str, tflops: float | None, gbps: float | None) -> dict:
    """Peak bf16 TFLOP/s and HBM GB/s: flags first, else the `GPUS` row whose words `kind` holds."""
    low = kind.lower()
    row = next((g for g in GPUS if all(w in low for w in g[0])), None)
    if tflops and gbps:
        source = "flags"
    elif row:
        source = f"table: {row[1]}" + (" (one value from a flag)" if tflops or gbps else "")
    else:
        source = "flags (one value only)" if tflops or gbps else None
    return {"tflops": tflops or (row[2] if row else None), "hbm_gbps": gbps or (row[3] if row else None),
            "source": source}


def memory_stats() -> dict:
    """The device's allocator counters where it keeps them (GPUs do; CPUs return nothing)."""
    try:
        s = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 (a backend without the call)
        return {}
    return {k: int(s[k]) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit") if k in s}


def is_oom(err: BaseException) -> bool:
    s = str(err).lower()
    return "resource_exhausted" in s or "out of memory" in s or "oom" in s.split()


class Budget:
    """The run's deadline, split among what is left to run by weight when each part starts."""

    def __init__(self, total_s: float):
        self.end = time.perf_counter() + total_s

    def left(self) -> float:
        return self.end - time.perf_counter()

    def share(self, weight: float, weights_left: float, end: float | None = None) -> float:
        """A deadline for a part of weight `weight` among `weights_left`, inside `end` (default the run's)."""
        end = self.end if end is None else end
        now = time.perf_counter()
        return now + max(0.0, end - now) * weight / max(weights_left, 1e-9)


def repeat(fn, reps: int, deadline: float) -> dict:
    """fn() once (compile and warm-up), then timed calls until `reps` or `deadline` (at least one).

    fn returns a dict of seconds it timed itself (setup stays outside) and other numbers; the result
    has `first_call_s` (the warm-up's whole wall time), each key's list of timed values and its median."""
    t0 = time.perf_counter()
    first = fn()
    out = {"first_call_s": time.perf_counter() - t0, "first": first}
    runs = []
    while not runs or (len(runs) < reps and time.perf_counter() < deadline):
        runs.append(fn())
    for k in runs[0]:
        vals = [r[k] for r in runs]
        out[k + "_runs"] = vals
        out[k] = statistics.median(vals)
    out["reps"] = len(runs)
    return out


def guarded(name: str, fn, *args, progress: dict | None = None, **kw) -> dict:
    """fn(...)'s dict, or {"error", "oom"} when it raises: one case's failure must not stop the run.
    `progress`: a dict the case fills as it goes (e.g. its compiled memory plan), kept with an error."""
    t0 = time.perf_counter()
    try:
        out = fn(*args, **kw)
    except Exception as e:  # noqa: BLE001 (recorded and reported; the next case runs)
        msg = f"{type(e).__name__}: {e}"
        print(f"  {name}: FAILED ({'out of memory' if is_oom(e) else 'error'}): {msg.splitlines()[0][:300]}",
              flush=True)
        out = dict(progress or {}) | {"error": msg[:4000], "oom": is_oom(e)}
    out["case_s"] = time.perf_counter() - t0
    out["memory"] = memory_stats()
    gc.collect()  # the failed frames' arrays go now, before the next case allocates
    return out


def compiled_memory_gb(compiled) -> dict:
    """XLA's memory plan of a compiled program in GB (arguments, outputs, temporaries, outputs aliased
    to donated arguments), where the backend reports it: what an out-of-memory step needed."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 (a backend without the analysis)
        return {}
    if m is None:
        return {}
    names = ("argument", "output", "temp", "alias", "generated_code")
    return {k: round(getattr(m, f"{k}_size_in_bytes") / 1e9, 3) for k in names if hasattr(m, f"{k}_size_in_bytes")}


def random_params(cfg: ModelConfig):
    """(ModelDef, params) drawn on the default device by one jitted program, never on the host.

    They are drawn in float32 (the program the train state's init and the rollout's also run, so the
    compilation cache serves it to each) and cast to `cfg.param_dtype` by a second, small program."""
    mdef, _ = st.abstract_params(cfg)
    draw_cfg = cfg.replace(dtype="float32", param_dtype="float32")
    draw = jax.jit(lambda key: nnx.split(Qwen25VL(draw_cfg, rngs=nnx.Rngs(key)), nnx.Param, ...)[1])
    params = draw(jax.random.key(0))
    if cfg.param_dtype != "float32":
        dt = cfg.weight_dtype
        params = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(dt), p), donate_argnums=0)(params)
    return mdef, jax.block_until_ready(params)


# ----------------------------------------------------------------------------------- inference
def matmul_weights(cfg: ModelConfig) -> int:
    """Decoder weights that multiply each token (q, k, v, o and the SwiGLU MLP), all layers."""
    t = cfg.text
    d, f, n, k, h = t.hidden_size, t.intermediate_size, t.num_attention_heads, t.num_key_value_heads, t.head_dim
    return t.num_hidden_layers * (2 * d * n * h + 2 * d * k * h + 3 * d * f)


def prefill_cost(cfg: ModelConfig, batch: int, prompt: int, wbytes: int) -> tuple[float, float]:
    """(FLOPs, HBM bytes) of a text prefill with last-token logits: matmuls, causal attention (half of
    QK^T and PV), the output layer on one token per row; bytes: the weights once, the KV written."""
    t = cfg.text
    tok = batch * prompt
    fl = 2 * matmul_weights(cfg) * tok
    fl += 2 * 2 * batch * t.num_attention_heads * t.head_dim * prompt * prompt / 2 * t.num_hidden_layers
    fl += 2 * t.hidden_size * t.vocab_size * batch
    kv = 2 * t.num_hidden_layers * tok * t.num_key_value_heads * t.head_dim
    return float(fl), float(wbytes * (matmul_weights(cfg) + t.hidden_size * t.vocab_size + kv))


def decode_cost(cfg: ModelConfig, batch: int, ctx: float, wbytes: int) -> tuple[float, float]:
    """(FLOPs, HBM bytes) of one decode step over `ctx` valid context slots per row: every decoder
    weight and the output layer read once, the rows' embeddings, the KV cache of the context."""
    t = cfg.text
    d = t.hidden_size
    norms_biases = t.num_hidden_layers * (2 * d + (t.num_attention_heads + 2 * t.num_key_value_heads) * t.head_dim) + d
    weights = matmul_weights(cfg) + d * t.vocab_size + norms_biases + batch * d
    kv = 2 * t.num_hidden_layers * batch * ctx * t.num_key_value_heads * t.head_dim
    fl = 2 * (matmul_weights(cfg) + d * t.vocab_size) * batch
    fl += 2 * 2 * batch * t.num_attention_heads * t.head_dim * ctx * t.num_hidden_layers
    return float(fl), float(wbytes * (weights + kv))


def floor_s(fl: float, byt: float, peaks: dict) -> tuple[float | None, str | None]:
    """Roofline: max(FLOPs / peak, bytes / bandwidth), and which of the two binds."""
    if not (peaks["tflops"] and peaks["hbm_gbps"]):
        return None, None
    tc, tm = fl / (peaks["tflops"] * 1e12), byt / (peaks["hbm_gbps"] * 1e9)
    return max(tc, tm), ("compute" if tc >= tm else "memory")


def inference_case(model, cfg: ModelConfig, batch: int, sizes: Sizes, reps: int, deadline: float, peaks: dict) -> dict:
    p, n = sizes.prompt_len, sizes.decode_steps
    ids = np.random.default_rng(batch).integers(*text_ids(cfg), (batch, p)).astype(np.int32)

    def once():
        cache = jax.block_until_ready(model.init_cache(batch, p + n))
        t0 = time.perf_counter()
        logits, cache = extend_host(model, cache, ids, last_only=True)
        jax.block_until_ready(logits)
        t1 = time.perf_counter()
        tokens, cache, _ = greedy_decode(model, cache, logits, n)
        jax.block_until_ready(tokens)
        return {"prefill_s": t1 - t0, "decode_s": time.perf_counter() - t1}

    r = repeat(once, reps, deadline)
    wb = cfg.compute_dtype.itemsize
    out = {"batch": batch, "prompt_tokens": p, "new_tokens": n, "reps": r["reps"],
           "prefill_s": r["prefill_s"], "decode_s": r["decode_s"], "prefill_runs_s": r["prefill_s_runs"],
           "decode_runs_s": r["decode_s_runs"], "first_call_s": r["first_call_s"],
           "compile_s": r["first_call_s"] - r["prefill_s"] - r["decode_s"],
           "prefill_tok_s": batch * p / r["prefill_s"], "decode_tok_s": batch * n / r["decode_s"],
           "decode_ms_per_step": r["decode_s"] / n * 1e3}
    pf, pb = prefill_cost(cfg, batch, p, wb)
    df, db = decode_cost(cfg, batch, p + (n - 1) / 2, wb)
    fs, bound = floor_s(pf, pb, peaks)
    out.update(prefill_flops=pf, prefill_bytes=pb, prefill_bound=bound,
               prefill_floor_tok_s=fs and batch * p / fs, prefill_frac_of_floor=fs and fs / r["prefill_s"])
    fs, bound = floor_s(df, db, peaks)
    out.update(decode_step_flops=df, decode_step_bytes=db, decode_bound=bound,
               decode_floor_tok_s=fs and batch / fs, decode_frac_of_floor=fs and fs * n / r["decode_s"])
    return out


def run_inference(sizes: Sizes, reps: int, deadline: float, budget: Budget, peaks: dict) -> dict:
    cases = []
    n_cases = len(sizes.presets) * len(sizes.batches)
    for pi, name in enumerate(sizes.presets):
        cfg = preset_config(name).replace(dtype="bfloat16", param_dtype="bfloat16")
        base = {"preset": name, "params": num_params(cfg)}
        if pi and time.perf_counter() >= deadline:  # not even built: its cases are recorded as skipped
            cases += [base | {"batch": b, "skipped": "the section's time budget was spent"} for b in sizes.batches]
            continue
        holder = {}

        def build(cfg=cfg, holder=holder):
            mdef, params = random_params(cfg)
            holder["model"] = mdef.model(params)
            return {}

        print(f"inference {name}: building random bfloat16 weights", flush=True)
        made = guarded(f"{name} weights", build)
        for bi, b in enumerate(sizes.batches):
            done = pi * len(sizes.batches) + bi
            if "model" not in holder:
                cases.append(base | {"batch": b, "error": "the weights were not built: " + made.get("error", "")[:500],
                                     "oom": made.get("oom", False)})
                continue
            if bi and time.perf_counter() >= deadline:
                cases.append(base | {"batch": b, "skipped": "the section's time budget was spent"})
                continue
            case_end = budget.share(1, n_cases - done, end=deadline)
            print(f"inference {name} batch {b}", flush=True)
            cases.append(base | guarded(f"{name} b{b}", inference_case, holder["model"], cfg, b, sizes, reps,
                                        case_end, peaks))
        holder.clear()
        gc.collect()
    return {"cases": cases}


# ----------------------------------------------------------------------------------- update steps
def synthetic_batch(cfg: ModelConfig, rows: int, seq: int, side: int, rng) -> dict:
    """`rows` examples of `seq` tokens through `batching.collate`: eight text tokens, one image of
    side x side patches between its vision markers, text; the second half trained (assistant)."""
    v = cfg.vision
    grid = np.array([[1, side, side]], np.int64)
    units = side * side // v.merge_unit
    bucket = batching.Bucket(seq, units, batching.num_windows(grid, v))
    exs = []
    for r in range(rows):
        ids = rng.integers(*text_ids(cfg), seq).astype(np.int32)
        ids[8] = cfg.vision_start_token_id
        ids[9 : 9 + units] = cfg.image_token_id
        ids[9 + units] = cfg.vision_end_token_id
        trained = np.arange(seq) >= seq // 2
        pos, _ = rope.mrope_positions(ids[None], None, grid, image_token_id=cfg.image_token_id,
                                      spatial_merge_size=v.spatial_merge_size)
        pv = rng.standard_normal((side * side, v.patch_dim)).astype(np.float32)
        exs.append(batching.Example(ids, trained, pos[:, 0].astype(np.int32), pv, grid, bucket, 0, f"row{r}"))
    batch = batching.collate(exs, bucket, pad_id=0, vision_cfg=v)
    return {k: x for k, x in batch.items() if k in sft.BATCH_FIELDS}


def grpo_fields(batch: dict, max_turns: int, rng) -> dict:
    """The GRPO fields of `train/grpo.py` on an SFT batch: trained tokens split into two turns,
    random advantages; old_logprobs zero (the step takes its own; they feed only a metric)."""
    lm = batch["loss_mask"] > 0
    b, t = lm.shape
    turn = (np.cumsum(lm, axis=1) > lm.sum(axis=1, keepdims=True) // 2).astype(np.int32)
    return batch | {"old_logprobs": np.zeros((b, t), np.float32), "turn_ids": np.where(lm, turn, -1).astype(np.int32),
                    "a_seq": rng.standard_normal(b).astype(np.float32),
                    "a_turn": rng.standard_normal((b, max_turns)).astype(np.float32)}


def run_config(kind: str, preset: str):
    """The run config of `configs/<kind>.py` whose numerics and optimizer the step uses."""
    if kind == "sft":
        from configs import sft as conf
    else:
        from configs import grpo as conf
    return conf.get_config({"3b": "qwen25vl_3b", "7b": "qwen25vl_7b"}.get(preset, "tiny"))


def train_case(kind: str, sizes: Sizes, reps: int, deadline: float, peaks: dict, progress: dict) -> dict:
    rc = run_config(kind, sizes.train_preset)
    cfg = preset_config(sizes.train_preset).replace(dtype=rc.dtype, param_dtype=rc.param_dtype, remat=rc.remat,
                                                    attention="xla")
    tx, sched = optim.make_optimizer(rc.optim, int(rc.total_steps))
    mesh = shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    t0 = time.perf_counter()
    mdef, state, state_sh = st.create_train_state(cfg, tx, mesh, seed=0)
    jax.block_until_ready(state)
    init_s = progress["init_s"] = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    batch = synthetic_batch(cfg, sizes.train_batch, sizes.train_seq, sizes.image_side, rng)
    if kind == "grpo":
        batch = grpo_fields(batch, int(rc.rollout.max_turns), rng)
    bsh = sft.batch_shardings(batch, mesh)
    gb = {k: jax.device_put(x, bsh[k]) for k, x in batch.items()}
    if kind == "sft":
        step = sft.make_train_step(mdef, tx, sched, state_sh, bsh, mesh)
    else:
        step = grpo.make_grpo_step(mdef, tx, sched, GRPOLossConfig(), state_sh, bsh, mesh,
                                   temperature=float(rc.rollout.temperature), old_from_forward=True)
    key = jax.random.key(0)
    t0 = time.perf_counter()
    compiled = step.lower(state, gb, key).compile()  # ahead of the call: its memory plan is recorded first
    compile_s = progress["compile_s"] = time.perf_counter() - t0
    memory_gb = progress["compiled_memory_gb"] = compiled_memory_gb(compiled)
    print(f"  {kind}: compiled in {compile_s:.0f} s; memory plan (GB) {memory_gb}", flush=True)
    holder = [state]
    del state

    def once():
        t = time.perf_counter()
        holder[0], m = compiled(holder[0], gb, key)
        loss = float(m["loss"])  # waits for the step
        return {"step_s": time.perf_counter() - t, "loss": loss}

    r = repeat(once, reps, deadline)
    holder.clear()
    tokens = float(batch["attention_mask"].sum())
    patches = float((batch["unit_src"] >= 0).sum() * cfg.vision.merge_unit)
    model_flops = flops.train_flops(cfg, tokens, sizes.train_seq, patches)
    achieved = model_flops / r["step_s"]
    return {"preset": sizes.train_preset, "batch": sizes.train_batch, "seq": sizes.train_seq,
            "tokens": tokens, "trained_tokens": float(batch["loss_mask"].sum()), "image_patches": patches,
            "dtype": cfg.dtype, "param_dtype": cfg.param_dtype, "remat": cfg.remat, "init_s": init_s,
            "reps": r["reps"], "step_s": r["step_s"], "step_runs_s": r["step_s_runs"],
            "first_call_s": r["first_call_s"], "compile_s": compile_s, "compiled_memory_gb": memory_gb,
            "loss": r["loss"], "tokens_per_s": tokens / r["step_s"], "model_flops": model_flops,
            "model_tflops_per_s": achieved / 1e12,
            "mfu": achieved / (peaks["tflops"] * 1e12) if peaks["tflops"] else None}


# ----------------------------------------------------------------------------------- rollout


def rollout_case(sizes: Sizes, reps: int, deadline: float, fake_delay: float) -> dict:
    from PIL import Image

    from codedance_jax.processing import Processor, write_qwen25vl_processor_files
    from codedance_jax.rollout import RolloutConfig, RolloutEngine, SamplingConfig, rl_prompt

    fakes_dir = os.path.join(ROOT, "tests", "rollout")
    if fakes_dir not in sys.path:
        sys.path.insert(0, fakes_dir)
    from fakes import FakePool

    grc = run_config("grpo", sizes.rollout_preset)
    cfg = preset_config(sizes.rollout_preset).replace(dtype=grc.dtype, param_dtype=grc.param_dtype,
                                                      remat=grc.remat, attention="xla")
    px = sizes.rollout_image_px
    if sizes.rollout_preset in ("toy", "smoke"):
        proc_dir = toy_processor_dir()
    else:  # Qwen's tokenizer, its pixel budget cut to the prompt image
        proc_dir = tempfile.mkdtemp(prefix="gpu_bench_processor_")
        write_qwen25vl_processor_files(proc_dir, min_pixels=28 * 28 * 4, max_pixels=px * px)
    processor = Processor.from_pretrained(proc_dir)
    r = grc.rollout
    rows = sizes.rollout_prompts * sizes.rollout_group
    # One row bucket (batch_multiple = the rows, the preset's 8 at most): the call compiles each program
    # once, where 8 would compile decode and appends at 8, 16 and 32 rows, minutes at 3B on a GPU.
    rcfg = RolloutConfig.train(turn_format=r.turn_format, decode_chunk=int(r.decode_chunk),
                               batch_multiple=max(int(r.batch_multiple), rows),
                               append_min_frac=float(r.append_min_frac), obs_max_pixels=sizes.obs_image_px**2,
                               **sizes.rollout)
    t0 = time.perf_counter()
    mdef, params = random_params(cfg)
    init_s = time.perf_counter() - t0
    engine = RolloutEngine(mdef.model(params), processor, rcfg,
                           SamplingConfig(temperature=float(r.temperature), seed=0))
    rng = np.random.default_rng(0)
    prompts = [rl_prompt(processor, f"g{i}", f"What is in the corner? ({i})",
                         [Image.fromarray(rng.integers(0, 255, (px, px, 3), dtype=np.uint8))])
               for i in range(sizes.rollout_prompts)]
    cell = CELL.format(w=sizes.obs_image_px)
    cells = lambda row: min(row % 4, rcfg.max_turns - 1)
    script = lambda row, turn: cell if turn < cells(row) else None
    pool = FakePool(fake_delay)
    calls = [0]

    def once():
        calls[0] += 1
        _, s = engine.rollout(prompts, sizes.rollout_group, pool, script=script, seed_offset=1000 * calls[0])
        return {"wall_s": s.wall_s, "generated_tokens": float(s.generated_tokens), "prefill_s": s.prefill_s,
                "decode_s": s.decode_s, "append_s": s.append_s, "vision_s": s.vision_s,
                "device_wait_s": s.device_wait_s, "host_s": s.host_s, "decode_steps": float(s.decode_steps),
                "appends": float(s.appends), "executions": float(s.executions), "compiles": float(s.compiles),
                "trajectories": float(s.trajectories)}

    try:
        res = repeat(once, reps, deadline)
    finally:
        pool.close()
    runs = res["wall_s_runs"]
    gen = sum(res["generated_tokens_runs"])
    keep = ("prefill_s", "decode_s", "append_s", "vision_s", "device_wait_s", "host_s", "decode_steps", "appends",
            "executions")
    return {"preset": sizes.rollout_preset, "prompts": sizes.rollout_prompts, "group": sizes.rollout_group,
            "rows": rows, "dtype": cfg.dtype, "param_dtype": cfg.param_dtype,
            "config": dataclasses.asdict(rcfg), "fake_delay_s": fake_delay, "init_s": init_s, "reps": res["reps"],
            "first_call_s": res["first_call_s"], "first_call_compiles": res["first"]["compiles"],
            "wall_s": res["wall_s"], "wall_runs_s": runs, "generated_tokens": res["generated_tokens"],
            "gen_tok_s": gen / sum(runs), "trajectories_per_s": sum(res["trajectories_runs"]) / sum(runs),
            "compiles_in_timed_runs": sum(res["compiles_runs"])} | {k: res[k] for k in keep}


# ----------------------------------------------------------------------------------- report
def fmt(x, spec: str) -> str:
    """format(x, spec), or a dash as wide as the spec asks when there is no figure."""
    return format(x, spec) if x is not None else "-".rjust(int(re.match(r"\d*", spec).group() or 0))


def status(case: dict) -> str:
    return "OOM" if case.get("oom") else "ERROR" if "error" in case else "skipped"


def table_rows(result: dict) -> list[tuple]:
    """(measurement, value, unit, floor or peak, % of it, compile s) per printed line."""
    rows = []
    sec = result["sections"]
    for c in sec.get("inference", {}).get("cases", []):
        what = f"{c['preset']} b{c['batch']}"
        if "error" in c or "skipped" in c:
            rows.append((f"inference {what}", None, status(c), None, None, None))
            continue
        rows.append((f"prefill {what} x {c['prompt_tokens']}", c["prefill_tok_s"], "tok/s", c["prefill_floor_tok_s"],
                     c["prefill_frac_of_floor"], c["compile_s"]))
        rows.append((f"decode {what}, {c['new_tokens']} new", c["decode_tok_s"], "tok/s", c["decode_floor_tok_s"],
                     c["decode_frac_of_floor"], None))
    for kind in ("sft", "grpo"):
        c = sec.get(kind)
        if c is None:
            continue
        if "error" in c or "skipped" in c:
            rows.append((f"{kind} step", None, status(c), None, None, None))
            continue
        what = f"{kind} step {c['preset']} {c['batch']}x{c['seq']}"
        rows.append((what, c["step_s"], "s/step", None, None, c["compile_s"]))
        rows.append((f"  {kind} model FLOP/s (MFU)", c["model_tflops_per_s"], "TFLOP/s", result["peaks"]["tflops"],
                     c["mfu"], None))
    c = sec.get("rollout")
    if c is not None:
        if "error" in c or "skipped" in c:
            rows.append(("rollout", None, status(c), None, None, None))
        else:
            rows.append((f"rollout {c['preset']} {c['prompts']}x{c['group']} rows", c["gen_tok_s"], "gen tok/s", None,
                         None, c["first_call_s"] - c["wall_s"]))
    return rows


def print_table(result: dict):
    p = result["peaks"]
    print(f"\n{result['device_kind']} ({result['backend']}), peaks: {fmt(p['tflops'], '.4g')} TFLOP/s bf16, "
          f"{fmt(p['hbm_gbps'], '.4g')} GB/s ({p['source'] or 'unknown: pass --peak_tflops/--hbm_gbps'})")
    hdr = f"{'measurement':40s} {'value':>12s} {'unit':9s} {'floor/peak':>11s} {'% of it':>7s} {'compile s':>9s}"
    print(hdr + "\n" + "-" * len(hdr))
    for name, val, unit, ref, frac, comp in table_rows(result):
        print(f"{name:40s} {fmt(val, '12.4g')} {unit:9s} {fmt(ref, '11.4g')} {fmt(frac, '7.1%')} {fmt(comp, '9.1f')}")
    ro = result["sections"].get("rollout", {})
    if "gen_tok_s" in ro:
        print(f"rollout: {ro['wall_s']:.2f} s per call (decode {ro['decode_s']:.2f}, prefill {ro['prefill_s']:.2f}, "
              f"appends {ro['append_s']:.2f}, vision {ro['vision_s']:.2f}, sandbox wait {ro['device_wait_s']:.2f}, "
              f"host {ro['host_s']:.2f}); {ro['compiles_in_timed_runs']} compilations in the timed calls")
    print("floor: roofline time max(FLOPs / peak, bytes / HBM bandwidth) as tokens/s; '% of it' = floor time / "
          "measured time (MFU for the steps); compile s: the steps' compile ahead of their first call, else "
          "first call - median call")
    print(f"wall {result['wall_s']:.0f} s of a {result['budget_s']:.0f} s budget")


def default_out(kind: str, smoke: bool) -> str:
    name = re.sub(r"[^A-Za-z0-9]+", "_", kind).strip("_") or "unknown"
    day = datetime.date.today().isoformat()
    return os.path.join(HERE, "results", "gpu", f"{name}_{day}{'_smoke' if smoke else ''}.json")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="every section on a toy model (CPU, < 1 min)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma list of: " + ", ".join(SECTIONS))
    ap.add_argument("--presets", default=None,
                    help="inference models, comma list of " + ", ".join(PRESETS) + " (default 3b,7b)")
    ap.add_argument("--batches", default=None, help="inference batch sizes (default 1,32)")
    ap.add_argument("--prompt_len", type=int, default=None, help="inference prompt tokens (default 1024)")
    ap.add_argument("--decode_steps", type=int, default=None, help="greedy decode steps (default 256)")
    ap.add_argument("--train_batch", type=int, default=None, help="update-step rows (default 4)")
    ap.add_argument("--train_seq", type=int, default=None, help="update-step tokens per row (default 1024)")
    ap.add_argument("--rollout_prompts", type=int, default=None, help="rollout prompts (default 4)")
    ap.add_argument("--rollout_group", type=int, default=None, help="rollouts per prompt (default 8)")
    ap.add_argument("--fake_delay", type=float, default=0.05, help="seconds the fake sandbox takes per cell")
    ap.add_argument("--reps", type=int, default=None, help="timed calls per case at most (default 3; smoke 1)")
    ap.add_argument("--budget_s", type=float, default=420.0, help="the whole run's time budget")
    ap.add_argument("--min_start_s", type=float, default=30.0,
                    help="a section starts only with this much of the budget left (else it is recorded as skipped)")
    ap.add_argument("--peak_tflops", type=float, default=None, help="bf16 dense TFLOP/s of the device")
    ap.add_argument("--hbm_gbps", type=float, default=None, help="memory bandwidth of the device, GB/s")
    ap.add_argument("--no_compile_cache", action="store_true", help="leave the persistent compilation cache off")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/gpu/<device>_<date>.json)")
    return ap.parse_args(argv)


def resolve_sizes(a) -> Sizes:
    s = SMOKE if a.smoke else FULL
    over = {}
    if a.presets:
        over["presets"] = tuple(x.strip() for x in a.presets.split(",") if x.strip())
        unknown = [x for x in over["presets"] if x not in PRESETS]
        if unknown:
            raise SystemExit(f"--presets: unknown {unknown}; choose from {', '.join(PRESETS)}")
    if a.batches:
        over["batches"] = tuple(int(x) for x in a.batches.split(","))
    for k in ("prompt_len", "decode_steps", "train_batch", "train_seq", "rollout_prompts", "rollout_group"):
        if getattr(a, k) is not None:
            over[k] = getattr(a, k)
    return dataclasses.replace(s, **over)


def main(argv=None) -> dict:
    a = parse_args(argv)
    sections = [x.strip() for x in a.sections.split(",") if x.strip()]
    if bad := [x for x in sections if x not in SECTIONS]:
        raise SystemExit(f"--sections: unknown {bad}; choose from {', '.join(SECTIONS)}")
    sizes = resolve_sizes(a)
    reps = a.reps or (1 if a.smoke else 3)
    if not a.no_compile_cache:
        from codedance_jax import compile_cache

        compile_cache.enable()
    budget = Budget(a.budget_s)
    t_start = time.perf_counter()
    dev = jax.devices()[0]
    kind = dev.device_kind
    peaks = device_peaks(kind, a.peak_tflops, a.hbm_gbps)
    print(f"device {kind} ({jax.default_backend()}, {jax.device_count()} devices), jax {jax.__version__}; "
          f"peaks {peaks}; budget {a.budget_s:.0f} s; sections {sections}", flush=True)
    result = {"command": " ".join(["python", "benchmarks/gpu.py", *(sys.argv[1:] if argv is None else argv)]),
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "device_kind": kind,
              "backend": jax.default_backend(), "device_count": jax.device_count(), "host": platform.node(),
              "jax": jax.__version__, "smoke": a.smoke, "peaks": peaks, "budget_s": a.budget_s, "reps": reps,
              "sizes": dataclasses.asdict(sizes), "sections": {}}
    for i, name in enumerate(sections):
        weights_left = sum(WEIGHTS[s] for s in sections[i:])
        deadline = budget.share(WEIGHTS[name], weights_left)
        t0 = time.perf_counter()
        if i and budget.left() < a.min_start_s:
            result["sections"][name] = {"skipped": f"{max(budget.left(), 0):.0f} s of the run's budget left"}
        elif name == "inference":
            result["sections"][name] = run_inference(sizes, reps, deadline, budget, peaks)
        elif name in ("sft", "grpo"):
            print(f"{name} step at {sizes.train_preset}", flush=True)
            progress = {}
            result["sections"][name] = guarded(name, train_case, name, sizes, reps, deadline, peaks, progress,
                                               progress=progress)
        else:
            print(f"rollout at {sizes.rollout_preset}", flush=True)
            result["sections"][name] = guarded(name, rollout_case, sizes, reps, deadline, a.fake_delay)
        result["sections"][name]["section_s"] = time.perf_counter() - t0
        print(f"{name}: {time.perf_counter() - t0:.0f} s (run {time.perf_counter() - t_start:.0f} s)", flush=True)
    result["wall_s"] = time.perf_counter() - t_start
    print_table(result)
    out = a.out or default_out(kind, a.smoke)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1, default=_json_default)
    print(f"wrote {out}")
    return result


def _json_default(x):
    return x.item() if isinstance(x, np.generic) else str(x)


if __name__ == "__main__":
    main()
