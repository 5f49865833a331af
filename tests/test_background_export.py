"""checkpoint.background: a policy export written from a thread equals the synchronous one, lands
whole before `wait` returns, and a failed write is raised, naming the directory (never dropped)."""

import os
import threading

import jax
import numpy as np
import pytest
from flax import nnx
from model_helpers import tiny_small_vocab

from codedance_jax.checkpoint import orbax_io
from codedance_jax.checkpoint.background import BackgroundExport
from codedance_jax.errors import CheckpointError
from codedance_jax.model.qwen25vl import Qwen25VL


def _params(model):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def test_background_export_writes_the_submitted_weights_in_order_and_raises_failures(tmp_path, monkeypatch):
    # The writer starts only when the test says so, so the caller has moved on (deleted the arrays)
    # before the write begins: the race the loop runs every time, made deterministic.
    go, real = threading.Event(), orbax_io.save_params
    monkeypatch.setattr(orbax_io, "save_params", lambda *a, **k: (go.wait(60), real(*a, **k)))
    cfg = tiny_small_vocab(vocab=1024)
    seed = jax.random.key(int(np.random.default_rng().integers(1 << 30)))
    model = nnx.jit(lambda k: Qwen25VL(cfg, rngs=nnx.Rngs(params=k)))(seed)  # one compile, fresh weights
    before = _params(model)
    with BackgroundExport() as ex:
        ex.submit(model, tmp_path / "a")
        # The caller goes on: the update donates the arrays (deleted here) and replaces them. The
        # export holds a host copy of the submitted ones.
        old = nnx.state(model, nnx.Param)
        new = jax.tree.map(lambda x: x + 1.0, old)
        for x in jax.tree.leaves(old):
            x.delete()
        nnx.update(model, new)
        go.set()
        ex.submit(model, tmp_path / "b")  # waits for "a" first
    for name, want in (("a", before), ("b", _params(model))):
        assert orbax_io.is_orbax_dir(tmp_path / name)
        got = _params(orbax_io.load(tmp_path / name))
        diffs = jax.tree.map(lambda x, y: float(np.max(np.abs(x - y))), got, want)
        assert max(jax.tree.leaves(diffs)) == 0.0, name

    (tmp_path / "file").write_text("not a directory")
    ex = BackgroundExport()
    ex.submit(model, tmp_path / "file" / "c")  # makedirs under a file fails in the thread
    with pytest.raises(CheckpointError, match=r"file/c: the background policy export failed"):
        ex.wait()
    ex.close()  # the error was raised once; nothing left in flight
    assert not os.path.exists(tmp_path / "file" / "c")
