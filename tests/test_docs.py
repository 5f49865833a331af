"""The docs name only things that exist: README.md, WORKSPACE.md and benchmarks/results/README.md.

What is checked, in each doc:

1. Repo paths in backticks and Markdown link targets. A link target (not a URL, not an anchor) is
   resolved against the doc's folder, as Markdown renders it. For a backticked path:
   - with a `/`: its first segment picks the base. That is the repo root or the doc's folder when it
     names an entry there (or is `.` / `..`). Otherwise it is a workdir or metric name
     (`WORKDIR/policy`, `train/loss`) and is skipped, unless it ends in `.py` or `.sh`, which are
     always repo files;
   - a bare file name with a doc extension (`vision.py`, `report.md`): some file of that name must
     exist in the repo.
   Absolute paths, `~`, placeholders (`{...}`, `<...>`, `*`) and URLs are not repo paths.
   `file.py::test_name` is checked as `file.py`.
2. `python -m launch.X` names a launcher: `launch/X.py` exists.
3. Dotted names in backticks that start with a top-level package (`codedance_jax.rl.rbat_advantages`,
   `eval.rollouts.evaluate`, `runs.grpo.train_step`) resolve: the longest prefix that is a module
   file or package, then at most two attribute names, the first of them defined or imported in that
   module (read with `ast`, so a docstring that mentions a name does not count). So `data.batching` fails: `data` is a package that does not name `batching`.
   Write config fields with their root (`config.data.pack`, `--config.eval.samples`).
4. Size and purpose: README.md at most 160 lines, WORKSPACE.md at most 650, and the README's first
   paragraph that is not a heading says what the project is.

The checker runs on synthetic docs too, so a dead path is seen to fail.
"""

from __future__ import annotations

import ast
import functools
import os
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ("README.md", "WORKSPACE.md", "benchmarks/results/README.md")
PACKAGES = ("codedance_jax", "data", "eval", "runs", "sandbox", "launch", "configs")
EXTENSIONS = (".py", ".md", ".json", ".jsonl", ".sh", ".txt", ".png", ".html", ".toml", ".yaml", ".yml")
ALWAYS_REPO = (".py", ".sh")  # a path ending in these is a repo file wherever it points

BACKTICK = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
LAUNCH = re.compile(r"python3? -m (launch\.[A-Za-z_][\w.]*)")
PATHLIKE = re.compile(r"^[\w.\-/]+$")
DOTTED = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+$")
SKIP_DIRS = {".git", ".venv", ".venv-tpu", "tmp", "__pycache__", "node_modules"}


@functools.cache
def file_names(root: pathlib.Path) -> frozenset[str]:
    """Every file name in the repo (hidden folders, venvs and tmp/ left out)."""
    names = set()
    for _, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".")]
        names.update(files)
    return frozenset(names)


def _strip_code(text: str) -> str:
    """The text with fenced code blocks removed (their contents are commands, not references)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)


def check_path(path: str, doc_dir: pathlib.Path, root: pathlib.Path, *, link: bool) -> str | None:
    """None if `path` is fine (or is not a repo path); else why it is dead."""
    path = path.split("::")[0].split("#")[0]
    if not path or path.startswith(("/", "~")) or "://" in path or path.startswith("mailto:"):
        return None
    if link:
        return None if (doc_dir / path).exists() else f"link target {path!r} does not exist (from {doc_dir})"
    if not PATHLIKE.match(path):
        return None  # placeholders, globs, options: not a path
    if "/" not in path:
        if not path.endswith(EXTENSIONS) or path.startswith("."):
            return None
        if (doc_dir / path).exists() or path in file_names(root):
            return None
        return f"{path!r}: no file of that name in the repo"
    first = path.split("/")[0]
    bases = [b for b in (root, doc_dir) if first in (".", "..") or (b / first).exists()]
    if not bases:
        return f"{path!r}: no such top-level folder" if path.rstrip("/").endswith(ALWAYS_REPO) else None
    if any((b / path).exists() for b in bases):
        return None
    return f"{path!r} does not exist"


def _module_file(root: pathlib.Path, parts: list[str]) -> pathlib.Path | None:
    base = root.joinpath(*parts)
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    return None


@functools.cache
def defined_names(source: pathlib.Path) -> frozenset[str]:
    """The names a module defines or imports at any depth (functions, classes, assignments, imports,
    attributes set on `self`), read with `ast`: what `module.name` may refer to."""
    names = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return frozenset(names)


def check_dotted(name: str, root: pathlib.Path) -> str | None:
    """None if a dotted name that starts with a top-level package resolves; else why not."""
    parts = name.split(".")
    if parts[0] not in PACKAGES or not DOTTED.match(name):
        return None
    for n in range(len(parts), 0, -1):
        source = _module_file(root, parts[:n])
        if source is None:
            continue
        rest = parts[n:]
        if not rest:
            return None
        if len(rest) > 2:
            return f"{name!r}: {'.'.join(parts[:n])} has no module {rest[0]!r}"
        if rest[0] in defined_names(source):
            return None
        return f"{name!r}: {'.'.join(parts[:n])} ({source.relative_to(root)}) does not name {rest[0]!r}"
    return f"{name!r}: no module {parts[0]!r}"


def dead_references(text: str, doc_dir: pathlib.Path, root: pathlib.Path) -> list[str]:
    """Every dead repo path, launcher and module named in one doc's text."""
    problems = []
    for m in LAUNCH.finditer(text):
        module = m.group(1).rstrip(".")
        if not (root / "launch" / (module.split(".")[1] + ".py")).is_file():
            problems.append(f"python -m {module}: no launch/{module.split('.')[1]}.py")
    prose = _strip_code(text)
    for m in LINK.finditer(prose):
        if why := check_path(m.group(1), doc_dir, root, link=True):
            problems.append(why)
    for m in BACKTICK.finditer(prose):
        span = m.group(1).strip()
        if " " in span:
            continue
        why = check_dotted(span, root) if DOTTED.match(span) and not span.endswith(EXTENSIONS) else None
        why = why or check_path(span, doc_dir, root, link=False)
        if why:
            problems.append(why)
    return problems


@pytest.mark.parametrize("doc", DOCS)
def test_every_named_path_module_and_launcher_exists(doc):
    path = ROOT / doc
    problems = dead_references(path.read_text(), path.parent, ROOT)
    assert not problems, f"{doc} names things that do not exist:\n  " + "\n  ".join(problems)


def test_readme_and_workspace_stay_short():
    readme = (ROOT / "README.md").read_text().splitlines()
    workspace = (ROOT / "WORKSPACE.md").read_text().splitlines()
    assert len(readme) <= 160, f"README.md has {len(readme)} lines; move details to WORKSPACE.md or benchmarks/results/"
    assert len(workspace) <= 650, f"WORKSPACE.md has {len(workspace)} lines; move logs to benchmarks/results/"


def first_paragraph(text: str) -> str:
    """The first paragraph that is not a heading, a fence or a table."""
    for block in re.split(r"\n\s*\n", _strip_code(text)):
        block = block.strip()
        if block and not block.startswith(("#", "|", "```", "<", "!")):
            return block
    return ""


def test_readme_says_first_what_the_project_is():
    para = first_paragraph((ROOT / "README.md").read_text())
    assert "JAX" in para and "CodeDance" in para, (
        f"the README's first paragraph does not say what this is: {para[:200]!r}"
    )


# --- the checker, on synthetic docs: each rule is seen to fail ---


def test_checker_finds_dead_paths_and_passes_live_ones():
    doc_dir = ROOT / "benchmarks" / "results"
    good = (
        "See `codedance_jax/rl/rbat.py`, `tests/test_layering.py::test_x`, `data/toyworld/`, `vision.py`,\n"
        "[results](README.md), [the map](../../WORKSPACE.md), `WORKDIR/policy`, `train/loss`, `/tmp/x.py`,\n"
        "`{data_dir}/a/b.json`, `python -m launch.demo --x` and\n```bash\npython -m launch.sft\n`not/checked.py`\n```\n"
    )
    assert dead_references(good, doc_dir, ROOT) == []
    dead = {
        "`codedance_jax/rl/nothere.py`": "does not exist",
        "`benchmarks/results/no_such_run/`": "does not exist",
        "`nowhere_at_all.py`": "no file of that name",
        "`nosuchfolder/launcher.sh`": "no such top-level folder",
        "[gone](no_such_file.md)": "link target",
        "[gone](../../codedance_jax/missing.py)": "link target",
        "run `python -m launch.nothere --x`": "no launch/nothere.py",
        "`data.batching.collate`": "does not name 'batching'",
        "`codedance_jax.rl.not_a_function`": "does not name 'not_a_function'",
        "`runs.nothere.train_step`": "does not name 'nothere'",
    }
    for text, why in dead.items():
        problems = dead_references(text, doc_dir, ROOT)
        assert len(problems) == 1 and why in problems[0], (text, problems)


def test_dotted_names_resolve_to_the_longest_module_prefix():
    assert check_dotted("codedance_jax.rl.rbat_advantages", ROOT) is None  # package + attribute
    assert check_dotted("codedance_jax.train.batching.collate", ROOT) is None  # module + attribute
    assert check_dotted("eval.rollouts", ROOT) is None
    assert check_dotted("ModelConfig.toy", ROOT) is None  # not a package name: not checked
    assert "no module" in check_dotted("codedance_jax.rl.rbat.a.b.c", ROOT)


def test_first_paragraph_skips_headings_and_code():
    assert first_paragraph("# title\n\n```bash\nx\n```\n\nA JAX thing.\n\nMore.") == "A JAX thing."
    assert first_paragraph("# t\n\n## u\n") == ""
