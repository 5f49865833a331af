"""Fixtures for the data tests: a real Qwen processor with small images, and the tiny model config."""

import os
import sys

import pytest

# `data` is a top-level package of the repository (not installed), as `sandbox` is.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

MAX_PIXELS = 112 * 112  # at most 8x8 patches -> 16 image tokens: fast, still several windows


@pytest.fixture(scope="session")
def processor(tmp_path_factory):
    from codedance_jax.processing import Processor, write_qwen25vl_processor_files

    d = write_qwen25vl_processor_files(tmp_path_factory.mktemp("proc"), max_pixels=MAX_PIXELS)
    return Processor.from_pretrained(d)


@pytest.fixture(scope="session")
def model_cfg():
    from codedance_jax.model.config import ModelConfig

    return ModelConfig.tiny()
