"""Evaluation over several processes: each takes every n-th item, one merged workdir at the end.

    items = share(items)                       # process p of n keeps items[p::n]
    run_eval(..., workdir=process_dir(workdir))   # WORKDIR/processes/P/ (its own resume point)
    merge(workdir, benchmark)                  # after a barrier, on process 0

Process p's files live in `WORKDIR/processes/p/`; process 0 merges their predictions (in the
benchmark's item order), trajectories (image paths rewritten relative to WORKDIR) into WORKDIR's
predictions.jsonl / predictions.tsv / trajectories.jsonl and writes one summary and report.
Resuming needs the same process count (the shares are by position). Each process loads the model
on its own devices: an evaluation batch is not split across processes' devices (within a process
its rows are split over the local mesh's `data` axis, `config.mesh.data`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from eval.runner import PREDICTIONS, TRAJECTORIES, read_jsonl, write_predictions_tsv


def share(items: Sequence, index: int, count: int) -> list:
    return list(items[index::count])


def process_dir(workdir: str, index: int) -> str:
    return os.path.join(workdir, "processes", str(index))


def barrier(name: str) -> None:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def merge(workdir: str, benchmark: str, order: Sequence[str], count: int, judge_used: bool = False) -> dict:
    """Merge the `count` process directories into `workdir`; returns the summary."""
    from eval.summary import write_summary

    rank = {str(k): i for i, k in enumerate(order)}
    preds, trajs = [], []
    for p in range(count):
        d = process_dir(workdir, p)
        recs, _ = read_jsonl(os.path.join(d, PREDICTIONS))
        preds += recs
        for t in read_jsonl(os.path.join(d, TRAJECTORIES))[0]:
            t["images"] = [os.path.relpath(os.path.join(d, im), workdir) for im in t.get("images", [])]
            trajs.append(t)
    last = {str(r["index"]): r for r in preds}  # a re-run batch appears twice: keep the last record
    preds = sorted(last.values(), key=lambda r: rank.get(str(r["index"]), len(rank)))
    for name, recs in ((PREDICTIONS, preds), (TRAJECTORIES, trajs)):
        with open(os.path.join(workdir, name), "w") as f:
            for r in recs:
                f.write(json.dumps(r) + "\n")
    write_predictions_tsv(preds, os.path.join(workdir, "predictions.tsv"))
    return write_summary(benchmark, preds, workdir, judge_used=judge_used)
