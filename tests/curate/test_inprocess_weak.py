"""The weak model as our engine in THIS process (`serve_mode="inprocess"`): launch.serve's server on a
thread, reached over HTTP on 127.0.0.1 like any endpoint; pass@k of the random tiny policy."""

from configs.curate import get_config
from runs.curate import pipeline
from runs.curate.stagefile import read_stage


def test_stratify_with_the_engine_in_process(tmp_path):
    c = get_config("toy")
    c.source.num_items, c.stratify.k = 3, 2
    c.weak.serve_mode = "inprocess"
    logs = []
    pipeline.run(c, str(tmp_path), log=logs.append, stop_after="stratify")
    assert any("in-process server" in m for m in logs)
    rows = read_stage(str(tmp_path), "stratify")
    assert rows and all(r["difficulty"] == "hard" and r["pass_rate"] == 0.0 for r in rows)  # random weights
    assert {r["id"] for r in rows} == {r["id"] for r in read_stage(str(tmp_path), "validate") if not r.get("drop")}
    cache = (tmp_path / "cache" / "weak.jsonl").read_text().splitlines()
    assert len(cache) == c.stratify.k * len(rows)  # every sample asked once, over HTTP
