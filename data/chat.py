"""Render a trajectory to Qwen chat text and tokenize it once, with a per-token assistant flag.

The rendered text is what `Processor.apply_chat_template` gives for the same conversation
(default system prompt when none is given, observations as user turns whose body comes from
`codedance_jax.protocol`), with each `<|image_pad|>` already expanded to the image's token count. The
whole text is tokenized in one call, so token boundaries are exactly those of inference (no drift
from tokenizing segments separately); each token then takes its role from the character at its
start offset.

Trained characters: each assistant message's content and its closing `<|im_end|>`. Not trained:
system and user turns, role headers (`<|im_start|>assistant\\n`), the newline after `<|im_end|>`,
observations. A token whose span starts in an untrained character is untrained even if it reaches
into assistant content: byte-level BPE merges whitespace, so content that begins with a newline
shares a token with the header's newline; that token is not trained.

In SFT the `<|im_end|>` that closes a code turn is trained (the model learns to end its turn after
`</code>`); in rollouts the engine stops at the call's closing tag and the observation string
supplies that `<|im_end|>`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from codedance_jax import protocol as observation
from codedance_jax.protocol import IM_END, IM_START, TurnFormat
from data.trajectory import IMAGE_MARKER, Message

DEFAULT_SYSTEM = "You are a helpful assistant."  # what the Qwen2.5-VL template inserts


@dataclasses.dataclass(frozen=True)
class Rendered:
    text: str
    spans: tuple[tuple[int, int], ...]  # [start, end) character spans of trained text


def render(
    messages: Sequence[Message],
    image_tokens: Sequence[int] | None = None,
    fmt: str | TurnFormat = observation.CODE,
) -> Rendered:
    """Chat text of `messages` and the spans of assistant (trained) characters.

    `image_tokens`: placeholder count of each image in order of appearance (expanded text), or
    None for one unexpanded `<|image_pad|>` per image (what `apply_chat_template` gives).
    """
    parts: list[str] = []
    spans: list[tuple[int, int]] = []
    pos = 0
    counts = list(image_tokens) if image_tokens is not None else None
    k = 0

    def take(n: int) -> list[int]:
        nonlocal k
        if counts is None:
            return [1] * n
        if k + n > len(counts):
            raise ValueError(f"the messages place more images than the {len(counts)} given")
        out = counts[k : k + n]
        k += n
        return out

    def emit(s: str, trained: bool = False) -> None:
        nonlocal pos
        if trained:
            spans.append((pos, pos + len(s)))
        parts.append(s)
        pos += len(s)

    if not messages or messages[0].role != "system":
        emit(f"{IM_START}system\n{DEFAULT_SYSTEM}{IM_END}\n")
    for m in messages:
        if m.role == "assistant":
            emit(f"{IM_START}assistant\n")
            emit(m.content + IM_END, trained=True)
            emit("\n")
        elif m.role == "observation":
            body = observation.observation_content(m.content, take(m.num_images), fmt)
            emit(f"{IM_START}user\n{body}{IM_END}\n")
        elif m.role == "user":
            pieces = m.content.split(IMAGE_MARKER)
            sizes = take(len(pieces) - 1)
            body = pieces[0] + "".join(observation.image_block(n) + p for n, p in zip(sizes, pieces[1:], strict=True))
            emit(f"{IM_START}user\n{body}{IM_END}\n")
        elif m.role == "system":
            emit(f"{IM_START}system\n{m.content}{IM_END}\n")
        else:
            raise ValueError(f"unknown role {m.role!r}")
    if counts is not None and k != len(counts):
        raise ValueError(f"{len(counts)} images given but the messages place {k}")
    return Rendered("".join(parts), tuple(spans))


def template_messages(messages: Sequence[Message], fmt: str | TurnFormat = observation.CODE) -> list[dict]:
    """The same conversation as chat-template messages (for checking `render` against the template)."""
    out = []
    for m in messages:
        if m.role == "observation":
            body = observation.observation_content(m.content, 0, fmt)
            out.append(
                {"role": "user", "content": [{"type": "text", "text": body}] + [{"type": "image"}] * m.num_images}
            )
        elif m.role == "user" and m.num_images:
            items: list[dict] = []
            for i, piece in enumerate(m.content.split(IMAGE_MARKER)):
                if i:
                    items.append({"type": "image"})
                if piece:
                    items.append({"type": "text", "text": piece})
            out.append({"role": "user", "content": items})
        else:
            out.append({"role": m.role, "content": m.content})
    return out


def token_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]], length: int) -> np.ndarray:
    """bool[T]: token t is trained iff the character at its start offset lies in a trained span."""
    trained = np.zeros(length + 1, bool)
    for a, b in spans:
        trained[a:b] = True
    starts = np.fromiter((s for s, _ in offsets), np.int64, len(offsets))
    return trained[starts]


def tokenize(tokenizer, rendered: Rendered) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32[T], trained bool[T]) from one tokenization of the whole text.

    `tokenizer` is our `codedance_jax.processing.Tokenizer`; its `tokenizers` backend gives
    character offsets (the same call `Tokenizer.encode` makes, so ids are identical).
    """
    enc = tokenizer.backend.encode(rendered.text, add_special_tokens=True)
    ids = np.asarray(enc.ids, np.int32)
    return ids, token_mask(enc.offsets, rendered.spans, len(rendered.text))
