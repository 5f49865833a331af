"""The evaluation loop: batches of items -> policy -> scores, append-only files, resumable.

    summary = run_eval("ChartQA", items, policy, workdir, batch_size=8)

Workdir (all paths relative to it):
  predictions.jsonl   one JSON object per scored item, appended as each batch finishes (the
                      resume point: items whose index is in it are skipped after a restart)
  trajectories.jsonl  the SPEC section 2 record of each item's rollout (+ benchmark, index,
                      turn_texts, scores), appended before its prediction; images in images/
  predictions.tsv     VLMEvalKit's prediction-file columns (the row's fields, prediction, hit,
                      ...), rewritten from predictions.jsonl at the end
  summary.json / summary.md, report.html (eval.summary, eval.report)

A batch is written trajectories first, then predictions; a crash between the two re-runs that
batch (its trajectories then appear twice; readers keep the last record per id). A torn last line
(kill -9 during a write) is ignored on resume and counted in the log.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from PIL import Image

from eval.loaders import Item
from eval.policy import EvalPrompt, Policy
from eval.scoring import rule_score, strict_score

PREDICTIONS = "predictions.jsonl"
TRAJECTORIES = "trajectories.jsonl"
EXEC_STATUSES = ("ok", "error", "timeout", "crashed")


def read_jsonl(path: str) -> tuple[list[dict], int]:
    """Records of an append-only file, and how many unreadable lines were skipped."""
    out, bad = [], 0
    if not os.path.exists(path):
        return out, bad
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except ValueError:
                bad += 1
    return out, bad


def run_eval(
    benchmark: str,
    items: Sequence[Item],
    policy: Policy,
    workdir: str,
    *,
    batch_size: int = 8,
    judge: Callable | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Roll out, score and record every item not yet in `workdir/predictions.jsonl`; returns the summary."""
    from eval.summary import write_summary

    os.makedirs(os.path.join(workdir, "images"), exist_ok=True)
    pred_path = os.path.join(workdir, PREDICTIONS)
    done, bad = read_jsonl(pred_path)
    if bad:
        log(f"{pred_path}: {bad} unreadable line(s) skipped (an interrupted write); those items run again")
    done_ids = {str(r["index"]) for r in done}
    todo = [it for it in items if it.index not in done_ids]
    log(f"{benchmark}: {len(items)} items, {len(items) - len(todo)} already scored, {len(todo)} to run")
    t0 = time.perf_counter()
    for start in range(0, len(todo), batch_size):
        batch = todo[start : start + batch_size]
        prompts = [EvalPrompt(it.index, it.question, it.pil_images()) for it in batch]
        trajs = policy(prompts)
        if len(trajs) != len(batch):
            raise RuntimeError(f"the policy returned {len(trajs)} trajectories for {len(batch)} prompts")
        preds, recs = [], []
        for it, traj in zip(batch, trajs, strict=True):
            pred, rec = _score(benchmark, it, traj, policy.processor, judge, workdir)
            preds.append(pred)
            recs.append(rec)
        _append(os.path.join(workdir, TRAJECTORIES), recs)
        _append(pred_path, preds)
        n = start + len(batch)
        log(f"{benchmark}: {n}/{len(todo)} items, {time.perf_counter() - t0:.1f}s")
    records, _ = read_jsonl(pred_path)
    write_predictions_tsv(records, os.path.join(workdir, "predictions.tsv"))
    return write_summary(benchmark, records, workdir, judge_used=judge is not None)


def _append(path: str, records: list[dict]) -> None:
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps(r, default=_jsonable) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _jsonable(v):
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, (bytes, bytearray)):
        return None
    raise TypeError(f"not JSON serializable: {type(v).__name__}")


def _score(benchmark: str, it: Item, traj, processor, judge, workdir: str) -> tuple[dict, dict]:
    prediction = traj.answer if traj.answer is not None else ""
    rule = rule_score(benchmark, prediction, it.row, judge=judge is not None)
    strict = strict_score(benchmark, prediction, it.row)
    judged = judge(it.question, it.answer, prediction, it.row) if (judge is not None and rule is None) else None
    final = rule if rule is not None else judged
    statuses = list(traj.turn_status)
    execs = [s for s in statuses if s in EXEC_STATUSES]
    traj.correct = bool(final)
    traj.rewards = {"rule": rule, "strict": strict, "judge": judged}
    pred = {k: v for k, v in it.row.items()}
    pred.update(
        index=it.index,
        question=it.row.get("question"),
        answer=it.answer,
        prediction=prediction,
        hit=int(bool(rule)),
        rule_verdict={True: "correct", False: "wrong", None: "deferred"}[rule],
        strict_hit=int(strict),
        judge_hit=None if judged is None else int(judged),
        score=int(bool(final)),
        num_turns=len(statuses),
        num_tool_calls=len(execs),
        exec_ok=sum(s == "ok" for s in execs),
        finish_reason=traj.finish_reason,
        trajectory_id=traj.id,
        asked=it.question,
    )
    rec = _trajectory_record(traj, processor, workdir)
    rec.update(
        benchmark=benchmark,
        index=it.index,
        question=it.question,
        gold=it.answer,
        prediction=prediction,
        rule_verdict=pred["rule_verdict"],
        strict_hit=pred["strict_hit"],
        judge_hit=pred["judge_hit"],
    )
    return pred, rec


def _trajectory_record(traj, processor, workdir: str) -> dict:
    """The SPEC section 2 record (as codedance_jax.rollout.record writes it) + decoded turn texts."""
    rec = {f.name: getattr(traj, f.name) for f in dataclasses.fields(traj)}
    paths = []
    for k, im in enumerate(traj.images):
        rel = os.path.join("images", f"{_safe(traj.id)}-{k}.png")
        if isinstance(im, str):
            rel = im
        else:
            if not isinstance(im, Image.Image):
                im = Image.open(io.BytesIO(im))
            im.save(os.path.join(workdir, rel), format="PNG")
        paths.append(rel)
    rec["images"] = paths
    rec["num_turns"] = len(traj.turn_status)
    toks, tids = np.asarray(traj.tokens), np.asarray(traj.turn_ids)
    rec["turn_texts"] = [processor.decode(toks[tids == m].tolist()) for m in range(len(traj.turn_status))]
    return rec


def _safe(s: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in str(s))


def write_predictions_tsv(records: list[dict], path: str) -> None:
    """VLMEvalKit's prediction file layout: the row's columns first, then prediction and our scores."""
    lead = ["index", "question", "answer", "prediction", "hit"]
    cols: list[str] = list(lead)
    for r in records:
        for k in r:
            if k not in cols:
                cols.append(k)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, delimiter="\t")
        w.writerow(cols)
        for r in records:
            w.writerow(["" if r.get(c) is None else _cell(r.get(c)) for c in cols])


def _cell(v: Any) -> str:
    return json.dumps(v) if isinstance(v, (list, dict)) else str(v)
