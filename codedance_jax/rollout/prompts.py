"""Rollout prompts: the RL template of the paper (Table 10, SPEC section 2) in Qwen chat format."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from data.observation import TurnFormat, get_turn_format

RL_INSTRUCTION = {
    "code": (
        "Think step-by-step within <think></think>. You now have the ability to selectively write executable "
        "Python code to enhance your reasoning process. The Python code should be complete scripts, including "
        "necessary imports.\nEach code snippet is wrapped with\n<code>\n```python\ncode snippet\n```\n</code>\n"
        "You must provide your final answer in\n<answer> </answer>."
    ),
    # The release's format: the code travels as the argument of a Qwen tool call.
    "tool_call": (
        "Think step-by-step within <think></think>. You now have the ability to selectively write executable "
        "Python code to enhance your reasoning process. The Python code should be complete scripts, including "
        "necessary imports.\nEach code snippet is sent as a tool call\n<tool_call>\n"
        '{"name": "code_interpreter", "arguments": {"code": "code snippet"}}\n</tool_call>\n'
        "You must provide your final answer in\n<answer> </answer>."
    ),
}


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
    f = get_turn_format(fmt)
    content = [{"type": "image"} for _ in images]
    content.append({"type": "text", "text": f"Question: {question}\n{RL_INSTRUCTION[f.name]}"})
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return Prompt(prompt_id, text, list(images))


def session_files(images: Sequence[Any]) -> dict[str, bytes]:
    """The prompt images as PNG files for the trajectory's sandbox session."""
    import io

    files = {}
    for k, im in enumerate(images):
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        files["image.png" if k == 0 else f"image_{k}.png"] = buf.getvalue()
    return files
