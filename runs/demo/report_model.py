"""A report as data, and its two renderings: `to_markdown(report)` and `to_html(report)`.

    report = Report("Run", [Section("Evaluations", [Table(["eval", "accuracy"], [["sft", "91.7%"]]),
                                                    Paragraph("Rates are shares of trajectories.", note=True)])])
    to_markdown(report)  # "# Run\\n\\n## Evaluations\\n\\n| eval | accuracy |\\n..."
    to_html(report, css=CSS)  # one self-contained page

A `Report` is a title and sections; a `Section` holds blocks (`Paragraph`, `Table`, `Bullets`,
`Figure`, `Preformatted`, `Raw`, and nested sections, one heading level down). Both renderers walk
the same blocks, so the two files say the same thing. Inline text is a string or a sequence of
strings, `Strong` and `Code` spans.

HTML: every piece of text is escaped (`html.escape`: cells, headings, captions, paths, the title),
since it may hold a model's output. The one exception is a `Raw` block's `html`, which its builder
must have escaped; Markdown shows that block's `markdown` instead. Consecutive figures share one
`<div class="plots">`. The page has no script and no external URL. Markdown: `|` in a table cell
is escaped and a newline becomes a space; other text is written as given.
"""

from __future__ import annotations

import dataclasses
import html
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Strong:
    """Emphasised text: `**text**` in Markdown; in HTML `<span class="{cls}">` (`<b>` without a class)."""

    text: str
    cls: str = ""


@dataclasses.dataclass(frozen=True)
class Code:
    """A name or a snippet inside a line: `` `text` `` in Markdown, `<code>` in HTML."""

    text: str


Inline = str | Strong | Code
Text = str | Sequence[Inline]  # a plain string, or a sequence of spans


@dataclasses.dataclass(frozen=True)
class Cell:
    """A table cell with an HTML class (`met`, `notmet`); Markdown shows the text alone."""

    text: str
    cls: str = ""


@dataclasses.dataclass(frozen=True)
class Paragraph:
    """A paragraph; a `note` is set in the page's small grey style (`<p class="meta">`)."""

    text: Text
    note: bool = False


@dataclasses.dataclass(frozen=True)
class Table:
    """A header and rows of cells (strings, numbers or `Cell`s)."""

    header: Sequence[object]
    rows: Sequence[Sequence[object]]


@dataclasses.dataclass(frozen=True)
class Bullets:
    items: Sequence[Text]


@dataclasses.dataclass(frozen=True)
class Figure:
    """An image file, its path relative to the report; `caption` is its alternative text."""

    path: str
    caption: str


@dataclasses.dataclass(frozen=True)
class Preformatted:
    """Text shown as is: a fenced block in Markdown (with `lang`), `<pre>` in HTML."""

    text: str
    lang: str = ""


@dataclasses.dataclass(frozen=True)
class Raw:
    """HTML that is already escaped (a trajectory with its images), and what Markdown says instead."""

    html: str
    markdown: str = ""


@dataclasses.dataclass(frozen=True)
class Section:
    title: str
    blocks: Sequence[Block]


Block = Paragraph | Table | Bullets | Figure | Preformatted | Raw | Section


@dataclasses.dataclass(frozen=True)
class Report:
    title: str
    sections: Sequence[Section]


def _spans(text: Text) -> Sequence[Inline]:
    return (text,) if isinstance(text, str) else text


# ---------------------------------------------------------------- Markdown


def _md_inline(text: Text) -> str:
    out = []
    for s in _spans(text):
        if isinstance(s, Strong):
            out.append(f"**{s.text}**")
        elif isinstance(s, Code):
            out.append(f"`{s.text}`")
        else:
            out.append(str(s))
    return "".join(out)


def _md_cell(c) -> str:
    text = c.text if isinstance(c, Cell) else str(c)
    return text.replace("|", "\\|").replace("\n", " ")


def md_table(header: Sequence[object], rows: Sequence[Sequence[object]]) -> str:
    """A pipe table, one line per row."""
    lines = ["| " + " | ".join(_md_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_md_cell(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _md_blocks(blocks: Sequence[Block], level: int) -> list[str]:
    """One string per block; consecutive figures share a paragraph (one line each), as in HTML."""
    out: list[str] = []
    for i, b in enumerate(blocks):
        text = _md_block(b, level)
        if isinstance(b, Figure) and i and isinstance(blocks[i - 1], Figure):
            out[-1] += "\n" + text
        elif text:
            out.append(text)
    return out


def _md_block(b: Block, level: int) -> str:
    if isinstance(b, Section):
        return "\n\n".join([f"{'#' * level} {b.title}"] + _md_blocks(b.blocks, level + 1))
    if isinstance(b, Paragraph):
        return _md_inline(b.text)
    if isinstance(b, Table):
        return md_table(b.header, b.rows)
    if isinstance(b, Bullets):
        return "\n".join(f"- {_md_inline(item)}" for item in b.items)
    if isinstance(b, Figure):
        return f"![{b.caption}]({b.path})"
    if isinstance(b, Preformatted):
        return f"```{b.lang}\n{b.text}\n```"
    if isinstance(b, Raw):
        return b.markdown
    raise TypeError(f"not a report block: {type(b).__name__}")


def to_markdown(report: Report) -> str:
    return "\n\n".join([f"# {report.title}"] + _md_blocks(report.sections, 2)) + "\n"


# ---------------------------------------------------------------- HTML


def _html_inline(text: Text) -> str:
    out = []
    for s in _spans(text):
        if isinstance(s, Strong):
            out.append(f'<span class="{html.escape(s.cls)}">{html.escape(s.text)}</span>' if s.cls
                       else f"<b>{html.escape(s.text)}</b>")
        elif isinstance(s, Code):
            out.append(f"<code>{html.escape(s.text)}</code>")
        else:
            out.append(html.escape(str(s)))
    return "".join(out)


def _td(c) -> str:
    if isinstance(c, Cell) and c.cls:
        return f'<td class="{html.escape(c.cls)}">{html.escape(c.text)}</td>'
    return f"<td>{html.escape(c.text if isinstance(c, Cell) else str(c))}</td>"


def html_table(header: Sequence[object], rows: Sequence[Sequence[object]]) -> str:
    """A `<table class="summary">` (eval.report.CSS's style), every cell escaped."""
    out = ['<table class="summary"><tr>' + "".join(f"<th>{html.escape(str(h))}</th>" for h in header) + "</tr>"]
    out += ["<tr>" + "".join(_td(c) for c in r) + "</tr>" for r in rows]
    return "".join(out) + "</table>"


def _html_blocks(blocks: Sequence[Block], level: int) -> str:
    out, figures = [], []
    for b in list(blocks) + [None]:
        if isinstance(b, Figure):
            figures.append(f'<img src="{html.escape(b.path)}" alt="{html.escape(b.caption)}">')
            continue
        if figures:
            out.append('<div class="plots">' + "".join(figures) + "</div>")
            figures = []
        if b is None:
            break
        if isinstance(b, Section):
            h = min(level, 6)
            out.append(f"<h{h}>{html.escape(b.title)}</h{h}>" + _html_blocks(b.blocks, level + 1))
        elif isinstance(b, Paragraph):
            out.append(("<p class=\"meta\">" if b.note else "<p>") + _html_inline(b.text) + "</p>")
        elif isinstance(b, Table):
            out.append(html_table(b.header, b.rows))
        elif isinstance(b, Bullets):
            out.append("<ul>" + "".join(f"<li>{_html_inline(item)}</li>" for item in b.items) + "</ul>")
        elif isinstance(b, Preformatted):
            out.append(f"<pre>{html.escape(b.text)}</pre>")
        elif isinstance(b, Raw):
            out.append(b.html)
        else:
            raise TypeError(f"not a report block: {type(b).__name__}")
    return "".join(out)


def to_html(report: Report, css: str = "") -> str:
    """One static page: the CSS inline, no script, images linked by their relative paths."""
    title = html.escape(report.title)
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{title}</title><style>{css}</style></head>"
            f"<body><h1>{title}</h1>{_html_blocks(report.sections, 2)}</body></html>")
