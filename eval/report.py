"""The trajectory report: one static HTML page per run (`report.html` in the workdir).

Open it from disk (file://); no server, no external URL: CSS and JS are inline, images are the PNG
files the run saved under `images/` (relative links), or embedded as data URIs with `embed=True`.
Each item shows its question, prompt image(s), every turn's reasoning, code, interpreter output
(status and text) and produced images, the answer, the gold answer and the scores. Filters: all /
correct / wrong / deferred / failed executions; `report.html#filter=wrong` opens filtered.
The page records its own script errors in `body[data-js-errors]` and, once loaded, how many of the
first items' images decoded (`data-images-ok` / `data-images-broken`), which the browser test reads.
"""

from __future__ import annotations

import html
import json
import os

from eval import tool_analytics
from eval.runner import PREDICTIONS, TRAJECTORIES, read_jsonl
from eval.summary import TABLE_COLUMNS, format_value
from eval.trajectory_html import trajectory_html

EAGER_ITEMS = 20  # items whose images load eagerly (the rest lazily)

CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222;background:#fafafa}
table.summary{border-collapse:collapse;margin-bottom:1em}table.summary td,table.summary th{border:1px solid #bbb;padding:.25em .6em}
.filters button{margin-right:.4em;padding:.3em .8em}.filters button.on{background:#246;color:#fff}
.item{background:#fff;border:1px solid #ccc;border-left:6px solid #999;margin:1em 0;padding:.6em 1em}
.item.correct{border-left-color:#2a2}.item.wrong{border-left-color:#c33}.item.deferred{border-left-color:#c90}
.turn{border-top:1px dashed #ccc;margin-top:.5em;padding-top:.4em}pre{white-space:pre-wrap;background:#f3f3f3;padding:.4em;margin:.3em 0}
pre.code{background:#eef3ff}pre.obs{background:#f6fff0}.status-ok{color:#2a2}.status-bad{color:#c33}
img{max-width:360px;max-height:360px;border:1px solid #ddd;margin:.2em}.meta{color:#555;font-size:.9em}
"""

JS = """
(function(){
  var errors=[];
  window.addEventListener('error',function(e){errors.push(String(e.message));document.body.dataset.jsErrors=errors.join(' | ');});
  function apply(f){
    var shown=0;
    document.querySelectorAll('.item').forEach(function(el){
      var on = f==='all' || (f==='failed' ? el.dataset.failedExec==='1' : el.dataset.verdict===f);
      el.hidden=!on; if(on) shown++;
    });
    document.querySelectorAll('.filters button').forEach(function(b){b.classList.toggle('on',b.dataset.filter===f);});
    document.body.dataset.filter=f; document.body.dataset.shown=String(shown);
    document.getElementById('shown').textContent=shown;
  }
  document.querySelectorAll('.filters button').forEach(function(b){
    b.addEventListener('click',function(){location.hash='filter='+b.dataset.filter;apply(b.dataset.filter);});
  });
  var m=/filter=(\\w+)/.exec(location.hash); apply(m?m[1]:'all');
  window.addEventListener('load',function(){
    var ok=0,broken=0;
    document.querySelectorAll('img[loading=eager]').forEach(function(im){ if(im.complete&&im.naturalWidth>0) ok++; else broken++; });
    document.body.dataset.imagesOk=String(ok); document.body.dataset.imagesBroken=String(broken);
    document.body.dataset.ready='1';
  });
})();
"""


def tool_use_html(records: list[dict]) -> str:
    """The run's tool use from its executed cells (`eval.tool_analytics`): trajectories with code,
    cells, the share of cells showing each behaviour, the most used calls."""
    st = tool_analytics.analyze(records, keys=())["all"]
    if not st["cells"]:
        return '<p class="meta">tool use: no executed cells</p>'
    labels = [label for label, _ in tool_analytics.BEHAVIOURS]
    beh = st["behaviour_cell_rate"]
    head = ["with code", "cells", "calls / cell"] + labels
    row = [f"{st['with_code']} / {st['trajectories']}", str(st["cells"]), f"{st['calls_per_cell']:.2f}"]
    row += [f"{100 * beh[lb]:.0f}%" for lb in labels]
    calls = ", ".join(f"{c} ({n})" for c, n in st["top_calls"])
    return ('<h2>Tool use</h2><table class="summary"><tr>' + "".join(f"<th>{html.escape(h)}</th>" for h in head)
            + "</tr><tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr></table>"
            + f'<p class="meta">share of executed cells; most used calls (cells): {html.escape(calls)}</p>')


def write_report(workdir: str, summary: dict | None = None, embed: bool = False, title: str | None = None) -> str:
    """Write `workdir/report.html` from the run's predictions, trajectories and summary."""
    preds, _ = read_jsonl(os.path.join(workdir, PREDICTIONS))
    trajs = {r["id"]: r for r in read_jsonl(os.path.join(workdir, TRAJECTORIES))[0]}  # last record per id wins
    if summary is None and os.path.exists(os.path.join(workdir, "summary.json")):
        with open(os.path.join(workdir, "summary.json")) as f:
            summary = json.load(f)
    bench = (summary or {}).get("benchmark", "")
    out = [
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title or bench + ' report')}"
        f"</title><style>{CSS}</style></head><body><h1>{html.escape(title or bench + ' evaluation')}</h1>"
    ]
    if summary:
        out.append(
            '<table class="summary"><tr>'
            + "".join(f"<th>{html.escape(h)}</th>" for _, h in TABLE_COLUMNS)
            + "</tr><tr>"
            + "".join(
                f"<td>{html.escape(format_value(summary.get(k), 2 if k == 'avg_turns' else 1))}</td>" for k, _ in TABLE_COLUMNS
            )
            + "</tr></table>"
        )
        out.append(
            f'<p class="meta">ours = {html.escape(str(summary.get("headline_metric")))}; accuracy (rule) = '
            f"VLMEvalKit's rule-based verdicts, deferred items counted wrong.</p>"
        )
    out.append(tool_use_html(list(trajs.values())))
    counts = {v: sum(p["rule_verdict"] == v for p in preds) for v in ("correct", "wrong", "deferred")}
    failed = sum(p["num_tool_calls"] > p["exec_ok"] for p in preds)
    out.append(
        '<div class="filters">'
        + "".join(
            f'<button data-filter="{f}">{label} ({n})</button>'
            for f, label, n in [
                ("all", "all", len(preds)),
                ("correct", "correct", counts["correct"]),
                ("wrong", "wrong", counts["wrong"]),
                ("deferred", "deferred", counts["deferred"]),
                ("failed", "failed executions", failed),
            ]
        )
        + ' <span class="meta">showing <span id="shown"></span></span></div>'
    )
    for n, p in enumerate(preds):
        t = trajs.get(p.get("trajectory_id"), {})
        eager = n < EAGER_ITEMS
        verdict = p["rule_verdict"]
        out.append(
            f'<div class="item {verdict}" data-index="{html.escape(str(p["index"]))}" data-verdict="{verdict}" '
            f'data-failed-exec="{int(p["num_tool_calls"] > p["exec_ok"])}">'
        )
        out.append(
            f'<div class="meta">#{html.escape(str(p["index"]))} · {verdict} (rule) · strict '
            f"{p['strict_hit']} · judge {format_value(p.get('judge_hit'))} · {p['num_turns']} turns · "
            f"{p['exec_ok']}/{p['num_tool_calls']} executions ok · {html.escape(str(p.get('finish_reason')))}</div>"
        )
        out.append(f'<pre class="question">{html.escape(str(p.get("asked", p.get("question"))))}</pre>')
        out.append(trajectory_html(t.get("images", []), t.get("turns", []), t.get("turn_texts", []), workdir,
                                   eager=eager, embed=embed))
        out.append(
            f'<p><b>answer</b>: <span class="prediction">{html.escape(str(p["prediction"]))}</span> · '
            f'<b>gold</b>: <span class="gold">{html.escape(str(p["answer"]))}</span></p></div>'
        )
    out.append(f"<script>{JS}</script></body></html>")
    path = os.path.join(workdir, "report.html")
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(out))
    return path
