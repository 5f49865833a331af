"""What the executed cells do: libraries and calls read from each cell's AST, per trajectory and group.

    calls = cell_calls(code)                     # CellCalls(calls=("PIL.Image.crop", "numpy.max", ...), ...)
    seen = sft_calls(["world/sft/sft.jsonl"])    # every call in the SFT data's code blocks
    a = analyze(records, keys=("family",), seen=seen)   # records: trajectories.jsonl rows
    curves = step_curves(grpo_records, seen=seen)       # per GRPO step, from the records' `policy`

The paper's "emergent behaviours" (crop, draw, enhance, compose) measured rather than shown:
which libraries a cell uses, which calls, which combinations per trajectory, and which calls never
appear in the SFT data (what RL found on its own). Computed from `trajectories.jsonl` records
(turns with `code` and `status`; a cell counts when it was executed), so any run that writes them
(the demo, GRPO, `launch.eval`) can be read.

Names are resolved through the cell's imports (`import numpy as np` -> `numpy`, `from PIL import
Image` -> `PIL.Image`) and a light type propagation along assignments, so that methods get their
library: `im = Image.open(...)` then `im.crop(...)` is `PIL.Image.crop`; `d = ImageDraw.Draw(im)`
then `d.rectangle(...)` is `PIL.ImageDraw.rectangle`; a numpy function's result, or a cv2 image
function's, is an array, and `a.max()` is `numpy.max` like `np.max(a)`. Builtins keep their bare
name (`print`); a method on a value of unknown type is `?.name` and belongs to no library. A cell
that does not parse counts as a cell with no calls (and in `parse_errors`).
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import json
import re
from collections.abc import Iterable, Mapping, Sequence

from codedance_jax.protocol import extract_code, get_turn_format

EXECUTED = ("ok", "error", "timeout", "crashed")  # as codedance_jax.rl.scoring counts executions
PIL_IMAGE, PIL_DRAW, NUMPY = "PIL.Image", "PIL.ImageDraw", "numpy"
# Calls whose result is a value of a known type (for the methods called on it afterwards).
_IMAGE_MAKERS = {"PIL.Image.open", "PIL.Image.fromarray", "PIL.Image.new", "PIL.ImageOps.autocontrast",
                 "PIL.ImageOps.equalize", "PIL.ImageOps.grayscale", "PIL.ImageOps.invert", "PIL.ImageOps.expand",
                 "PIL.ImageEnhance.enhance"}
_IMAGE_METHODS = {"convert", "crop", "resize", "rotate", "copy", "filter", "transpose", "point", "thumbnail"}
_ENHANCERS = {"PIL.ImageEnhance.Contrast", "PIL.ImageEnhance.Brightness", "PIL.ImageEnhance.Sharpness",
              "PIL.ImageEnhance.Color"}
_CV2_NON_ARRAYS = {"cv2.connectedComponents", "cv2.connectedComponentsWithStats", "cv2.findContours",
                   "cv2.imwrite", "cv2.minMaxLoc", "cv2.boundingRect", "cv2.contourArea"}
NUMPY_REDUCTIONS = {f"numpy.{n}" for n in ("sum", "mean", "max", "min", "argmax", "argmin", "any", "all", "median",
                                           "std", "var", "count_nonzero", "prod", "ptp", "nonzero", "unique")}
# The behaviours of the report's table: (label, predicate on a call name).
BEHAVIOURS = (
    ("crop", lambda c: c == "PIL.Image.crop"),
    ("resize / enlarge", lambda c: c in ("PIL.Image.resize", "cv2.resize")),
    ("draw", lambda c: c.startswith(PIL_DRAW + ".")),
    ("enhance", lambda c: c.startswith(("PIL.ImageEnhance.", "PIL.ImageOps.", "PIL.ImageFilter."))),
    ("numpy reduction", lambda c: c in NUMPY_REDUCTIONS),
    ("cv2", lambda c: c.startswith("cv2.")),
    ("matplotlib", lambda c: c.startswith("matplotlib.")),
)


@dataclasses.dataclass(frozen=True)
class CellCalls:
    calls: tuple[str, ...]  # distinct resolved call names, sorted
    libraries: tuple[str, ...]  # distinct libraries of those calls, sorted
    parsed: bool  # False: a syntax error (no calls)


def library(call: str) -> str | None:
    """`PIL.Image` / `PIL.ImageDraw` / ... for PIL, the top-level module otherwise; `builtins` for a
    bare name; None for a method of unknown type."""
    if call.startswith("?."):
        return None
    parts = call.split(".")
    if len(parts) == 1:
        return "builtins"
    if parts[0] == "PIL":
        return ".".join(parts[:2])
    return parts[0]


class _Resolver(ast.NodeVisitor):
    """Walks a module in source order, binding import aliases and the types of assigned names."""

    def __init__(self):
        self.names: dict[str, str] = {}  # name -> module path ("numpy") or value type ("PIL.Image")
        self.calls: set[str] = set()

    # -- bindings
    def visit_Import(self, node):
        for a in node.names:
            if a.asname:
                self.names[a.asname] = a.name
            else:
                root = a.name.split(".")[0]
                self.names[root] = root

    def visit_ImportFrom(self, node):
        if node.module and not node.level:
            for a in node.names:
                self.names[a.asname or a.name] = f"{node.module}.{a.name}"

    def _bind(self, target, typ):
        if isinstance(target, ast.Name):
            if typ is None:
                self.names.pop(target.id, None)
            else:
                self.names[target.id] = typ
        elif isinstance(target, ast.Tuple | ast.List):
            for t in target.elts:  # `ys, xs = np.nonzero(m)`: arrays; other unpacked results: unknown
                self._bind(t, typ if typ == NUMPY else None)

    def visit_Assign(self, node):
        self.visit(node.value)
        typ = self.type_of(node.value)
        for t in node.targets:
            self._bind(t, typ)

    def visit_AnnAssign(self, node):
        if node.value is not None:
            self.visit(node.value)
            self._bind(node.target, self.type_of(node.value))

    def visit_With(self, node):
        for item in node.items:
            self.visit(item.context_expr)
            if item.optional_vars is not None:
                self._bind(item.optional_vars, self.type_of(item.context_expr))
        for stmt in node.body:
            self.visit(stmt)

    # -- names and types
    def qualname(self, node) -> str | None:
        """A dotted name through the bindings (`np.linalg.norm` -> `numpy.linalg.norm`)."""
        if isinstance(node, ast.Name):
            return self.names.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.qualname(node.value) if isinstance(node.value, ast.Name | ast.Attribute) else self.type_of(node.value)
            return f"{base}.{node.attr}" if base else None
        return None

    def call_name(self, node: ast.Call) -> str:
        f = node.func
        if isinstance(f, ast.Name):
            return self.names.get(f.id, f.id)
        if isinstance(f, ast.Attribute):  # np.max(a) and a.max() are both numpy.max
            base = self.qualname(f.value) if isinstance(f.value, ast.Name | ast.Attribute) else self.type_of(f.value)
            return f"{base}.{f.attr}" if base else f"?.{f.attr}"
        return "?.<call>"

    def type_of(self, node) -> str | None:
        """PIL_IMAGE, PIL_DRAW, NUMPY (an array), a module path, or None."""
        if isinstance(node, ast.Name | ast.Attribute):
            q = self.qualname(node)
            return q if q in (PIL_IMAGE, PIL_DRAW, NUMPY) or (q and isinstance(node, ast.Name)) else None
        if isinstance(node, ast.Subscript):  # a slice of an array is an array
            return NUMPY if self.type_of(node.value) == NUMPY else None
        if isinstance(node, ast.BinOp | ast.Compare | ast.UnaryOp):
            parts = [node.left, node.right] if isinstance(node, ast.BinOp) else (
                [node.left, *node.comparators] if isinstance(node, ast.Compare) else [node.operand])
            return NUMPY if any(self.type_of(p) == NUMPY for p in parts) else None
        if not isinstance(node, ast.Call):
            return None
        name = self.call_name(node)
        method = name.rsplit(".", 1)[-1]
        if name in _IMAGE_MAKERS or (name.startswith(PIL_IMAGE + ".") and method in _IMAGE_METHODS):
            return PIL_IMAGE
        if name == "PIL.ImageDraw.Draw":
            return PIL_DRAW
        if name in _ENHANCERS:
            return "PIL.ImageEnhance"
        if name.startswith("numpy.") or (name.startswith("cv2.") and name not in _CV2_NON_ARRAYS):
            return NUMPY
        return None

    def visit_Call(self, node):
        self.calls.add(self.call_name(node))
        self.generic_visit(node)


def cell_calls(code: str) -> CellCalls:
    """The calls and libraries of one cell (module docstring)."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return CellCalls((), (), False)
    r = _Resolver()
    r.visit(tree)
    calls = tuple(sorted(r.calls))
    libs = tuple(sorted({lib for c in calls if (lib := library(c)) is not None}))
    return CellCalls(calls, libs, True)


def _get(rec, name, default=None):
    return rec.get(name, default) if isinstance(rec, Mapping) else getattr(rec, name, default)


def executed_cells(rec) -> list[str]:
    """The code of each executed turn of a trajectory record."""
    out = []
    for t in _get(rec, "turns") or []:
        if isinstance(t, Mapping) and t.get("status") in EXECUTED and isinstance(t.get("code"), str):
            out.append(t["code"])
    return out


def sft_cells(paths: Iterable[str], turn_format: str = "code") -> list[str]:
    """The code of every assistant call block in SFT trajectory JSONL files (`data.trajectory` records)."""
    fmt = get_turn_format(turn_format)
    out = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                for m in json.loads(line).get("messages", []):
                    text = m.get("content")
                    if m.get("role") == "assistant" and isinstance(text, str) and fmt.call_close in text:
                        block = extract_code(text, fmt)
                        if block.code is not None:
                            out.append(block.code)
    return out


def sft_calls(paths: Iterable[str], turn_format: str = "code") -> set[str]:
    """Every call name in the SFT data's cells."""
    return {c for code in sft_cells(paths, turn_format) for c in cell_calls(code).calls}


def _group_stats(recs: Sequence, seen: set[str] | None, top: int) -> dict:
    cells = calls_of = 0
    parse_errors = 0
    lib_cells: collections.Counter = collections.Counter()
    call_cells: collections.Counter = collections.Counter()
    beh_cells: collections.Counter = collections.Counter()
    beh_trajs: collections.Counter = collections.Counter()
    comps: collections.Counter = collections.Counter()
    novel: collections.Counter = collections.Counter()
    novel_cells = with_code = 0
    for r in recs:
        codes = executed_cells(r)
        if not codes:
            continue
        with_code += 1
        traj_libs, traj_beh = set(), set()
        for code in codes:
            cc = cell_calls(code)
            cells += 1
            parse_errors += not cc.parsed
            calls_of += len(cc.calls)
            lib_cells.update(cc.libraries)
            call_cells.update(cc.calls)
            beh = {label for label, pred in BEHAVIOURS if any(pred(c) for c in cc.calls)}
            beh_cells.update(beh)
            traj_beh |= beh
            traj_libs |= {lib for lib in cc.libraries if lib != "builtins"}
            if seen is not None:
                new = [c for c in cc.calls if c not in seen and not c.startswith("?.")]
                novel.update(new)
                novel_cells += bool(new)
        beh_trajs.update(traj_beh)
        comps["+".join(sorted(traj_libs)) or "(builtins only)"] += 1
    out = {
        "trajectories": len(recs),
        "with_code": with_code,
        "cells": cells,
        "parse_errors": parse_errors,
        "calls_per_cell": calls_of / cells if cells else None,
        "library_cell_rate": {k: v / cells for k, v in sorted(lib_cells.items())} if cells else {},
        "behaviour_cell_rate": {label: beh_cells[label] / cells for label, _ in BEHAVIOURS} if cells else {},
        "behaviour_trajectory_rate": ({label: beh_trajs[label] / with_code for label, _ in BEHAVIOURS}
                                      if with_code else {}),
        "top_calls": [[c, n] for c, n in call_cells.most_common(top)],
        "compositions": [[c, n / with_code] for c, n in comps.most_common(top)] if with_code else [],
    }
    if seen is not None:
        out["novel_calls"] = [[c, n] for c, n in novel.most_common(top)]
        out["novel_cell_rate"] = novel_cells / cells if cells else None
    return out


def analyze(records: Sequence, keys: Sequence[str] = ("family",), seen: set[str] | None = None, top: int = 8,
            metas: Sequence[Mapping] | None = None) -> dict:
    """{"all": stats, "family=count": stats, ...}: per group, the trajectories with code, cells,
    the share of cells using each library and behaviour (BEHAVIOURS), the share of trajectories
    with code showing each behaviour, the most used calls (by cells), the commonest library
    compositions per trajectory, and with `seen` (the SFT data's calls) the calls never seen
    there and the share of cells using one. `metas`: each record's metadata (default its `meta`)."""
    recs = list(records)
    if metas is None:
        metas = [dict(_get(r, "meta") or {}) for r in recs]
    out = {"all": _group_stats(recs, seen, top)}
    groups: dict[str, list[int]] = {}
    for i, m in enumerate(metas):
        for k in keys:
            groups.setdefault(f"{k}={m.get(k)}", []).append(i)
    for g, idx in sorted(groups.items()):
        out[g] = _group_stats([recs[i] for i in idx], seen, top)
    return out


_STEP_RE = re.compile(r"step_(\d+)$")


def record_step(rec) -> int | None:
    """The GRPO step (metrics.jsonl's `step`) of a rollout record: GRPO exports the sampling policy
    of loop index N as `.../policies/step_N`, and logs that step's row as step N + 1."""
    m = _STEP_RE.search(str(_get(rec, "policy") or "").rstrip("/"))
    return int(m.group(1)) + 1 if m else None


def step_curves(records: Sequence, seen: set[str] | None = None) -> list[dict]:
    """One row per GRPO step (records without a step are left out): `step`, `cells_per_traj`,
    `library/{lib}` (share of cells), `behaviour/{label}` (share of cells) and `novel_cell_rate`."""
    by_step: dict[int, list] = collections.defaultdict(list)
    for r in records:
        s = record_step(r)
        if s is not None:
            by_step[s].append(r)
    rows = []
    for s in sorted(by_step):
        st = _group_stats(by_step[s], seen, top=0)
        row = {"step": s, "cells_per_traj": st["cells"] / max(1, st["trajectories"])}
        row.update({f"library/{k}": v for k, v in st["library_cell_rate"].items()})
        row.update({f"behaviour/{k}": v for k, v in st["behaviour_cell_rate"].items()})
        if seen is not None:
            row["novel_cell_rate"] = st["novel_cell_rate"]
        rows.append(row)
    return rows


def read_records(path: str) -> list[dict]:
    """trajectories.jsonl rows (unreadable lines skipped)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict):
                    out.append(rec)
    return out
