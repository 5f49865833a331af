"""Fixtures for rollout tests: the tiny model (from the shared reference pair) and a real Qwen processor."""

import pytest


@pytest.fixture(scope="session")
def processor(tmp_path_factory):
    from codedance_jax.processing import Processor, write_qwen25vl_processor_files

    d = tmp_path_factory.mktemp("qwen_processor")
    write_qwen25vl_processor_files(d, min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)
    return Processor.from_pretrained(d)


@pytest.fixture(scope="session")
def model(tiny_pair):
    return tiny_pair[1]
