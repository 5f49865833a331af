"""Fixtures of the serving tests: one real `launch.serve` process over the tiny random checkpoint, shared
by the session's serving and judge tests."""

import pytest
from serve_helpers import ServerProcess, write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("serve_ckpt")))


@pytest.fixture(scope="session")
def server(tiny_ckpt):
    s = ServerProcess(tiny_ckpt)
    yield s
    s.close()


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=300, max_retries=0)

