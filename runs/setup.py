"""What the SFT and GRPO runs share: model resolution, initial weights, the sharded train state,
the checkpointer (restored), the metric writer and the jit cache per batch shape.

    run = open_run(config, workdir, cfg, mesh, rules, tx, params=initial_params(config, mesh, rules))
    try:
        ...  # run.state, run.steps.get(key, build), run.writer.write(...), run.ckpt.save(...)
    finally:
        run.close()

`open_run` restores the latest checkpoint of `workdir` (the state and the data iterator's JSON
state) and installs the SIGTERM handler; `close` waits for pending saves and closes the files, so
a run that raises still leaves its last checkpoint whole.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from codedance_jax import sharding as shd
from codedance_jax.errors import ConfigError
from codedance_jax.model import flash
from codedance_jax.model.config import ModelConfig
from codedance_jax.train import checkpointing
from codedance_jax.train import state as st
from codedance_jax.train.metrics import MetricWriter, Progress

log = logging.getLogger(__name__)

PRESETS = {"tiny": ModelConfig.tiny, "qwen25vl_3b": ModelConfig.qwen25vl_3b, "qwen25vl_7b": ModelConfig.qwen25vl_7b}


def sharding_rules(config) -> tuple | None:
    """config.sharding_rules as tuples; None = codedance_jax.sharding.DEFAULT_RULES."""
    return tuple(tuple(r) for r in config.sharding_rules) if config.sharding_rules else None


def make_mesh(config):
    return shd.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)


def model_config(config, processor_dir: str | None = None) -> ModelConfig:
    """The model of a run: the checkpoint's (`init_from`), the toy world's (sized by its tokenizer in
    `processor_dir`, default `config.processor_dir`) or a preset; dtypes and remat from the config."""
    if config.init_from:
        cfg = ModelConfig.from_hf_config(config.init_from)
    elif config.model == "toy":  # the toy world's ~1M-parameter model, sized by its tokenizer
        from data.toyworld import toy_model_config

        processor_dir = processor_dir or config.processor_dir
        if not processor_dir:
            raise ConfigError("config.model='toy' needs config.processor_dir: the toy world's processor/ directory")
        cfg = toy_model_config(processor_dir)
    elif config.model in PRESETS:
        cfg = PRESETS[config.model]()
    else:
        raise ConfigError(f"config.model={config.model!r}: choose one of {sorted(PRESETS)} or 'toy', "
                          "or set config.init_from to a checkpoint.")
    return cfg.replace(dtype=config.dtype, param_dtype=config.param_dtype, remat=config.remat,
                       attention=flash.resolve(config.get("attention", "auto")))


def initial_params(config, mesh, rules):
    """The parameters of `config.init_from` on the mesh, or None (random init)."""
    if not config.init_from:
        return None
    from flax import nnx

    import codedance_jax

    model, _ = codedance_jax.from_pretrained(config.init_from, dtype=config.param_dtype, mesh=mesh, rules=rules,
                                             processor=False, sharding_tolerance=config.sharding_tolerance)
    _, params, _ = nnx.split(model, nnx.Param, ...)
    return params


def on_process_zero(name: str, fn: Callable[[], Any]) -> None:
    """Run `fn` on process 0 (shared files), then every process waits at the barrier `name`."""
    if jax.process_index() == 0:
        fn()
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def batch_key(batch: dict, fields=None) -> tuple:
    """The shapes of a batch (of `fields`, default all): one compiled step per key."""
    return tuple((k, v.shape) for k, v in sorted(batch.items()) if fields is None or k in fields)


@functools.lru_cache(maxsize=8)
def _key_maker(mesh):
    from jax.sharding import NamedSharding, PartitionSpec

    return jax.jit(jax.random.key, out_shardings=NamedSharding(mesh, PartitionSpec()))


def replicated_key(seed: int, mesh):
    """The PRNG key of `seed`, replicated over `mesh` and made on device by every process (a
    `device_put` of a host key cannot reach other processes' devices); one compiled program for
    every seed, so the step functions compiled ahead of time take it as the loop passes it."""
    return _key_maker(mesh)(np.uint32(seed))


class StepCache:
    """Jitted functions per batch shape (bucket): `get(key, build)` compiles a shape once."""

    def __init__(self):
        self._fns: dict = {}

    def get(self, key, build: Callable[[], Callable]) -> Callable:
        if key not in self._fns:
            self._fns[key] = build()
        return self._fns[key]

    def put(self, key, fn: Callable) -> None:
        """A function compiled ahead (a shape plan's): `get(key, ...)` returns it."""
        self._fns[key] = fn

    def __len__(self) -> int:
        return len(self._fns)


@dataclasses.dataclass
class Run:
    """The impure parts of a training run, opened by `open_run` and closed by `close`."""

    mdef: st.ModelDef
    state: st.TrainState
    state_sh: Any  # the state's shardings
    ckpt: checkpointing.Checkpointer
    writer: MetricWriter
    data_state: Any  # the restored data iterator state (None when starting fresh)
    start: int  # the first step to run
    progress: Progress
    initial_params: Any = None  # a copy of the parameters before the restore (keep_initial=True)
    steps: StepCache = dataclasses.field(default_factory=StepCache)

    def close(self) -> None:
        self.ckpt.close()
        self.writer.close()


def open_run(config, workdir: str, cfg: ModelConfig, mesh, rules, tx, *, params=None, keep_initial: bool = False) -> Run:
    """Train state on the mesh (from `params` or random init), restored from `workdir`'s latest
    checkpoint when there is one; the checkpointer (SIGTERM saves and stops) and the metric writer.
    `keep_initial`: also keep a copy of the parameters as created, before any restore (a frozen
    reference policy)."""
    mdef, state, state_sh = st.create_train_state(cfg, tx, mesh, seed=config.seed, rules=rules, params=params,
                                                  sharding_tolerance=config.sharding_tolerance)
    initial = jax.tree.map(lambda x: x.copy(), state.params) if keep_initial else None
    ckpt = checkpointing.Checkpointer(workdir, keep=config.checkpoint.keep, every_steps=config.checkpoint.every_steps,
                                      async_save=config.checkpoint.async_save)
    ckpt.install_signal_handler()
    data_state = None
    restored = ckpt.restore(state)
    if restored is not None:
        step0, state, data_state = restored
        log.info("resumed from step %d", step0)
    start = int(state.step)
    writer = MetricWriter(workdir, tensorboard=config.tensorboard, start=start)
    return Run(mdef, state, state_sh, ckpt, writer, data_state, start, Progress(config.total_steps, start), initial)
