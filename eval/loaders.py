"""Benchmark loaders: VLMEvalKit TSV files and the benchmarks' own releases, from local files only.

    items = load_benchmark("ChartQA", "/data/ChartQA_TEST.tsv")     # a file, or a directory holding one
    items[0].row       # VLMEvalKit-shaped fields: index, question, answer, A/B/..., question_type, ...
    items[0].images    # encoded image files (bytes), in order

Formats:
- **VLMEvalKit TSV** (every benchmark): `index`, `image` (base64; a list literal of base64 strings
  for several images; or, as VLMEvalKit stores duplicates, the `index` of the row that holds the
  image), or `image_path` (relative to the TSV); `question`, `answer`, option columns `A`, `B`, ...,
  and the benchmark's own columns. An empty cell is missing (pandas reads it as NaN).
- **The releases** (`.json` list or id->record dict, `.jsonl`, `.parquet` when pyarrow imports):
  CountBench (question + number), PixMo-Count (label + count), V* (`test_questions.jsonl`:
  text with `(A) ...` lines, label), HR-Bench parquet (TSV columns), ChartQA (`imgname`, `query`,
  `label`, images in `png/`), CharXiv (`reasoning_val.json`, images in `images/`), MathVista
  (`testmini.json` / parquet with `decoded_image`), MathVision (`test.jsonl` / parquet), MathVerse
  (`testmini.json`), WeMath (`testmini.json`: `option` "A. x;B. y", `ID`, `key`). Each is turned
  into the VLMEvalKit row that `eval.scoring.rule_score` reads (MathVista gets `answer_option`,
  MathVision `choices`, WeMath option columns, ...).

Images are kept as the file bytes they were stored as; `Item.pil_images()` decodes them (RGB).
Nothing is downloaded: a missing file raises FileNotFoundError naming the files looked for and where
they are published. Rows that cannot be read are an error naming the file and row, never skipped.
"""

from __future__ import annotations

import ast
import base64
import csv
import dataclasses
import glob
import io
import json
import os
import re
import sys
from collections.abc import Iterator
from typing import Any

from PIL import Image

from codedance_jax.errors import DataError, MissingPathError
from eval.benchmarks import Benchmark, get_benchmark, question_text


@dataclasses.dataclass
class Item:
    index: str
    row: dict  # VLMEvalKit-shaped fields without image data
    images: list[bytes]
    question: str  # the text asked after the image(s) (benchmarks.question_text)

    @property
    def answer(self) -> Any:
        return self.row.get("answer")

    def pil_images(self) -> list[Image.Image]:
        out = []
        for b in self.images:
            im = Image.open(io.BytesIO(b))
            im.load()
            out.append(im.convert("RGB"))
        return out


def load_benchmark(name: str, path: str | os.PathLike, limit: int | None = None) -> list[Item]:
    """Read benchmark `name` from `path` (a file, or a directory searched for the known file names)."""
    bench = get_benchmark(name)
    path = _resolve(bench, os.fspath(path))
    ext = path.lower().rsplit(".", 1)[-1]
    if ext == "tsv":
        rows = _read_tsv(path)
    else:
        rows = (_released_row(bench, rec, i, os.path.dirname(path), path) for i, rec in enumerate(_records(path)))
    items = []
    for row, images in rows:
        row.setdefault("index", str(len(items)))
        row["index"] = str(row["index"])
        if "answer" not in row or row["answer"] is None:
            raise DataError(
                f"{path}: item {row['index']}: no answer (field 'answer'); a benchmark file must hold the gold answers"
            )
        items.append(Item(row["index"], row, images, question_text(bench, row)))
        if limit and len(items) >= limit:
            break
    seen = set()
    for it in items:
        if it.index in seen:
            raise DataError(f"{path}: index {it.index!r} occurs twice; indices name items in predictions and resume")
        seen.add(it.index)
    return items


def _resolve(bench: Benchmark, path: str) -> str:
    if os.path.isfile(path):
        return path
    names = (bench.tsv, *bench.released)
    if os.path.isdir(path):
        for n in names:
            for cand in (os.path.join(path, n), os.path.join(path, bench.name, n)):
                if os.path.isfile(cand):
                    return cand
    raise MissingPathError(
        f"{bench.name}: no benchmark file at {path!r}. Expected VLMEvalKit's {bench.tsv} (published at "
        f"{bench.tsv_url}) or the release's {' / '.join(bench.released)} (from {bench.released_url}), given as "
        f"the file itself or a directory holding it. Nothing is downloaded: fetch it and set --config.data_path."
    )


# ----------------------------------------------------------------------------------- TSV


def _read_tsv(path: str) -> Iterator[tuple[dict, list[bytes]]]:
    csv.field_size_limit(sys.maxsize)
    base = os.path.dirname(path)
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    if rows and not {"index", "answer"} <= set(rows[0]):
        raise DataError(f"{path}: a VLMEvalKit TSV needs the columns index and answer; found {sorted(rows[0])[:12]}")
    by_index = {r["index"]: r.get("image") for r in rows}
    for n, r in enumerate(rows, 2):
        row = {k: (None if v == "" else v) for k, v in r.items() if k not in ("image", "image_path") and k is not None}
        try:
            if r.get("image"):
                images = [base64.b64decode(s) for s in _image_field(r["image"], by_index)]
            elif r.get("image_path"):
                images = [_read_file(os.path.join(base, p)) for p in _str_list(r["image_path"])]
            else:
                images = []
        except (ValueError, OSError) as e:
            raise DataError(f"{path}:{n}: cannot read the image of index {r.get('index')}: {e}") from e
        yield row, images


def _image_field(v: str, by_index: dict) -> list[str]:
    if len(v) <= 64 and v in by_index and by_index[v] and len(by_index[v]) > 64:  # VLMEvalKit's shared images
        v = by_index[v]
    return _str_list(v)


def _str_list(v: str) -> list[str]:
    if v.startswith("["):
        try:
            lst = ast.literal_eval(v)
            if isinstance(lst, list):
                return [str(x) for x in lst]
        except (ValueError, SyntaxError):
            pass
    return [v]


# ------------------------------------------------------------------------------- releases


def _records(path: str) -> Iterator[dict]:
    ext = path.lower().rsplit(".", 1)[-1]
    if ext == "parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ImportError(f"{path}: reading parquet needs pyarrow (pip install pyarrow), or use the TSV") from e
        for batch in pq.ParquetFile(path).iter_batches(batch_size=64):
            yield from batch.to_pylist()
    elif ext == "jsonl":
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except ValueError as e:
                        raise DataError(f"{path}:{n}: not a JSON object ({e})") from e
    elif ext == "json":
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if isinstance(data, dict):
            for k, v in data.items():
                yield {"_key": k, **v} if isinstance(v, dict) else v
        elif isinstance(data, list):
            yield from data
        else:
            raise DataError(f"{path}: expected a JSON list of records or an object of id -> record")
    else:
        raise DataError(f"{path}: unknown format .{ext}; expected .tsv (VLMEvalKit), .json, .jsonl or .parquet")


_IMAGE_DIRS = ("", "images", "png", "../images", "../png", "imgs")


def _read_file(p: str) -> bytes:
    with open(p, "rb") as f:
        return f.read()


def _find_image(base: str, rel: str) -> bytes:
    for d in _IMAGE_DIRS:
        p = os.path.normpath(os.path.join(base, d, rel))
        if os.path.isfile(p):
            return _read_file(p)
    raise MissingPathError(
        f"image {rel!r} not found under {base} (looked in {', '.join(d or '.' for d in _IMAGE_DIRS)})"
    )


def _image_value(v: Any, base: str) -> list[bytes]:
    if v is None:
        return []
    if isinstance(v, (list, tuple)):
        return [b for x in v for b in _image_value(x, base)]
    if isinstance(v, dict):  # HF datasets' Image feature: {"bytes": ..., "path": ...}
        if v.get("bytes"):
            return [bytes(v["bytes"])]
        return _image_value(v.get("path"), base)
    if isinstance(v, (bytes, bytearray)):
        return [bytes(v)]
    s = str(v)
    if len(s) > 256 and "/" not in s[:64]:
        return [base64.b64decode(s)]
    return [_find_image(base, s)]


def _first(rec: dict, *keys, default=None):
    for k in keys:
        if k in rec and rec[k] is not None and rec[k] != "":
            return rec[k]
    return default


_OPTION_LINE = re.compile(r"^\s*\(([A-Z])\)\s*(.*?)\s*$")
_WEMATH_OPTION = re.compile(r"(?:^|;)\s*([A-H])[.．:]\s*")


def _released_row(bench: Benchmark, rec: dict, i: int, base: str, path: str) -> tuple[dict, list[bytes]]:
    try:
        return _adapt(bench, dict(rec), i, base)
    except (KeyError, ValueError, OSError) as e:
        raise DataError(
            f"{path}: record {i}: {type(e).__name__}: {e} (expected {bench.name}'s released fields; "
            f"see eval/loaders.py)"
        ) from e


def _adapt(bench: Benchmark, rec: dict, i: int, base: str) -> tuple[dict, list[bytes]]:
    name = bench.name
    image_keys = ("decoded_image", "image", "image_path", "imgname")
    images = []
    for k in image_keys:
        if rec.get(k) is not None and rec.get(k) != "":
            images = _image_value(rec[k], base)
            break
    row = {k: v for k, v in rec.items() if k not in image_keys and not isinstance(v, (bytes, bytearray))}
    row["index"] = _first(rec, "index", "_key", "pid", "sample_index", "question_id", "id", default=i)
    row.pop("_key", None)
    if name in ("CountBenchQA", "PixmoCount"):
        row["answer"] = _first(rec, "answer", "number", "count")
        if not _first(rec, "question"):
            if not rec.get("label"):
                raise KeyError("question (or label, to ask 'How many {label} are there in this image?')")
            row["question"] = f"How many {rec['label']} are there in this image?"
        if not images and rec.get("image_sha256"):
            hits = [p for d in _IMAGE_DIRS for p in glob.glob(os.path.join(base, d, rec["image_sha256"] + ".*"))]
            if not hits:
                raise MissingPathError(
                    f"no image file {rec['image_sha256']}.* under {base} (PixMo-Count's release "
                    f"lists image URLs: download them and name each by its image_sha256)"
                )
            images = [_read_file(hits[0])]
    elif name == "VStarBench":
        text = str(_first(rec, "question", "text"))
        q_lines, opts = [], {}
        for line in text.split("\n"):
            m = _OPTION_LINE.match(line)
            if m:
                opts[m.group(1)] = m.group(2)
            elif "answer with the option" not in line.lower():
                q_lines.append(line)
        row.update(opts)
        row["question"] = "\n".join(q_lines).strip()
        row["answer"] = _first(rec, "answer", "label")
    elif name == "ChartQA":
        row["question"] = _first(rec, "question", "query")
        row["answer"] = _first(rec, "answer", "label")
    elif name == "CharXiv":
        row["question"] = _first(rec, "question", "query", "raw_question")
        if not images:
            key = str(row["index"])
            images = [_find_image(base, f"{key}.jpg")]
    elif name == "MathVista":
        row["question"] = _first(rec, "query", "question")
        choices = rec.get("choices")
        if isinstance(choices, str):
            choices = ast.literal_eval(choices)
        if choices is not None and len(choices):
            choices = [str(c) for c in choices]
            row["choices"] = repr(choices)
            if "answer_option" not in row:
                ans = str(rec["answer"])
                row["answer_option"] = chr(65 + choices.index(ans)) if ans in choices else None
    elif name == "MathVision":
        opts = rec.get("options", rec.get("choices")) or []
        if isinstance(opts, str):
            opts = ast.literal_eval(opts)
        row["choices"] = repr([str(o) for o in opts])
        row.setdefault("category", rec.get("subject"))
        q = str(rec["question"])
        if opts and "(A)" not in q:
            q += "\nChoices:\n" + "\n".join(f"({chr(65 + k)}) {o}" for k, o in enumerate(opts))
        row["question"] = q
    elif name == "MathVerse":
        row["question"] = _first(rec, "query_wo", "question")
        for k in ("metadata",):
            if isinstance(row.get(k), dict):
                row[k] = json.dumps(row[k])
    elif name == "WeMath":
        row["index"] = _first(rec, "index", default=i)
        opt = rec.get("option")
        if opt and not any(ch in rec for ch in "ABCD"):
            parts = _WEMATH_OPTION.split(str(opt))
            for letter, text in zip(parts[1::2], parts[2::2], strict=True):
                row[letter] = text.strip().rstrip(";").strip()
    for k, v in list(row.items()):
        if isinstance(v, (list, dict)):
            row[k] = json.dumps(v)
    return row, images
