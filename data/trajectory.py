"""The SFT trajectory format (JSON lines): parsing, validation, and the malformed-record report.

One trajectory per line:

    {"id": "chart-0017",
     "images": ["images/chart-0017.png", "images/chart-0017-crop1.png"],
     "messages": [
       {"role": "system", "content": "..."},                      # optional, first only
       {"role": "user", "content": "<image>\\nQuestion: ..."},
       {"role": "assistant", "content": "<think>...</think>\\n<code>\\n```python\\n...\\n```\\n</code>"},
       {"role": "observation", "content": "stdout / stderr text", "num_images": 1},
       {"role": "assistant", "content": "<think>...</think>\\n<answer>42</answer>"}]}

Images: `images` lists every image of the trajectory once, in order of appearance, as paths
relative to the JSONL file's directory (absolute paths also work). A `user` message places its
images with `<image>` markers in its content; an `observation` says how many images it carries
with `num_images` (they follow the `</interpreter>` tag, as the observation format fixes). Markers
and observations consume `images` in order; the counts must match exactly. `<image>` is literal
text in assistant and observation content.

Order: an optional `system` message first; then `user`; then alternating `assistant` and
`user`/`observation` turns; the last message is an `assistant` message. `observation` follows an
`assistant` message (the code turn it answers).

Malformed records raise `RecordError(kind, ...)`; readers count them in a `DataReport` with file
and line, or stop with `MalformedRecordError` (`on_error="stop"`), whose message names the fix.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import json
import os
import re
from collections.abc import Iterable, Iterator
from typing import Any

from PIL import Image

from codedance_jax.errors import DataError

IMAGE_MARKER = "<image>"
ROLES = ("system", "user", "assistant", "observation")
# Chat-structure and vision tokens: inside content they would corrupt turns or image counts.
RESERVED = (
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|vision_pad|>",
)

# kind -> how to fix it (part of every error message).
FIXES = {
    "bad_json": "each line must be one JSON object (no trailing commas, no pretty-printing over several lines)",
    "bad_encoding": "the file must be UTF-8 text, one JSON object per line (is it a binary or compressed file?)",
    "bad_field": "a record needs 'id' (str), 'images' (list of str) and 'messages' (list of {role, content})",
    "unknown_role": f"roles are {', '.join(ROLES)}",
    "bad_order": "system? user (assistant (user|observation))* assistant; an observation follows an assistant turn",
    "no_assistant": "a trajectory needs at least one assistant message: only assistant tokens are trained",
    "special_token": "remove chat/vision special tokens from the content; images are placed with <image> markers",
    "missing_image": "image paths are relative to the directory of the JSONL file",
    "bad_image": "the image file must be readable by PIL (PNG, JPEG, ...)",
    "too_many_placeholders": "each <image> marker / observation num_images needs its own entry in 'images'",
    "unused_images": "every entry of 'images' must be placed by a <image> marker or an observation's num_images",
    "too_long": "add a larger bucket, raise the limits, or shorten the trajectory",
}
ERROR_KINDS = tuple(FIXES)


class RecordError(ValueError):
    """One malformed record: `kind` (a key of FIXES) and what exactly is wrong."""

    def __init__(self, kind: str, detail: str):
        assert kind in FIXES, kind
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail


class MalformedRecordError(DataError):
    """Raised in stop mode: names the file, the line, the problem and the fix."""


@dataclasses.dataclass(frozen=True)
class Message:
    role: str
    content: str
    num_images: int = 0  # user: count of <image> markers; observation: its images; else 0


@dataclasses.dataclass(frozen=True)
class Trajectory:
    """A validated trajectory. `images` holds encoded image bytes (PNG after `load_images`)."""

    id: str
    messages: tuple[Message, ...]
    images: tuple[bytes, ...]
    source: str  # "path:line", for reports


@dataclasses.dataclass(frozen=True)
class Problem:
    file: str
    line: int
    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.kind}: {self.detail} (fix: {FIXES[self.kind]})"


@dataclasses.dataclass
class DataReport:
    """Counts of good and malformed records; `problems` keeps the first `max_problems` in full."""

    num_ok: int = 0
    counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    problems: list[Problem] = dataclasses.field(default_factory=list)
    max_problems: int = 1000

    @property
    def num_malformed(self) -> int:
        return sum(self.counts.values())

    def add(self, problem: Problem) -> None:
        self.counts[problem.kind] += 1
        if len(self.problems) < self.max_problems:
            self.problems.append(problem)

    def summary(self, max_lines: int = 20) -> str:
        """The counts and the first `max_lines` problems as `file:line: kind: detail (fix: ...)`."""
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.counts.items())) or "none"
        lines = [f"{self.num_ok} records ok, {self.num_malformed} malformed ({kinds})"]
        lines += [f"  {p}" for p in self.problems[:max_lines]]
        if self.num_malformed > max_lines:
            lines.append(f"  ... {self.num_malformed - max_lines} more")
        return "\n".join(lines)

    def check_usable(self, what: str) -> None:
        """Raise `DataError` when no record is usable: the count, the first problem and the fix."""
        if self.num_ok:
            return
        if not self.num_malformed:
            raise DataError(f"{what}: no records (empty files)", "give JSONL files with one trajectory per line")
        first = self.problems[0] if self.problems else Problem("?", 0, "bad_field", "not kept (max_problems=0)")
        raise DataError(
            f"{what}: all {self.num_malformed} records are malformed, e.g. {first.file}:{first.line}: {first.kind}: "
            f"{first.detail}",
            f"{FIXES[first.kind]}; nothing was built",
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "num_ok": self.num_ok,
            "num_malformed": self.num_malformed,
            "counts": dict(self.counts),
            "problems": [dataclasses.asdict(p) for p in self.problems],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DataReport:
        return cls(d["num_ok"], collections.Counter(d["counts"]), [Problem(**p) for p in d["problems"]])


def handle_problem(problem: Problem, report: DataReport, on_error: str) -> None:
    """Count `problem` in `report`; in stop mode raise it as a `MalformedRecordError`."""
    if on_error not in ("skip", "stop"):
        raise ValueError(f"on_error must be 'skip' or 'stop', got {on_error!r}")
    report.add(problem)
    if on_error == "stop":
        raise MalformedRecordError(f"{problem}. Pass on_error='skip' to skip and count such records instead.")


def _check_content(content: Any, i: int) -> str:
    if not isinstance(content, str):
        raise RecordError("bad_field", f"messages[{i}].content must be a string, got {type(content).__name__}")
    for tok in RESERVED:
        if tok in content:
            raise RecordError("special_token", f"messages[{i}].content contains {tok!r}")
    return content


def parse_record(obj: Any) -> tuple[str, list[str], list[Message]]:
    """Validate one decoded JSON value; returns (id, image paths, messages) or raises RecordError."""
    if not isinstance(obj, dict):
        raise RecordError("bad_json", f"expected a JSON object, got {type(obj).__name__}")
    rid = obj.get("id")
    if not isinstance(rid, str) or not rid:
        raise RecordError("bad_field", f"'id' must be a non-empty string, got {rid!r}")
    paths = obj.get("images", [])
    if not isinstance(paths, list) or not all(isinstance(p, str) and p for p in paths):
        raise RecordError("bad_field", "'images' must be a list of non-empty path strings")
    raw = obj.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RecordError("bad_field", "'messages' must be a non-empty list")
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or "role" not in m:
            raise RecordError("bad_field", f"messages[{i}] must be an object with 'role' and 'content'")
        role = m["role"]
        if role not in ROLES:
            raise RecordError("unknown_role", f"messages[{i}].role is {role!r}")
        content = _check_content(m.get("content"), i)
        n = m.get("num_images", 0)
        if role == "observation":
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise RecordError("bad_field", f"messages[{i}].num_images must be a non-negative integer, got {n!r}")
        elif n:
            raise RecordError("bad_field", f"messages[{i}]: num_images is for observations; {role} uses <image>")
        if role == "user":
            n = content.count(IMAGE_MARKER)
        elif role != "observation":
            n = 0
        messages.append(Message(role, content, n))
    roles = [m.role for m in messages]
    if "assistant" not in roles:
        raise RecordError("no_assistant", f"roles are {roles}")
    body = roles[1:] if roles[0] == "system" else roles
    if "system" in body:
        raise RecordError("bad_order", f"'system' may only be the first message; roles are {roles}")
    if not body or body[0] != "user":
        raise RecordError("bad_order", f"the first non-system message must be 'user'; roles are {roles}")
    for a, b in zip(body, body[1:], strict=False):
        if (a == "assistant") == (b == "assistant"):
            raise RecordError("bad_order", f"assistant and user/observation turns must alternate; roles are {roles}")
        if b == "observation" and a != "assistant":
            raise RecordError("bad_order", f"an observation must follow an assistant turn; roles are {roles}")
    if body[-1] != "assistant":
        raise RecordError(
            "bad_order", f"the last message must be 'assistant' (nothing after it is trained); roles are {roles}"
        )
    placed = sum(m.num_images for m in messages)
    if placed > len(paths):
        raise RecordError("too_many_placeholders", f"{placed} image placeholders but {len(paths)} images")
    if placed < len(paths):
        raise RecordError("unused_images", f"{len(paths)} images but only {placed} placeholders")
    return rid, paths, messages


def load_image_png(path: str) -> bytes:
    """The file's bytes if it is a PNG, else the image re-encoded as PNG; RecordError if unreadable."""
    if not os.path.isfile(path):
        raise RecordError("missing_image", f"{path} does not exist")
    with open(path, "rb") as f:
        data = f.read()
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            if im.format == "PNG":
                return data
            buf = io.BytesIO()
            im.save(buf, format="PNG")
            return buf.getvalue()
    except Exception as e:  # PIL raises many types for bad files
        raise RecordError("bad_image", f"{path}: {type(e).__name__}: {e}") from e


_NOT_UTF8 = re.compile("[\udc80-\udcff]")  # what errors="surrogateescape" makes of a byte that is not UTF-8


def parse_line(line: str, file: str, lineno: int, *, load_images: bool = True) -> Trajectory:
    """One JSONL line -> Trajectory (images read and PNG-encoded when `load_images`). A line read
    with errors="surrogateescape" whose bytes were not UTF-8 is a `bad_encoding` record."""
    bad = _NOT_UTF8.search(line)
    if bad:
        raise RecordError("bad_encoding", f"byte 0x{ord(bad.group()) - 0xDC00:02x} at column {bad.start() + 1} "
                                          "is not UTF-8")
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise RecordError("bad_json", f"{e.msg} at column {e.colno}") from e
    rid, paths, messages = parse_record(obj)
    base = os.path.dirname(os.path.abspath(file))
    images = tuple(load_image_png(os.path.join(base, p)) for p in paths) if load_images else ()
    return Trajectory(rid, tuple(messages), images, f"{file}:{lineno}")


def read_jsonl(
    paths: Iterable[str | os.PathLike],
    *,
    on_error: str = "skip",
    report: DataReport | None = None,
    load_images: bool = True,
) -> Iterator[Trajectory]:
    """Yield valid trajectories from JSONL files; malformed ones are counted in `report`
    (skip mode) or raise `MalformedRecordError` (stop mode). Blank lines are ignored."""
    report = DataReport() if report is None else report
    for path in paths:
        path = os.fspath(path)
        # Bytes that are not UTF-8 become lone surrogates, so a binary line is one bad record
        # (counted like any malformed line) instead of a UnicodeDecodeError for the whole file.
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    traj = parse_line(line, path, lineno, load_images=load_images)
                except RecordError as e:
                    handle_problem(Problem(path, lineno, e.kind, e.detail), report, on_error)
                    continue
                report.num_ok += 1
                yield traj
