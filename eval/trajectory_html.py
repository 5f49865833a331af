"""One trajectory record as HTML: prompt images, then each turn's reasoning, code, observation and images.

The renderer both HTML reports use (`eval/report.py` for benchmark runs, `runs/demo/report.py`
for the demo). It reads the SPEC section 2 record's `images` (in order of appearance: the prompt's,
then each turn's `n_images`) and `turns` (`status`, `code`, `observation`, `n_images`), plus the
decoded text of each turn. Styles are `eval.report.CSS`'s classes (`turn`, `code`, `obs`, `status-*`).
"""

from __future__ import annotations

import base64
import html
import os
import re
from collections.abc import Mapping, Sequence

_CODE_BLOCK = re.compile(r"<code>.*?</code>|<tool_call>.*?</tool_call>", re.DOTALL)


def image_tag(workdir: str, rel: str, eager: bool, embed: bool) -> str:
    src = rel
    if embed:
        with open(os.path.join(workdir, rel), "rb") as f:
            src = "data:image/png;base64," + base64.b64encode(f.read()).decode()
    return (
        f'<img src="{html.escape(src)}" alt="{html.escape(os.path.basename(rel))}" '
        f'loading="{"eager" if eager else "lazy"}">'
    )


def turn_html(m: int, text: str, turn: dict, images: list[str], workdir, eager, embed) -> str:
    status = turn.get("status") or ""
    reasoning = _CODE_BLOCK.sub("", text).strip()
    parts = [
        f'<div class="turn" data-turn="{m}"><div class="meta">turn {m + 1} · '
        f'<span class="{"status-ok" if status in ("ok", "no_code") else "status-bad"}">{html.escape(status)}'
        f"</span></div>"
    ]
    parts.append(f'<pre class="reasoning">{html.escape(reasoning)}</pre>')
    if turn.get("code"):
        parts.append(f'<pre class="code">{html.escape(turn["code"])}</pre>')
    if turn.get("observation"):
        parts.append(f'<pre class="obs">{html.escape(turn["observation"])}</pre>')
    parts.extend(image_tag(workdir, p, eager, embed) for p in images)
    parts.append("</div>")
    return "".join(parts)


def trajectory_html(images: Sequence[str], turns: Sequence[Mapping], texts: Sequence[str] | None, workdir: str, *,
                    eager: bool, embed: bool = False, response: str | None = None) -> str:
    """The prompt images, `response` (a whole decoded response, when shown at once), then every turn.

    `images`: paths relative to `workdir`; `texts[m]`: turn m's decoded text ("" when missing).
    """
    n_prompt = max(0, len(images) - sum(int(t.get("n_images") or 0) for t in turns))
    out = [image_tag(workdir, rel, eager, embed) for rel in images[:n_prompt]]
    if response is not None:
        out.append(f'<pre class="response">{html.escape(response)}</pre>')
    k = n_prompt
    for m, turn in enumerate(turns):
        ni = int(turn.get("n_images") or 0)
        text = str(texts[m]) if texts and m < len(texts) else ""
        out.append(turn_html(m, text, turn, images[k : k + ni], workdir, eager, embed))
        k += ni
    return "".join(out)
