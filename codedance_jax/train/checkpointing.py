"""Run checkpoints: orbax CheckpointManager with async saves, keep-N, and preemption handling.

A checkpoint holds the whole `TrainState` (params, optimizer moments, step, rng) and the data
iterator's state as JSON, so a resumed run continues exactly: the same next batch, the same
random stream. Restoring passes abstract arrays with their shardings; every device reads only
its shards. On SIGTERM (what TPU/GKE/SLURM send before preemption) or when orbax reports a
preemption sync point, the loop saves at the current step and stops cleanly.

A disk that fills during a save is a `DiskFullError` (one line: the directory, the step that was
not written, the fix), raised by whichever call meets orbax's failure (`save`, `wait`, `close`).
Orbax writes a step into `<step>.orbax-checkpoint-tmp` and renames it only when complete, so the
last complete checkpoint is untouched (the partial directory is removed), and the next run resumes
from it. The tracebacks orbax logs from each of its writer threads for that failure are cut to
their message. A resume checks the step's files first (`orbax_io.check_params`): a missing or
truncated one is a `CheckpointError` naming it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import signal
import threading

import jax
import orbax.checkpoint as ocp
from absl import logging as absl_logging

from codedance_jax.checkpoint import orbax_io
from codedance_jax.errors import DiskFullError, disk_full

# Replica-parallel saving (orbax's default off GPU) has each replica of a replicated array write a
# slice of it, and cuts that slice with an eager `lax.slice_in_dim`: one XLA compile per array
# shape. For the small arrays of a model (norms, biases, a toy model's every weight) that cost
# dominates: a toy GRPO state on 8 CPU devices compiled 152 slices (6.8 s) in its first save,
# which took 8.3 s against 1.2 s for the next. Slices under this size are written whole by one
# replica instead; large arrays on a pod still split their writes over replicas.
MIN_REPLICA_SLICE_BYTES = 1 << 20


@functools.cache  # once per process
def _register_array_handler() -> None:
    verbosity = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)  # orbax warns that it replaces its default handler
    try:
        ocp.type_handlers.register_type_handler(
            jax.Array, ocp.type_handlers.ArrayHandler(min_slice_bytes_for_replica_parallel=MIN_REPLICA_SLICE_BYTES),
            override=True)
    finally:
        absl_logging.set_verbosity(verbosity)


class _DiskFullTracebacks(logging.Filter):
    """Orbax logs a full disk once per writer thread, each with a traceback: keep the message."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and disk_full(record.exc_info[1]):
            record.exc_info, record.exc_text = None, None
        return True


@functools.cache  # once per process
def _quiet_disk_full_logs() -> None:
    logging.getLogger("absl").addFilter(_DiskFullTracebacks())


class Checkpointer:
    def __init__(self, workdir: str, *, keep: int = 3, every_steps: int = 100, async_save: bool = True):
        _register_array_handler()
        _quiet_disk_full_logs()
        self.dir = os.path.join(os.path.abspath(workdir), "checkpoints")
        opts = ocp.CheckpointManagerOptions(
            max_to_keep=keep, save_interval_steps=every_steps, enable_async_checkpointing=async_save, create=True,
        )
        self.mngr = ocp.CheckpointManager(self.dir, options=opts, item_names=("state", "data"))
        self._preempted = threading.Event()
        self._old_handler = None
        self._saving: int | None = None  # the step of the save in flight

    # ------------------------------------------------------------ preemption
    def install_signal_handler(self):
        """SIGTERM sets a flag; the loop checks `should_stop` after each step."""
        if threading.current_thread() is not threading.main_thread():
            return
        self._old_handler = signal.signal(signal.SIGTERM, lambda *_: self._preempted.set())

    def should_stop(self, step: int) -> bool:
        return self._preempted.is_set() or self.mngr.reached_preemption(step)

    # ------------------------------------------------------------ save/restore
    def save(self, step: int, state, data_state: dict | None, *, force: bool = False) -> bool:
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state or {}))
        with self._disk_full_is_user_error(step):  # the failure of the previous save surfaces here too
            saved = self.mngr.save(step, args=args, force=force)
        if saved:
            self._saving = step
        return saved

    @contextlib.contextmanager
    def _disk_full_is_user_error(self, step: int | None = None):
        try:
            yield
        except Exception as e:  # noqa: BLE001 -- a full disk becomes a user error; anything else is re-raised
            if not disk_full(e):
                raise
            failed = self._saving if self._saving is not None else step
            self._saving = None
            if jax.process_count() == 1:  # the partial step: its writers are done; it only holds space now
                for name in os.listdir(self.dir):
                    if name.startswith(f"{failed}.orbax-checkpoint-tmp"):
                        shutil.rmtree(os.path.join(self.dir, name), ignore_errors=True)
            last = self._last_complete()
            kept = f"the last complete one (step {last}) is intact" if last is not None else "no earlier checkpoint exists"
            raise DiskFullError(f"{self.dir}: the disk is full: the checkpoint of step {failed} was not written; {kept}",
                                "free disk space (or choose another workdir), then re-run the same command: it "
                                "resumes from the last complete checkpoint") from e

    def _last_complete(self) -> int | None:
        steps = [int(n) for n in os.listdir(self.dir) if n.isdigit()] if os.path.isdir(self.dir) else []
        return max(steps, default=None)

    def latest_step(self) -> int | None:
        return self.mngr.latest_step()

    def restore(self, abstract_state, step: int | None = None):
        """(step, state, data_state) from the latest (or given) checkpoint, or None when there is none."""
        step = self.mngr.latest_step() if step is None else step
        if step is None:
            return None
        state_dir = os.path.join(self.dir, str(step), "state")
        if os.path.isdir(state_dir):  # a missing or truncated file: one line naming it, before orbax reads
            orbax_io.check_params(state_dir, f"the checkpoint of step {step} is incomplete or damaged: move "
                                             f"{os.path.dirname(state_dir)} away to resume from the one before it")
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), abstract_state)
        out = self.mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()))
        return step, out["state"], out["data"]

    def wait(self):
        with self._disk_full_is_user_error():
            self.mngr.wait_until_finished()
        self._saving = None

    def close(self):
        self.wait()
        self.mngr.close()
        if self._old_handler is not None:
            signal.signal(signal.SIGTERM, self._old_handler)


def encode_data_state(state) -> dict:
    """Grain iterator states are bytes; JSON wants text."""
    if isinstance(state, bytes):
        return {"kind": "bytes", "value": state.decode("utf-8")}
    return {"kind": "json", "value": json.loads(json.dumps(state))}


def decode_data_state(d: dict):
    if not d:
        return None
    return d["value"].encode("utf-8") if d.get("kind") == "bytes" else d["value"]
