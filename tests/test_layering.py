"""The layer order of WORKSPACE.md ("Layers"), checked on every import of the project's code.

Imports are read with `ast` from every module (including imports inside functions and under
`if TYPE_CHECKING`), resolved to project modules, and checked for three things:

1. no upward import: a module imports only from its own layer or below (`LAYERS`: one layer per
   top-level folder, no exceptions for subfolders);
2. no cycle between packages (a package = a subpackage such as `codedance_jax.rollout`, or a
   module directly under a top-level folder such as `codedance_jax.sharding` or `data.chat`);
3. no `_private` name imported from another module, and no `_private` module from another package.

Plus: `sandbox/` imports no JAX. The checker runs on synthetic sources too, so each rule is seen
to fail on a bad import.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# One row per top-level folder, bottom to top: a module may import from its own folder or any folder
# below it. No row names a subfolder: the folders are the layers.
LAYERS: dict[str, int] = {
    "sandbox": 0,  # standalone: the code sandbox (no JAX)
    "codedance_jax": 1,  # library core: model, processing, checkpoint, sharding, protocol, rl, rollout, train, serve, preflight
    "data": 2,  # data: trajectory format, chat rendering, TFDS, grain, RL prompts, the toy world
    "eval": 3,  # evaluation: benchmarks, scoring, the evaluation loop, reports
    "runs": 4,  # applications: the SFT / GRPO run loops, the demo, curation, the quickstart
    "configs": 5,
    "launch": 6,
    "benchmarks": 7,  # speed scripts may use anything
}
PACKAGES = tuple(LAYERS)
LAYER_NAMES = {0: "sandbox", 1: "library core", 2: "data", 3: "eval", 4: "applications", 5: "configs",
               6: "launch", 7: "benchmarks"}
NO_JAX = {"sandbox": ("jax", "jaxlib", "flax", "optax", "orbax")}


def layer_of(module: str) -> int:
    top = module.split(".")[0]
    if top not in LAYERS:
        raise KeyError(f"{module}: no layer in tests/test_layering.py LAYERS; add its top-level folder to the table")
    return LAYERS[top]


@dataclasses.dataclass(frozen=True)
class Import:
    src: str  # importing module
    target: str  # imported project module
    name: str | None  # the name taken from it (`from target import name`), None for `import target`
    line: int
    top: str  # the top-level package of a non-project import ("jax"), else ""


def module_name(path: pathlib.Path, root: pathlib.Path) -> tuple[str, bool]:
    parts = list(path.relative_to(root).with_suffix("").parts)
    is_pkg = parts[-1] == "__init__"
    if is_pkg:
        parts = parts[:-1]
    return ".".join(parts), is_pkg


def read_imports(src: str, is_pkg: bool, source: str, known: set[str]) -> list[Import]:
    """Every import statement of a module, anywhere in it, resolved against the `known` modules."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for a in node.names:
                out.append(_resolve(src, a.name, None, node.lineno, known))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = src.split(".") if is_pkg else src.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([node.module] if node.module else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in known:  # `from pkg import module`: an import of that module
                    out.append(_resolve(src, sub, None, node.lineno, known))
                else:
                    out.append(_resolve(src, base, a.name, node.lineno, known))
    return out


def _resolve(src: str, target: str, name: str | None, line: int, known: set[str]) -> Import:
    if target.split(".")[0] not in PACKAGES:
        return Import(src, "", name, line, target.split(".")[0])
    while target not in known and "." in target:  # `import pkg.attr` style: the deepest module that exists
        target = target.rsplit(".", 1)[0]
    return Import(src, target, name, line, "")


def package_of(module: str, packages: set[str]) -> str:
    """The cycle-check unit: the subpackage holding the module, or the module itself when it sits
    directly under a top-level folder (`codedance_jax.sharding`, `data.chat`)."""
    parts = module.split(".")
    if len(parts) <= 2:
        return module
    return ".".join(parts[:2]) if ".".join(parts[:2]) in packages else module


def dir_package(module: str, packages: set[str]) -> str:
    """The package (folder) a module belongs to, for the private-name rule."""
    return module if module in packages else module.rsplit(".", 1)[0] if "." in module else module


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(edges):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def check(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """Problems of a tree given as {module: (source, is_package)}; [] when it follows the rules."""
    known = set(sources)
    packages = {m for m, (_, is_pkg) in sources.items() if is_pkg}
    problems = []
    edges: dict[str, set[str]] = {}
    for src, (text, is_pkg) in sorted(sources.items()):
        for imp in read_imports(src, is_pkg, text, known):
            top = src.split(".")[0]
            if imp.top:
                if imp.top in NO_JAX.get(top, ()):
                    problems.append(f"{src}:{imp.line}: imports {imp.top}; {top}/ must run without JAX")
                continue
            if layer_of(imp.target) > layer_of(src):
                problems.append(
                    f"{src}:{imp.line}: {LAYER_NAMES[layer_of(src)]} imports {imp.target}, a higher layer "
                    f"({LAYER_NAMES[layer_of(imp.target)]}); move the shared piece down or the importer up"
                )
            private = (imp.name or "").startswith("_") and not (imp.name or "").startswith("__")
            private_mod = any(p.startswith("_") and not p.startswith("__") for p in imp.target.split("."))
            if private or (private_mod and dir_package(imp.target, packages) != dir_package(src, packages)):
                what = f"{imp.target}.{imp.name}" if imp.name else imp.target
                problems.append(f"{src}:{imp.line}: imports private {what} from another module; make it public")
            a, b = package_of(src, packages), package_of(imp.target, packages)
            if a != b:
                edges.setdefault(a, set()).add(b)
    cycle = find_cycle(edges)
    if cycle:
        problems.append("import cycle between packages: " + " -> ".join(cycle))
    return list(dict.fromkeys(problems))  # one line per import statement


def project_sources() -> dict[str, tuple[str, bool]]:
    out = {}
    for top in PACKAGES:
        for path in sorted((ROOT / top).rglob("*.py")):
            name, is_pkg = module_name(path, ROOT)
            out[name] = (path.read_text(encoding="utf-8"), is_pkg)
    return out


def test_project_follows_the_layers():
    problems = check(project_sources())
    assert not problems, "layering (WORKSPACE.md, Layers):\n" + "\n".join(problems)


def test_every_module_has_a_layer():
    for name in project_sources():
        layer_of(name)  # raises, naming the module


def test_the_layers_are_the_top_level_folders():
    """One row per top-level folder holding Python, and no row for a subfolder (no exemptions)."""
    assert all("." not in name for name in LAYERS), LAYERS
    folders = {p.parent.relative_to(ROOT).parts[0] for p in ROOT.glob("*/**/*.py")}
    folders -= {"tests", ".venv", ".venv-tpu", "workdirs", "tmp"}
    folders = {f for f in folders if not f.startswith(".")}
    assert folders == set(LAYERS), f"top-level folders {sorted(folders)} vs LAYERS {sorted(LAYERS)}"


def test_no_edge_runs_up_between_top_level_folders():
    """The folder-level graph: every edge goes to the same or a lower layer, so there is no cycle."""
    sources = project_sources()
    known = set(sources)
    edges = set()
    for src, (text, is_pkg) in sources.items():
        for imp in read_imports(src, is_pkg, text, known):
            if imp.target and imp.target.split(".")[0] != src.split(".")[0]:
                edges.add((src.split(".")[0], imp.target.split(".")[0]))
    up = sorted((a, b) for a, b in edges if LAYERS[b] > LAYERS[a])
    assert not up, up
    assert find_cycle({a: {b for x, b in edges if x == a} for a, _ in edges}) is None


def test_library_never_imports_configs_launch_or_toyworld():
    sources = project_sources()
    known = set(sources)
    for src, (text, is_pkg) in sources.items():
        if layer_of(src) != LAYERS["codedance_jax"]:
            continue
        for imp in read_imports(src, is_pkg, text, known):
            assert not imp.target.startswith(("configs", "launch", "data.toyworld")), (src, imp)


# ---------------------------------------------------------------- the checker fails on bad trees
def _tree(**mods: str) -> dict[str, tuple[str, bool]]:
    base = {"codedance_jax": ("", True), "codedance_jax.rollout": ("", True), "data": ("", True), "runs": ("", True),
            "data.toyworld": ("", True), "eval": ("", True), "sandbox": ("", True)}
    out = dict(base)
    for name, text in mods.items():
        out[name.replace("__", ".")] = (text, False)
    return out


def test_checker_accepts_a_clean_tree():
    tree = _tree(codedance_jax__protocol="X = 1", data__chat="from codedance_jax.protocol import X",
                 data__toyworld__expert="from data.chat import *\nfrom codedance_jax import protocol")
    assert check(tree) == []


@pytest.mark.parametrize("bad", [
    # each import the issue listed, in miniature
    ("codedance_jax.rollout.engine", "from data.observation import get_turn_format"),
    ("codedance_jax.rollout.turns", "def f():\n    from data import observation\n"),  # inside a function
    ("codedance_jax.train.grpo_loop", "import data.toyworld"),
    ("runs.demo.pipeline", "from configs import sft"),  # an application reading run configs
    ("eval.report", "from runs.demo import report"),
    ("codedance_jax.train.sft_loop", "def f():\n    from data import sft_pipeline, sft_tfds\n"),
])
def test_checker_rejects_an_upward_import(bad):
    src, text = bad
    tree = _tree(data__observation="x = 1", data__toyworld__world="x = 1", configs__sft="x = 1",
                 runs__demo__report="x = 1", data__sft_pipeline="x = 1", data__sft_tfds="x = 1")
    tree.update({"configs": ("", True), "runs.demo": ("", True), "codedance_jax.train": ("", True)})
    tree[src] = (text, False)
    problems = check(tree)
    assert any("a higher layer" in p and p.startswith(src) for p in problems), problems


def test_checker_rejects_a_private_import_across_modules():
    tree = _tree(eval__report="def _img(): pass", runs__demo__report="from eval.report import _img")
    tree["runs.demo"] = ("", True)
    problems = check(tree)
    assert any("private eval.report._img" in p for p in problems), problems
    # within one package too: a helper another module needs is public
    tree = _tree(eval__summary="def _fmt(): pass", eval__report="from eval.summary import _fmt")
    assert any("private eval.summary._fmt" in p for p in check(tree))
    tree = _tree(eval__summary="def fmt(): pass", eval__report="from eval.summary import fmt")
    assert check(tree) == []


def test_checker_rejects_a_cycle_between_packages():
    tree = _tree(codedance_jax__rollout__engine="from codedance_jax.train import batching",
                 codedance_jax__train__batching="from codedance_jax.rollout import engine")
    tree["codedance_jax.train"] = ("", True)
    problems = check(tree)
    assert any("import cycle" in p and "codedance_jax.rollout" in p for p in problems), problems


def test_checker_rejects_jax_in_the_sandbox():
    problems = check(_tree(sandbox__pool="def f():\n    import jax.numpy as jnp\n"))
    assert any("sandbox.pool:2: imports jax" in p for p in problems), problems


def test_test_modules_have_unique_names():
    """The test folders have no __init__.py, so pytest imports each test file by its basename: two
    files of one name (tests/sandbox/test_x.py, tests/serve/test_x.py) make the second an error."""
    seen: dict[str, pathlib.Path] = {}
    for p in sorted((ROOT / "tests").rglob("*.py")):
        other = seen.setdefault(p.name, p)
        assert other == p or p.name in ("conftest.py", "__init__.py"), f"{other} and {p} share a module name"
