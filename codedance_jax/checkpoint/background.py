"""Policy exports written from a thread while the GRPO loop goes on.

The demo's GRPO run exports its sampling policy (`orbax_io` format, with the processor) every
`trajectories_every` steps so that each trajectory names the weights that sampled it. On the toy
model an export took 0.4-0.8 s of orbax and tokenizer file writes (more under load), every second
step of the demo, inside the step. The parameters are copied to host memory first (milliseconds
at that size: the update donates the device arrays right after), then written by one worker
thread.

- At most one export is in flight: `submit` waits for the previous one, so host memory holds one
  copy and exports land in step order.
- A failed export is raised at the next `submit` or at `close`, naming the directory: it is never
  dropped. An interrupted one leaves no `codedance.json` marker, so no loader takes it as whole.
- With several processes the save is collective (orbax) and runs in the caller, as before.
"""

from __future__ import annotations

import threading

import jax
import numpy as np
from flax import nnx

from codedance_jax.checkpoint import orbax_io
from codedance_jax.errors import CheckpointError


class BackgroundExport:
    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: tuple[str, BaseException] | None = None

    def submit(self, model, out_dir, processor=None) -> None:
        self.wait()
        if jax.process_count() > 1:
            orbax_io.save(model, out_dir, processor)
            return
        host = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
        cfg = model.cfg

        def write():
            try:
                orbax_io.save_params(cfg, host, out_dir, processor)
            except BaseException as e:  # raised in the caller's thread by the next wait()
                self._error = (str(out_dir), e)

        self._thread = threading.Thread(target=write, name=f"export {out_dir}", daemon=False)
        self._thread.start()

    def wait(self) -> None:
        """Blocks until the export in flight is written; raises its error, if any."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            where, e = self._error
            self._error = None
            raise CheckpointError(f"{where}: the background policy export failed: {e!r}") from e

    def close(self) -> None:
        self.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.close()
        elif self._thread is not None:  # already failing: finish the write, keep the first error
            self._thread.join()
