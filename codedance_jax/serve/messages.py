"""OpenAI chat messages -> the Qwen chat template text and the images, in order.

Content is a string or a list of parts: `{"type": "text", "text": ...}` and
`{"type": "image_url", "image_url": {"url": ...}}` where the URL is a `data:image/...;base64,`
URL, or a local path / `file://` URL under the directories the operator allows (`media.py` says
which files are read and how images are decoded; remote URLs are never fetched). Each image part becomes one `<|vision_start|><|image_pad|><|vision_end|>`
block where it stands, as the checkpoint's own chat template writes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from PIL import Image

from codedance_jax.serve.errors import APIError
from codedance_jax.serve.media import DEFAULT_MAX_PIXELS, LocalMedia, load_image

ROLES = ("system", "user", "assistant", "tool")


def render(processor, messages: Sequence[Any], *, add_generation_prompt: bool = True,
           rewrite_last_user=None, local: LocalMedia | None = None,
           max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[str, list[Image.Image]]:
    """(chat text ending with the assistant header, images in order of appearance).

    `rewrite_last_user(text) -> text`: applied to the text of the last user message (agent mode
    wraps the question in the RL template there). `local`: the local files clients may name
    (none by default)."""
    if not messages:
        raise APIError(400, "messages must hold at least one message", param="messages")
    conv, images = [], []
    last_user = max((k for k, m in enumerate(messages) if _get(m, "role") == "user"), default=None)
    for k, m in enumerate(messages):
        role = _get(m, "role")
        if role == "developer":
            role = "system"
        if role not in ROLES:
            raise APIError(400, f"messages[{k}].role must be one of {', '.join(ROLES)}; got {role!r}",
                           param=f"messages[{k}].role")
        content = _get(m, "content")
        parts = []
        if content is None:
            content = []
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise APIError(400, f"messages[{k}].content must be a string or a list of parts", param=f"messages[{k}].content")
        for j, part in enumerate(content):
            where = f"messages[{k}].content[{j}]"
            kind = _get(part, "type")
            if kind == "text":
                text = _get(part, "text")
                if not isinstance(text, str):
                    raise APIError(400, f"{where}.text must be a string", param=where)
                parts.append({"type": "text", "text": text})
            elif kind == "image_url":
                iu = _get(part, "image_url")
                url = iu if isinstance(iu, str) else _get(iu, "url")
                images.append(load_image(url, where, local, max_pixels))
                parts.append({"type": "image"})
            else:
                raise APIError(400, f"{where}.type must be 'text' or 'image_url'; got {kind!r}", param=where)
        if k == last_user and rewrite_last_user is not None:
            text = "\n".join(p["text"] for p in parts if p["type"] == "text")
            parts = [p for p in parts if p["type"] != "text"] + [{"type": "text", "text": rewrite_last_user(text)}]
        conv.append({"role": role, "content": parts})
    text = processor.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)
    return text, images


def _get(obj, key):
    if isinstance(obj, dict):
        return obj.get(key)
    return getattr(obj, key, None)
