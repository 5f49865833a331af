"""One report model, two renderings: every heading, table cell and figure of a `Report` appears in
both the Markdown and the HTML, and the HTML escapes every piece of text."""

import html
import json
import re

import numpy as np

from runs.demo.report import build_report, gather
from runs.demo.report_model import (
    Bullets,
    Cell,
    Code,
    Figure,
    Paragraph,
    Preformatted,
    Raw,
    Report,
    Section,
    Strong,
    Table,
    md_table,
    to_html,
    to_markdown,
)

EVIL = "<script>alert('x')</script>"


def _walk(blocks):
    for b in blocks:
        yield b
        if isinstance(b, Section):
            yield from _walk(b.blocks)


def _cell_text(c):
    return c.text if isinstance(c, Cell) else str(c)


def assert_same_content(report: Report, md: str, page: str):
    """Every section title, table cell and figure of `report` in both renderings."""
    md_lines = md.splitlines()
    assert f"# {report.title}" in md_lines and f"<h1>{html.escape(report.title)}</h1>" in page
    n_tables = 0
    for b in _walk(report.sections):
        if isinstance(b, Section):
            assert any(re.fullmatch(rf"#+ {re.escape(b.title)}", line) for line in md_lines), b.title
            assert re.search(rf"<h\d>{re.escape(html.escape(b.title))}</h\d>", page), b.title
        elif isinstance(b, Table):
            n_tables += 1
            block = md_table(b.header, b.rows)
            assert block in md
            for h in b.header:
                assert str(h).replace("|", "\\|") in block.splitlines()[0]
                assert f"<th>{html.escape(str(h))}</th>" in page
            assert len(block.splitlines()) == 2 + len(b.rows)
            for row, md_row in zip(b.rows, block.splitlines()[2:], strict=True):
                for c in row:
                    text = _cell_text(c)
                    assert text.replace("|", "\\|") in md_row
                    assert re.search(rf"<td( class=\"\w+\")?>{re.escape(html.escape(text))}</td>", page), text
        elif isinstance(b, Figure):
            assert f"![{b.caption}]({b.path})" in md
            assert f'<img src="{html.escape(b.path)}" alt="{html.escape(b.caption)}">' in page
    return n_tables


def test_small_report_renders_the_same_content_twice():
    rng = np.random.default_rng()
    acc = [f"{100 * v:.1f}%" for v in rng.random(3)]
    n = [str(int(v)) for v in rng.integers(10, 500, 3)]
    report = Report(f"Run {EVIL}", [
        Section("Evaluations", [
            Table(["eval", "accuracy", "n"], [["sft", acc[0], n[0]], ["grpo", acc[1], n[1]], [EVIL, acc[2], n[2]]]),
            Paragraph(f"Rates with their intervals; a | pipe and {EVIL}.", note=True),
        ]),
        Section("Targets", [
            Table(["target", "sft"], [["hard_accuracy", Cell(f"{acc[0]} met", "met")],
                                      ["a|b", Cell(f"{acc[1]} NOT met", "notmet")]]),
            Section(f"Checks {EVIL}", [Bullets([("accuracy: ", Strong("met", "met"), " (up)"),
                                                 ("calls: ", Code(EVIL), ", none"), "plain"])]),
        ]),
        Section("Curves", [Figure("plots/loss.png", "loss"), Figure(f"plots/{EVIL}.png", EVIL),
                           Bullets(["entropy: no data"]), Preformatted(json.dumps({"k": EVIL}), "json")]),
        Section("Examples", [Raw("<p>already &lt;escaped&gt;</p>", "See report.html.")]),
    ])
    md, page = to_markdown(report), to_html(report, css="body{margin:0}")
    assert assert_same_content(report, md, page) == 2

    assert "<script>" not in page and page.count(html.escape(EVIL)) == 9  # title, h1, td, p, h3, code, src, alt, pre
    assert page.startswith("<!DOCTYPE html>") and "<style>body{margin:0}</style>" in page and "http" not in page
    # Both notes and checks, in each form.
    assert f"a | pipe and {EVIL}." in md and '<p class="meta">Rates with' in page
    assert "- accuracy: **met** (up)" in md and '<li>accuracy: <span class="met">met</span> (up)</li>' in page
    assert f"- calls: `{EVIL}`, none" in md and f"<code>{html.escape(EVIL)}</code>" in page
    assert '<td class="notmet">' in page and "| a\\|b |" in md
    # Consecutive figures: one paragraph in Markdown, one flex row in HTML.
    assert "![loss](plots/loss.png)\n![" in md and page.count('<div class="plots">') == 1
    assert f'```json\n{json.dumps({"k": EVIL})}\n```' in md
    assert "See report.html." in md and "<p>already &lt;escaped&gt;</p>" in page and "already" not in md


def test_demo_report_says_the_same_in_both(tmp_path):
    """The demo's own report: every table, heading and figure `build_report` makes, in both files."""
    rng = np.random.default_rng()

    def rate():
        v = float(rng.uniform(0.2, 0.8))
        return v, [v - 0.1, v + 0.1]

    evals = {}
    for name in ("sft", "grpo"):
        s = {"n": int(rng.integers(20, 60)), "avg_turns": float(rng.uniform(1, 3)), "tool_calls": float(rng.random())}
        for key in ("accuracy", "tool_rate", "exec_success", "difficulty=easy/accuracy", "difficulty=hard/accuracy",
                    "difficulty=easy/tool_rate", "difficulty=hard/tool_rate"):
            s[key], s[f"{key}_ci95"] = rate()
        s["difficulty=easy/n"] = s["difficulty=hard/n"] = s["n"] // 2
        evals[name] = s
    drift = [{"step": k, "kl_k3": float(rng.random()), "kl_k1": float(rng.random()), "tokens": 100 * k,
              "trajectories": 8} for k in (1, 2)]
    sft = [{"step": k, "loss": float(rng.random())} for k in range(1, 6)]
    paths = {}  # per-item records (the paired accuracy table); items q0..q{n-1}, so some lack a pair
    for name, s in evals.items():
        paths[name] = str(tmp_path / f"{name}.jsonl")
        with open(paths[name], "w") as fh:
            fh.writelines(json.dumps({"prompt_id": f"q{i}", "correct": bool(rng.random() < 0.6),
                                      "meta": {"difficulty": "easy" if i % 2 else "hard"}}) + "\n"
                          for i in range(s["n"]))
    f = gather(str(tmp_path), evals=evals, sft_metrics=sft, grpo_metrics=[], drift=drift, eval_trajectories=paths,
               targets={"hard_accuracy": 0.5}, effect_targets={"accuracy_gain": 0.05},
               timings={"sft": float(rng.uniform(1, 100))}, world={"families": "count", "n_train": 120},
               title=f"Demo {EVIL}")
    report = build_report(f, examples="<p>examples</p>")
    md, page = to_markdown(report), to_html(report)
    # evals, changes, paired accuracy, 2 breakdowns, targets, drift, timings, world
    assert assert_same_content(report, md, page) >= 9
    titles = [b.title for b in _walk(report.sections) if isinstance(b, Section)]
    assert titles[:4] == ["Evaluations", "Changes", "Accuracy item by item, greedy: grpo - sft",
                          "By family and difficulty"] and "Example trajectories" in titles
    nb, na = evals["sft"]["n"], evals["grpo"]["n"]
    left_out = f"Left out: {max(0, nb - na)} items evaluated only by sft, {max(0, na - nb)} only by grpo."
    assert (left_out in md) == (nb != na) and "<th>McNemar p</th>" in page
    figures = [b.path for b in _walk(report.sections) if isinstance(b, Figure)]
    assert figures == ["plots/sft_loss.png"] and (tmp_path / "plots" / "sft_loss.png").is_file()
    for t in f.no_data:
        assert f"- {t}: no data" in md and f"<li>{html.escape(t)}: no data</li>" in page
    assert "<script>" not in page and html.escape(EVIL) in page
