"""Rollout prompts: the RL template of the paper (Table 10, SPEC section 2) in Qwen chat format.

The template's words live in `codedance_jax.protocol`; this module puts them in a chat message.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from codedance_jax.protocol import TurnFormat, rl_question, text_only_question


@dataclasses.dataclass
class Prompt:
    """One rollout prompt: chat text ending with the assistant header, one `<|image_pad|>` per image
    (unexpanded), and the images (PIL) in order. The sandbox session gets them as image.png,
    image_1.png, ..."""

    id: str
    text: str
    images: list[Any]


def rl_prompt(
    processor, prompt_id: str, question: str, images: Sequence[Any], fmt: str | TurnFormat = "code"
) -> Prompt:
    """The paper's RL prompt: the image(s), then `Question: {question}` and the instructions."""
    return _user_prompt(processor, prompt_id, rl_question(question, fmt), images)


def text_only_prompt(processor, prompt_id: str, question: str, images: Sequence[Any]) -> Prompt:
    """The prompt when no code can run: the question and the answer-only instruction."""
    return _user_prompt(processor, prompt_id, text_only_question(question), images)


def _user_prompt(processor, prompt_id: str, text: str, images: Sequence[Any]) -> Prompt:
    content = [{"type": "image"} for _ in images]
    content.append({"type": "text", "text": text})
    chat = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return Prompt(prompt_id, chat, list(images))


def session_files(images: Sequence[Any]) -> dict[str, bytes]:
    """The prompt images as PNG files for the trajectory's sandbox session."""
    import io

    files = {}
    for k, im in enumerate(images):
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        files["image.png" if k == 0 else f"image_{k}.png"] = buf.getvalue()
    return files
