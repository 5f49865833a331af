"""Checkpoints that arrive broken, and a disk that fills during a save (issue 38).

Every loader fails in one line: a truncated weights file, a Git LFS pointer in place of the
weights, a config.json that is not JSON, a symlink loop, an orbax checkpoint with a missing or
truncated parameter file each raise a `UserError` that names the file and the fix, which every
launcher prints as one line with status 2 (`launch.runner`; two of them run here through
`launch.convert`). A full disk during a checkpoint save is a `DiskFullError` that names the step
and leaves the last complete checkpoint, which a new run restores.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from launch_env import launcher_env

import codedance_jax
from codedance_jax.errors import CheckpointError, MissingPathError, UserError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LFS_POINTER = ("version https://git-lfs.github.com/spec/v1\n"
               "oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\nsize 79294064\n")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A random toy-sized Qwen2.5-VL as a Hugging Face directory and as a converted (orbax) one,
    each with the real Qwen processor files."""
    from flax import nnx

    from codedance_jax.checkpoint import hf, orbax_io
    from codedance_jax.model.config import ModelConfig
    from codedance_jax.model.qwen25vl import Qwen25VL
    from codedance_jax.processing import write_qwen25vl_processor_files

    special = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|endoftext|>", "<|im_end|>")
    cfg = ModelConfig.toy(1024, {t: 1000 + i for i, t in enumerate(special)})
    model = Qwen25VL(cfg, rngs=nnx.Rngs(0))
    d = tmp_path_factory.mktemp("ckpts")
    hf_dir, orbax_dir = str(d / "hf"), str(d / "orbax")
    hf.export_hf(model, hf_dir)
    orbax_io.save(model, orbax_dir)
    for out in (hf_dir, orbax_dir):
        write_qwen25vl_processor_files(out)
    return {"hf": hf_dir, "orbax": orbax_dir}


def _copy(src: str, dst: str) -> str:
    shutil.copytree(src, dst, copy_function=os.link)  # hard links: break them before changing a file
    return dst


def _own(path: str) -> str:
    """`path` as a file of its own (no longer a hard link shared with the source checkpoint)."""
    data = open(path, "rb").read()
    os.remove(path)
    with open(path, "wb") as f:
        f.write(data)
    return path


def _largest_param_file(d: str) -> str:
    files = [os.path.join(r, n) for r, _, ns in os.walk(os.path.join(d, "params")) for n in ns]
    return max(files, key=os.path.getsize)


def truncated_weights(c, d):
    d = _copy(c["hf"], d)
    p = _own(os.path.join(d, "model.safetensors"))
    os.truncate(p, os.path.getsize(p) // 2)
    return d, p, "truncated"


def lfs_pointer_weights(c, d):
    d = _copy(c["hf"], d)
    p = os.path.join(d, "model.safetensors")
    os.remove(p)
    with open(p, "w") as f:
        f.write(LFS_POINTER)
    return d, p, "a Git LFS pointer file"


def config_not_json(c, d):
    d = _copy(c["hf"], d)
    p = _own(os.path.join(d, "config.json"))
    with open(p, "a") as f:
        f.write("}, oops")
    return d, p, "not valid JSON (Extra data at line"


def config_symlink_loop(c, d):
    d = _copy(c["hf"], d)
    p = os.path.join(d, "config.json")
    os.remove(p)
    os.symlink("config.json", p)
    return d, p, "a symbolic link loop"


def weights_symlink_loop(c, d):
    d = _copy(c["hf"], d)
    p = os.path.join(d, "model.safetensors")
    os.remove(p)
    os.symlink("model.safetensors", p)
    return d, p, "a symbolic link loop"


def orbax_missing_param_file(c, d):
    d = _copy(c["orbax"], d)
    p = _largest_param_file(d)
    os.remove(p)
    return d, p, "missing"


def orbax_truncated_param_file(c, d):
    d = _copy(c["orbax"], d)
    p = _own(_largest_param_file(d))
    os.truncate(p, os.path.getsize(p) // 2)  # a copy that stopped half-way
    return d, p, "truncated"


BREAKS = [truncated_weights, lfs_pointer_weights, config_not_json, config_symlink_loop, weights_symlink_loop,
          orbax_missing_param_file, orbax_truncated_param_file]


@pytest.mark.parametrize("brk", BREAKS, ids=[b.__name__ for b in BREAKS])
def test_a_broken_checkpoint_is_one_user_error_naming_the_file(ckpts, tmp_path, brk):
    d, culprit, what = brk(ckpts, str(tmp_path / "ckpt"))
    with pytest.raises(UserError) as e:
        codedance_jax.from_pretrained(d)
    assert isinstance(e.value, (CheckpointError, MissingPathError))
    assert e.value.message.startswith(f"{culprit}: ") and what in e.value.message, e.value.message
    assert "\n" not in e.value.message and e.value.fix


def test_a_launcher_says_it_in_one_line_with_status_2(ckpts, tmp_path):
    env = launcher_env(JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
    runs = []
    for brk in (lfs_pointer_weights, orbax_truncated_param_file):  # both at once
        d, culprit, _ = brk(ckpts, str(tmp_path / brk.__name__))
        out = tmp_path / f"{brk.__name__}_out"
        runs.append((culprit, out, subprocess.Popen(
            [sys.executable, "-m", "launch.convert", f"--src={d}", f"--dst={out}"], cwd=REPO, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    # The server loads through the same path (before it binds a port).
    d, culprit, _ = config_not_json(ckpts, str(tmp_path / "serve"))
    serve = subprocess.Popen([sys.executable, "-m", "launch.serve", f"--checkpoint={d}", "--port=0"], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for culprit_, out, proc in runs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        assert f"launch.convert: error: {culprit_}: " in err and "  fix: " in err
        assert not os.path.exists(out)
    _, err = serve.communicate(timeout=300)
    assert serve.returncode == 2 and "Traceback" not in err, err[-3000:]
    assert f"launch.serve: error: {culprit}: " in err and "  fix: " in err, err[-3000:]


# ---- a full disk during a checkpoint save ------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs: room for one checkpoint of `_state()`, not two."""
    path = tmp_path / "disk"
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield str(path)
    subprocess.run(["umount", "-l", str(path)], check=True)


def _state(rng):
    # ~2 MiB of float32 that zstd cannot shrink: one checkpoint fits in 3 MiB, two do not
    return {f"w{i}": jax.numpy.asarray(rng.standard_normal((64, 256), dtype=np.float32)) for i in range(32)}


def test_a_full_disk_during_a_save_is_one_user_error_and_keeps_the_last_checkpoint(small_disk, caplog):
    from codedance_jax.train.checkpointing import Checkpointer

    rng = np.random.default_rng()
    first, second = _state(rng), _state(rng)
    ckpt = Checkpointer(os.path.join(small_disk, "wd"), keep=3, every_steps=1)
    assert ckpt.save(1, first, {"pos": 1})
    ckpt.wait()
    with pytest.raises(UserError) as e:
        ckpt.save(2, second, {"pos": 2})
        ckpt.wait()
    assert type(e.value).__name__ == "DiskFullError" and isinstance(e.value, OSError) and "\n" not in e.value.message
    assert e.value.message == (f"{ckpt.dir}: the disk is full: the checkpoint of step 2 was not written; "
                               "the last complete one (step 1) is intact")
    assert "re-run the same command" in e.value.fix
    assert os.listdir(ckpt.dir) == ["1"]  # the partial step is gone: its space is free again
    # orbax's own reports of the failure keep their message, without a traceback each
    logged = [r for r in caplog.records if "No space left on device" in r.getMessage()]
    assert logged and all(r.exc_info is None for r in logged)
    step, state, data = Checkpointer(os.path.join(small_disk, "wd"), keep=3, every_steps=1).restore(first)
    assert step == 1 and data == {"pos": 1}
    for k in first:
        np.testing.assert_array_equal(np.asarray(state[k]), np.asarray(first[k]))


def test_a_resume_from_a_truncated_run_checkpoint_names_the_file(tmp_path):
    from codedance_jax.train.checkpointing import Checkpointer

    state = _state(np.random.default_rng())
    ckpt = Checkpointer(str(tmp_path / "wd"), keep=3, every_steps=1)
    ckpt.save(1, state, {"pos": 1})
    ckpt.close()
    step_dir = os.path.join(ckpt.dir, "1")
    files = [os.path.join(r, n) for r, _, ns in os.walk(os.path.join(step_dir, "state")) for n in ns]
    p = max(files, key=os.path.getsize)
    os.truncate(p, os.path.getsize(p) // 2)
    with pytest.raises(UserError) as e:
        Checkpointer(str(tmp_path / "wd"), keep=3, every_steps=1).restore(state)
    assert e.value.message.startswith(f"{p}: truncated: ") and f"move {step_dir} away" in e.value.fix
