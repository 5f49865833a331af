"""The launchers' persistent compilation cache: where it goes, and that a compiled step lands there."""

import os
import subprocess
import sys

from codedance_jax import compile_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cache_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("CODEDANCE_COMPILATION_CACHE", str(tmp_path / "c"))
    assert compile_cache.cache_dir() == str(tmp_path / "c")
    monkeypatch.setenv("CODEDANCE_COMPILATION_CACHE", "off")
    assert compile_cache.cache_dir() is None
    monkeypatch.delenv("CODEDANCE_COMPILATION_CACHE")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "j"))
    assert compile_cache.cache_dir() == str(tmp_path / "j")
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert compile_cache.cache_dir() == str(tmp_path / ".cache" / "codedance_jax" / "xla")


def test_a_compiled_function_is_written_and_reused(tmp_path):
    code = ("from codedance_jax import compile_cache; d = compile_cache.enable(); import jax, jax.numpy as jnp; "
            "print(float(jax.jit(lambda x: jnp.sin(x) * 3 + x.sum())(jnp.arange(7.0)).sum()))")
    env = {**os.environ, "CODEDANCE_COMPILATION_CACHE": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    outs = [subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
            for _ in range(2)]
    entries = os.listdir(tmp_path)
    assert entries, "no cache entry written"
    assert outs[0].stdout == outs[1].stdout
    assert sorted(os.listdir(tmp_path)) == sorted(entries)  # the second run hit, wrote nothing new
