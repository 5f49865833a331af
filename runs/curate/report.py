"""The curation report as HTML: counts per stage and reason, the difficulty histogram, some kept
trajectories and, for every drop reason of every stage, its first dropped items (styles and `<img>`
tags of the evaluation report, `eval.report.CSS` and `eval.trajectory_html.image_tag`).
`report.json` holds the same numbers."""

from __future__ import annotations

import html

from eval.report import CSS
from eval.trajectory_html import image_tag


def _trajectory(row: dict, workdir: str) -> str:
    """A kept or dropped row: its trajectory, or for an item dropped before synthesis its question and image."""
    images = list(row.get("images", []))
    out = [f"<h3>{html.escape(row['id'])} ({html.escape(row.get('difficulty', ''))}, "
           f"{html.escape(row.get('mode', ''))}){' dropped: ' + html.escape(row['drop']) if row.get('drop') else ''}"
           f"</h3><p>gold: {html.escape(str(row['answer']))}</p>"]
    if "messages" not in row:
        out.append(f'<div class="turn"><b>question</b><pre>{html.escape(row["question"])}</pre>'
                   f'{image_tag(workdir, row["image"], False, True)}</div>')
        extra = {k: row[k] for k in ("pass_rate", "bbox_reply") if k in row}
        if extra:
            out.append(f"<pre>{html.escape(repr(extra))}</pre>")
        return "\n".join(out)
    k = 0
    for m in row["messages"]:
        n = m["content"].count("<image>") if m["role"] == "user" else m.get("num_images", 0)
        cls = "obs" if m["role"] == "observation" else "turn"
        imgs = "".join(image_tag(workdir, r, False, True) for r in images[k:k + n])
        k += n
        out.append(f'<div class="{cls}"><b>{m["role"]}</b><pre>{html.escape(m["content"])}</pre>{imgs}</div>')
    return "\n".join(out)


def write_html(path: str, report: dict, workdir: str, kept_rows: list[dict],
               dropped: list[tuple[str, str, list[dict]]]) -> None:
    """`dropped`: (stage, reason, example rows) for every drop reason (`pipeline.dropped_examples`)."""
    rows = []
    for name, c in report["stages"].items():
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(c["dropped"].items())) or "-"
        rows.append(f"<tr><td>{name}</td><td>{c['in']}</td><td>{c['kept']}</td><td>{html.escape(reasons)}</td></tr>")
    hist = "".join(f"<tr><td>{k}</td><td>{v}</td></tr>" for k, v in sorted(report["difficulty"].items()))
    body = (f"<h1>SFT data curation</h1><p>{report['items']} items in, {report['kept']} trajectories out "
            f"(<code>{html.escape(report['sft_jsonl'])}</code>)</p>"
            "<h2>Stages</h2><table><tr><th>stage</th><th>in</th><th>kept</th><th>dropped by reason</th></tr>"
            + "".join(rows) + "</table><h2>Difficulty (weak model pass@k)</h2><table>"
            "<tr><th>difficulty</th><th>items</th></tr>" + hist + "</table>"
            "<h2>Kept trajectories</h2>" + "".join(_trajectory(r, workdir) for r in kept_rows)
            + "<h2>Dropped, by stage and reason</h2>"
            + "".join(f'<h3 class="reason" id="drop-{html.escape(stage)}-{html.escape(reason)}">{html.escape(stage)}: '
                      f'{html.escape(reason)} ({report["stages"][stage]["dropped"][reason]} dropped, '
                      f'{len(rows)} shown)</h3>' + "".join(_trajectory(r, workdir) for r in rows)
                      for stage, reason, rows in dropped))
    with open(path, "w") as f:
        f.write(f"<!doctype html><html><head><meta charset='utf-8'><style>{CSS}</style></head><body>{body}"
                "</body></html>")
