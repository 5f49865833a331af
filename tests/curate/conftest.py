"""Fixtures of the curation tests: a sandbox pool, the toy items, the scripted stand-in server and
a scripted config (every role on the scripted server, the weak role its `*-weak` persona)."""

import pytest

from configs.curate import get_config


@pytest.fixture(scope="session")
def pool():
    from sandbox import SandboxPool

    with SandboxPool(num_workers=2, timeout_s=20.0, memory_mb=512) as p:
        yield p


def scripted_config(num_items: int = 12, seed: int = 0, **faults):
    c = get_config("toy")
    c.source.num_items, c.source.seed = num_items, seed
    c.weak.url, c.weak.model, c.weak.serve = "scripted", "scripted-weak", ""
    c.stratify.k, c.stratify.medium_rate = 4, 0.5
    c.source.corrupt_rate = faults.pop("corrupt_rate", 0.0)
    c.scripted.update({k: 0.0 for k in c.scripted})
    c.scripted.update(faults)
    c.output.tfds = False  # one test builds it
    return c


@pytest.fixture
def make_config():
    return scripted_config


@pytest.fixture
def ctx(make_config, tmp_path, pool):
    """make(num_items, **faults) -> (a stage Context on the scripted server, the ingested toy items)."""
    from runs.curate import pipeline, stages

    def make(num_items=12, **faults):
        c = make_config(num_items=num_items, **faults)
        items = pipeline.ingest(c, str(tmp_path), log=lambda s: None)
        stack = pipeline.endpoints(c, str(tmp_path), items, log=lambda s: None)
        eps = stack.__enter__()
        made.append(stack)
        return stages.Context(str(tmp_path), c, pool=pool, **eps), items

    made = []
    yield make
    for s in made:
        s.__exit__(None, None, None)
