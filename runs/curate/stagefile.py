"""One stage = JSON lines in, JSON lines out, resumable on its own.

`run_stage(name, workdir, rows, fn, workers)` calls `fn(row) -> row'` for every input row whose id
is not yet in `WORKDIR/{name}.jsonl`, in `workers` threads, and appends each result as one flushed
line the moment it is ready. A result carries `"drop": reason` when the stage removed the item;
kept and dropped rows both go to the file, so a re-run (or a run after a kill) skips exactly the
items already decided and neither repeats nor loses one. An item whose `fn` raised `EndpointError`
is not written: the stage reports it and the next run retries it. A torn last line left by a kill
is cut off before appending.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import threading
from collections.abc import Callable
from typing import Any

from codedance_jax.errors import UserError
from runs.curate.endpoints import EndpointError, read_jsonl_tolerant, repair_jsonl


class StageIncomplete(UserError):
    """Some items of a stage failed at an endpoint; re-running the same command retries only them."""


def stage_path(workdir: str, name: str) -> str:
    return os.path.join(workdir, f"{name}.jsonl")


def read_stage(workdir: str, name: str) -> list[dict[str, Any]]:
    """The decided rows of a stage, first occurrence of each id."""
    seen, rows = set(), []
    for r in read_jsonl_tolerant(stage_path(workdir, name)):
        if r["id"] not in seen:
            seen.add(r["id"])
            rows.append(r)
    return rows


def kept(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if not r.get("drop")]


def run_stage(name: str, workdir: str, rows: list[dict[str, Any]], fn: Callable[[dict], dict], workers: int = 4,
              log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run `fn` over the undecided `rows`; returns all decided rows of the stage in input order."""
    path = stage_path(workdir, name)
    repair_jsonl(path)
    done = {r["id"] for r in read_stage(workdir, name)}
    todo = [r for r in rows if r["id"] not in done]
    log(f"stage {name}: {len(rows)} in, {len(done & {r['id'] for r in rows})} already decided, {len(todo)} to do")
    failures: list[str] = []
    lock = threading.Lock()
    with open(path, "a", encoding="utf-8") as f, concurrent.futures.ThreadPoolExecutor(max(1, workers)) as ex:
        futures = {ex.submit(fn, r): r["id"] for r in todo}
        for fut in concurrent.futures.as_completed(futures):
            try:
                out = fut.result()
            except EndpointError as e:
                failures.append(f"{futures[fut]}: {e}")
                continue
            with lock:
                f.write(json.dumps(out) + "\n")
                f.flush()
    if failures:
        raise StageIncomplete(f"stage {name}: {len(failures)} item(s) failed at an endpoint, e.g. {failures[0]}",
                              "check the endpoint (url, model, key) and re-run the same command: decided items "
                              "and cached replies are kept, only the failed items are asked again")
    order = {r["id"]: i for i, r in enumerate(rows)}
    return sorted((r for r in read_stage(workdir, name) if r["id"] in order), key=lambda r: order[r["id"]])
