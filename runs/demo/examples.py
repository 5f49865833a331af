"""The report's example trajectories: a few correct and wrong ones per evaluation x family x
difficulty, read from each evaluation's `trajectories.jsonl`, as escaped HTML.

Records are `codedance_jax.rollout.record.save_jsonl`'s, with optional extra fields `text` (a
string, or a list of per-turn strings) and `meta` {family, difficulty, question, gold}. Their images
are linked by paths relative to the report's folder, or copied into `images/{eval}/` there. Every
piece of text is HTML-escaped: the model's output is untrusted.
"""

from __future__ import annotations

import html
import json
import os
import shutil
from collections.abc import Mapping, Sequence

from eval.trajectory_html import trajectory_html
from runs.demo.numbers import to_float
from runs.demo.tables import DIFFICULTY_ORDER, FAMILY_ORDER, ordered


def record_meta(rec: Mapping) -> dict:
    """A record's `meta` dict ({} when it has none)."""
    m = rec.get("meta")
    return dict(m) if isinstance(m, Mapping) else {}


def _verdict(rec: Mapping) -> str:
    c = rec.get("correct")
    return "correct" if c is True else "wrong" if c is False else "unscored"


def select_examples(path: str, per_group: int) -> tuple[list[dict], dict]:
    """Up to `per_group` correct and `per_group` wrong records per (family, difficulty), in file
    order; also the number of records per group. Unreadable lines are skipped."""
    chosen: dict[tuple, dict[str, list]] = {}
    totals: dict[tuple, int] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if not isinstance(rec, dict):
                continue
            m = record_meta(rec)
            g = (str(m.get("family", "?")), str(m.get("difficulty", "?")))
            totals[g] = totals.get(g, 0) + 1
            bucket = chosen.setdefault(g, {}).setdefault(_verdict(rec), [])
            if len(bucket) < per_group:
                bucket.append(rec)
    fams = ordered({g[0] for g in chosen}, FAMILY_ORDER)
    diffs = ordered({g[1] for g in chosen}, DIFFICULTY_ORDER)
    out = []
    for fam in fams:
        for diff in diffs:
            for verdict in ("correct", "wrong", "unscored"):
                out += chosen.get((fam, diff), {}).get(verdict, [])
    return out, {f"{f}/{d}": n for (f, d), n in totals.items()}


def image_src(rel: str, traj_dir: str, out_dir: str, copy_to: str | None) -> str:
    """An image of a record in `traj_dir` as a link from `out_dir` (copied into `copy_to` first, if given)."""
    src = os.path.normpath(os.path.join(traj_dir, rel))
    if copy_to is not None and os.path.isfile(src):
        os.makedirs(copy_to, exist_ok=True)
        dst = os.path.join(copy_to, os.path.basename(src))
        shutil.copyfile(src, dst)
        src = dst
    return os.path.relpath(src, out_dir).replace(os.sep, "/")


def example_html(rec: Mapping, traj_dir: str, out_dir: str, copy_to: str | None) -> str:
    """One record: a line of facts, the question, the trajectory (`eval.trajectory_html`), the answer."""
    m = record_meta(rec)
    images = [str(p) for p in rec.get("images") or [] if isinstance(p, str)]
    srcs = [image_src(p, traj_dir, out_dir, copy_to) for p in images]
    turns = [t if isinstance(t, Mapping) else {} for t in rec.get("turns") or []]
    verdict = _verdict(rec)
    rewards = rec.get("rewards") if isinstance(rec.get("rewards"), Mapping) else {}
    rew = ", ".join(f"{k} {to_float(v):.3g}" if to_float(v) is not None else f"{k} {v}" for k, v in rewards.items())
    info = [
        str(rec.get("id", "?")),
        f"{m.get('family', '?')} / {m.get('difficulty', '?')}",
        verdict,
        f"{rec.get('num_turns', len(turns))} turns",
        f"{sum(s in ('ok', 'error', 'timeout', 'crashed') for s in rec.get('turn_status') or [])} executions",
        f"finish: {rec.get('finish_reason', '')}",
    ] + ([f"rewards: {rew}"] if rew else [])
    out = [f'<div class="item {verdict}" data-verdict="{verdict}"><div class="meta">'
           f"{html.escape(' · '.join(info))}</div>"]
    if m.get("question") is not None:
        out.append(f'<pre class="question">{html.escape(str(m["question"]))}</pre>')
    text = rec.get("text", rec.get("turn_texts"))
    if isinstance(text, str):  # the full response already shows the code
        turns = [{**t, "code": None} for t in turns]
    turns = [{kk: (str(v) if kk in ("status", "observation", "code") and v is not None else v) for kk, v in t.items()}
             for t in turns]
    out.append(trajectory_html(srcs, turns, text if isinstance(text, list) else None, out_dir, eager=True,
                               response=text if isinstance(text, str) else None))
    gold = m.get("gold", rec.get("gold"))
    out.append(
        f'<p><b>answer</b>: <span class="prediction">{html.escape(str(rec.get("answer")))}</span> · '
        f'<b>reference</b>: <span class="gold">{html.escape(str(gold))}</span> · '
        f"<b>{html.escape(verdict)}</b></p></div>"
    )
    return "".join(out)


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name) or "_"


def examples_html(names: Sequence[str], eval_trajectories: Mapping[str, str], out_dir: str, per_group: int,
                  copy_root: str | None = None) -> str:
    """Per evaluation an open `<details>`, in it one closed `<details>` per family / difficulty with
    its chosen records; an evaluation without a trajectories file says so."""
    h = []
    for name in names:
        path = eval_trajectories.get(name)
        h.append(f"<details open><summary><b>{html.escape(name)}</b></summary>")
        if not path or not os.path.isfile(path):
            h.append(f"<p>No trajectories ({html.escape(str(path))}).</p></details>")
            continue
        recs, totals = select_examples(path, per_group)
        h.append(f"<p class='meta'>{html.escape(os.path.relpath(path, out_dir))}: showing {len(recs)} of "
                 f"{sum(totals.values())} ({html.escape(', '.join(f'{g} {n}' for g, n in totals.items()))})</p>")
        traj_dir = os.path.dirname(os.path.abspath(path))
        to = os.path.join(copy_root, _safe(name)) if copy_root else None
        group = None
        for rec in recs:
            m = record_meta(rec)
            g = f"{m.get('family', '?')} / {m.get('difficulty', '?')}"
            if g != group:
                h.append(("</details>" if group is not None else "") + f"<details><summary>{html.escape(g)}</summary>")
                group = g
            h.append(example_html(rec, traj_dir, out_dir, to))
        if group is not None:
            h.append("</details>")
        h.append("</details>")
    return "".join(h)
