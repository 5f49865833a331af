"""One turn on the host: what ended it, the code it holds, and the observation tokens that answer it.

The observation string itself comes from `codedance_jax.protocol` (the one place that knows the format);
this module fills it from an `ExecResult`, resizes and caps the captured images, and tokenizes the
observation on its own. Observations start with the `<|im_end|>` special token, so their tokens
never merge with the sampled tokens before them: appending their ids gives exactly the sequence a
tokenizer would give for the whole text, and nothing is ever re-tokenized.

Model-written code controls stdout. Text that spells a special token (`<|im_start|>`,
`<|image_pad|>`, ...) would be tokenized as that token and could forge turns or break the image
count, so `<|` in observation text is written `<\u200b|` (a zero-width space) before tokenizing.
"""

from __future__ import annotations

import dataclasses
import io
import json
import re

import numpy as np
from PIL import Image

from codedance_jax import protocol as obs_format
from codedance_jax.protocol import TurnFormat

ANSWER_CLOSE = "</answer>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
_FENCE_RE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def stop_strings(fmt: TurnFormat) -> tuple[str, ...]:
    return (fmt.call_close, ANSWER_CLOSE, IM_END, ENDOFTEXT)


def find_stop(text: str, fmt: TurnFormat) -> tuple[int, str] | None:
    """(end offset, stop string) of the earliest stop string in `text`, or None."""
    best = None
    for s in stop_strings(fmt):
        i = text.find(s)
        if i >= 0 and (best is None or i + len(s) < best[0]):
            best = (i + len(s), s)
    return best


def extract_answer(text: str) -> str | None:
    """The text inside the last `<answer>...</answer>` of a turn, stripped; None without one."""
    found = _ANSWER_RE.findall(text)
    return found[-1].strip() if found else None


@dataclasses.dataclass(frozen=True)
class CodeBlock:
    code: str | None  # what runs in the sandbox; None when the block is malformed
    error: str | None  # why it is malformed (reported to the model as an error observation)


def extract_code(turn_text: str, fmt: TurnFormat) -> CodeBlock:
    """The code of the turn's last call block, which ends the turn (`...</code>` / `...</tool_call>`).

    code format: the fenced ```python block inside `<code>...</code>`. tool_call format: JSON
    `{"name": ..., "arguments": {"code": "..."}}` (arguments may also be a JSON string; without a
    "code" key the only string argument is taken).
    """
    end = turn_text.rfind(fmt.call_close)
    if end < 0:
        return CodeBlock(None, f"the turn does not end with {fmt.call_close}")
    start = turn_text.rfind(fmt.call_open, 0, end)
    if start < 0:
        return CodeBlock(None, f"{fmt.call_close} without a matching {fmt.call_open}")
    body = turn_text[start + len(fmt.call_open) : end]
    if fmt.name == "code":
        m = _FENCE_RE.search(body)
        if m is None or not m.group(1).strip():
            return CodeBlock(None, f"no ```python fenced code inside {fmt.call_open}...{fmt.call_close}")
        return CodeBlock(m.group(1), None)
    try:
        call = json.loads(body.strip())
        args = call.get("arguments", {}) if isinstance(call, dict) else None
        if isinstance(args, str):
            args = json.loads(args)
    except ValueError as e:
        return CodeBlock(None, f"the tool call is not valid JSON ({e})")
    if not isinstance(args, dict):
        return CodeBlock(None, 'the tool call needs a JSON object with "name" and object "arguments"')
    code = args.get("code")
    if code is None:
        strings = [v for v in args.values() if isinstance(v, str)]
        code = strings[0] if len(strings) == 1 else None
    if not isinstance(code, str) or not code.strip():
        return CodeBlock(None, 'the tool call arguments hold no "code" string')
    return CodeBlock(code, None)


def sanitize(text: str) -> str:
    """Keep observation text from spelling special tokens (see the module docstring)."""
    return text.replace("<|", "<\u200b|")


def fit_image(png: bytes, max_pixels: int) -> Image.Image:
    """Decode a captured PNG as RGB, downscaled (aspect kept) to at most `max_pixels` pixels."""
    im = Image.open(io.BytesIO(png))
    im.load()
    im = im.convert("RGB")
    w, h = im.size
    if w * h > max_pixels:
        s = (max_pixels / (w * h)) ** 0.5
        im = im.resize((max(1, int(w * s)), max(1, int(h * s))), Image.BICUBIC)
    return im


@dataclasses.dataclass
class Observation:
    """One observation ready to append: its tokens, its images (processed) and what it said."""

    status: str  # ok | error | timeout | crashed
    text: str  # the `{text}` of the observation (after truncation)
    ids: np.ndarray  # int32[C]
    images: list[Image.Image]
    pixel_values: np.ndarray | None  # [P, patch_dim]
    grid_thw: np.ndarray | None  # int[I, 3]


def build_observation(
    processor,
    fmt: TurnFormat,
    status: str,
    stdout: str,
    stderr: str,
    pngs: list[bytes],
    *,
    max_chars: int,
    max_images: int,
    max_pixels: int,
    max_tokens: int,
) -> Observation:
    """Render and tokenize an observation; images over `max_images` or unreadable are noted in the text.

    If the tokens exceed `max_tokens`, images are dropped, then the text is cut further, each
    step noted in the text, until it fits.
    """
    notes = []
    images: list[Image.Image] = []
    for k, png in enumerate(pngs):
        if len(images) >= max_images:
            notes.append(f"[{len(pngs) - k} more image(s) not shown: at most {max_images} per turn]")
            break
        try:
            images.append(fit_image(png, max_pixels))
        except Exception as e:  # noqa: BLE001 - a broken image is the cell's problem, not the batch's
            notes.append(f"[image {k} could not be read: {type(e).__name__}]")
    chars = max_chars
    while True:
        body = obs_format.observation_text(stdout, stderr, status, max_chars=chars)
        text = sanitize("\n".join([body, *notes]) if notes else body)
        if images:
            pv, grid = processor.encode_images(images)
            counts = [int(n) for n in processor.num_image_tokens(grid)]
        else:
            pv, grid, counts = None, None, []
        ids = np.asarray(processor.tokenizer.encode(obs_format.render_observation(text, counts, fmt)), np.int32)
        if len(ids) <= max_tokens:
            return Observation(status, text, ids, images, pv, grid)
        if images:
            notes.append(f"[{len(images)} image(s) not shown: the observation exceeded {max_tokens} tokens]")
            images = []
        elif chars > 0:
            chars = chars // 2 if chars > 64 else 0
        else:
            raise ValueError(f"an observation without output needs {len(ids)} tokens > max_obs_tokens {max_tokens}")
