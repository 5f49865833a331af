"""Fixtures for the toy-world tests: one sandbox pool and one tiny generated world per session."""

import os
import sys

import pytest

# `data` and `sandbox` are top-level packages of the repository (not installed).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from toyworld_sizes import KNOBS, TINY  # a module of its own: "from conftest import" is ambiguous across test dirs


@pytest.fixture(scope="session")
def pool():
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("the sandbox needs Linux and root")
    from sandbox import SandboxPool

    with SandboxPool(num_workers=2, timeout_s=20.0, memory_mb=512) as p:
        yield p


@pytest.fixture(scope="session")
def world(pool, tmp_path_factory):
    """(directory, world.json) of a tiny world (half its SFT items hard, some with recovered errors,
    about half its easy SFT items solved with code)."""
    from data.toyworld import generate_world

    d = tmp_path_factory.mktemp("world")
    info = generate_world(d, pool=pool, **KNOBS, **TINY)
    return str(d), info


@pytest.fixture(scope="session")
def toy_processor(world):
    from codedance_jax.processing import Processor

    return Processor.from_pretrained(os.path.join(world[0], "processor"))
