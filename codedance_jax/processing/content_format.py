"""Which message content a chat template expects: a string, or a list of parts.

Chat templates come in two kinds. The Qwen2.5-VL template iterates over `message['content']`
parts (`{"type": "text", "text": ...}`, `{"type": "image"}`); the text-only Qwen templates use
`message['content']` as a string (`+` it, call `.startswith` on it), and a list there fails
(`'list object' has no attribute 'startswith'`). `detect(template)` tells the two apart the way
vLLM does (`_detect_content_format`): it parses the template and looks for a `for` loop over the
content of a message taken from `messages`, following variables assigned from either. A template
that does not parse keeps the list form (what transformers passes).

`to_string_content(messages)` is what a string template then gets: each list of parts joined in
order, text as is and each image (video) as the `<|vision_start|><|image_pad|><|vision_end|>`
block the Qwen2.5-VL template writes for it, with nothing between parts, as that template joins
them. So a conversation renders to the same tokens under either kind of template. (vLLM joins
text parts with newlines and puts the image placeholders first; here the Qwen2.5-VL template's own
rendering decides.)
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

IMAGE_BLOCK = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_BLOCK = "<|vision_start|><|video_pad|><|vision_end|>"
ContentFormat = Literal["string", "list"]


@functools.lru_cache(maxsize=64)
def detect(template: str) -> ContentFormat:
    """'list' when the template loops over a message's content parts, else 'string'."""
    import jinja2
    import jinja2.ext

    try:
        ast = jinja2.Environment(extensions=[jinja2.ext.loopcontrols]).parse(template)
    except jinja2.TemplateSyntaxError:
        return "list"
    return "list" if any(True for _ in _content_loops(ast)) else "string"


def to_string_content(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages with every list of content parts joined into one string (see the module doc)."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            m = {**m, "content": "".join(_part_text(p) for p in content)}
        out.append(m)
    return out


def _part_text(part: Any) -> str:
    if isinstance(part, str):
        return part
    if not isinstance(part, Mapping):
        return ""
    kind = part.get("type")
    if kind == "image" or "image" in part or "image_url" in part:
        return IMAGE_BLOCK
    if kind == "video" or "video" in part:
        return VIDEO_BLOCK
    text = part.get("text")
    return text if isinstance(text, str) else ""


# ---- the template's AST (after vLLM's chat_utils) --------------------------------------------


def _is_name(node, name: str) -> bool:
    import jinja2.nodes as n

    return isinstance(node, n.Name) and node.ctx == "load" and node.name == name


def _is_key(node, name: str, key: str) -> bool:
    """`name['key']` or `name.key`."""
    import jinja2.nodes as n

    if isinstance(node, n.Getitem):
        return _is_name(node.node, name) and isinstance(node.arg, n.Const) and node.arg.value == key
    if isinstance(node, n.Getattr):
        return _is_name(node.node, name) and node.attr == key
    return False


def _reads(node, name: str, key: str | None = None) -> bool:
    """`name` (or `name[key]`), possibly through filters, tests or slices (`messages[1:]`, `x | list`)."""
    import jinja2.nodes as n

    if isinstance(node, (n.Filter, n.Test)) and node.node is not None:
        return _reads(node.node, name, key)
    if isinstance(node, n.Getitem) and isinstance(node.arg, n.Slice):
        return _reads(node.node, name, key)
    return _is_key(node, name, key) if key else _is_name(node, name)


def _aliases(ast, name: str) -> list[str]:
    """`name` and every variable assigned from it (`{% set msgs = messages[1:] %}`), transitively."""
    import jinja2.nodes as n

    found, todo = [name], [name]
    while todo:
        cur = todo.pop()
        for assign in ast.find_all(n.Assign):
            if isinstance(assign.target, n.Name) and _reads(assign.node, cur) and assign.target.name not in found:
                found.append(assign.target.name)
                todo.append(assign.target.name)
    return found


def _content_loops(ast) -> Iterator[Any]:
    """`{% for part in message['content'] %}` loops, `message` a loop variable over `messages`."""
    import jinja2.nodes as n

    lists = _aliases(ast, "messages")
    message_vars = [loop.target.name for loop in ast.find_all(n.For)
                    if isinstance(loop.target, n.Name) and any(_reads(loop.iter, v) for v in lists)]
    messages = [v for m in message_vars for v in _aliases(ast, m)]
    # {% set content = message['content'] %}{% for part in content %} counts too
    contents = [a.target.name for a in ast.find_all(n.Assign)
                if isinstance(a.target, n.Name) and any(_reads(a.node, m, "content") for m in messages)]
    contents = [v for c in contents for v in _aliases(ast, c)]
    for loop in ast.find_all(n.For):
        if any(_reads(loop.iter, m, "content") for m in messages) or any(_reads(loop.iter, c) for c in contents):
            yield loop
