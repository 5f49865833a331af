"""OpenAI chat messages -> the Qwen chat template text and the images, in order.

Content is a string or a list of parts: `{"type": "text", "text": ...}` and
`{"type": "image_url", "image_url": {"url": ...}}` where the URL is a `data:image/...;base64,`
URL, a `file://` URL or a local path (the server reads files the user running it can read; it
never fetches remote URLs). Each image part becomes one `<|vision_start|><|image_pad|><|vision_end|>`
block where it stands, as the checkpoint's own chat template writes it.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from collections.abc import Sequence
from typing import Any

from PIL import Image

from codedance_jax.serve.errors import APIError

ROLES = ("system", "user", "assistant", "tool")


def load_image(url: str, where: str, local_images: bool = True) -> Image.Image:
    """A PIL RGB image from a data URL, a file:// URL or a local path (400 with the reason if not)."""
    if not isinstance(url, str) or not url:
        raise APIError(400, f"{where}: image_url.url must be a non-empty string", param=where, code="invalid_image")
    if url.startswith(("http://", "https://")):
        raise APIError(400, f"{where}: remote image URLs are not fetched by this server; send the image as a "
                       "data:image/...;base64, URL or a local file path", param=where, code="invalid_image")
    if not url.startswith("data:") and not local_images:
        raise APIError(400, f"{where}: this server reads images from data: URLs only (started with "
                       "--nolocal_images)", param=where, code="invalid_image")
    try:
        if url.startswith("data:"):
            header, _, payload = url.partition(",")
            if ";base64" not in header:
                raise ValueError("only base64 data URLs are supported (data:image/png;base64,...)")
            raw = base64.b64decode(payload, validate=True)
            img = Image.open(io.BytesIO(raw))
        else:
            path = url[len("file://"):] if url.startswith("file://") else url
            if not os.path.isfile(path):
                raise ValueError(f"no such file: {path}")
            img = Image.open(path)
        img.load()
        if img.width < 1 or img.height < 1:
            raise ValueError("the image is empty")
        return img.convert("RGB")
    except (ValueError, OSError, binascii.Error, Image.DecompressionBombError) as e:
        raise APIError(400, f"{where}: cannot read the image ({e})", param=where, code="invalid_image") from e


def render(processor, messages: Sequence[Any], *, add_generation_prompt: bool = True,
           rewrite_last_user=None, local_images: bool = True) -> tuple[str, list[Image.Image]]:
    """(chat text ending with the assistant header, images in order of appearance).

    `rewrite_last_user(text) -> text`: applied to the text of the last user message (agent mode
    wraps the question in the RL template there)."""
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
                parts.append({"type": "text", "text": str(_get(part, "text") or "")})
            elif kind == "image_url":
                iu = _get(part, "image_url")
                url = iu if isinstance(iu, str) else _get(iu, "url")
                images.append(load_image(url, where, local_images))
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
