"""One turn on the host: the observation tokens that answer a turn's code.

What ended a turn and the code it holds are read by `codedance_jax.protocol` (re-exported here), and
the observation string comes from there too (the one place that knows the format); this module fills it from an `ExecResult`, resizes and caps the captured images, and tokenizes the
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

import numpy as np
from PIL import Image

from codedance_jax import protocol as obs_format
from codedance_jax.protocol import (
    ANSWER_CLOSE,
    ENDOFTEXT,
    IM_END,
    CodeBlock,
    TurnFormat,
    extract_answer,
    extract_code,
    find_stop,
    stop_strings,
)

# The turn protocol (stop strings, code and answer extraction) is `codedance_jax.protocol`'s; its names
# are re-exported here for the engine, which reads a turn through this module.
__all__ = ["ANSWER_CLOSE", "ENDOFTEXT", "IM_END", "CodeBlock", "Observation", "build_observation", "extract_answer",
           "extract_code", "find_stop", "fit_image", "sanitize", "stop_strings"]


def sanitize(text: str) -> str:
    """Keep observation text from spelling special tokens (see the module docstring)."""
    return text.replace("<|", "<\u200b|")


def fit_image(png: bytes, max_pixels: int, factor: int = 28) -> Image.Image:
    """Decode a captured PNG as RGB, resized (aspect kept, up to rounding) so that each side is a
    multiple of `factor` (the processor's patch x merge), at least one, the area at most
    `max_pixels` and the aspect ratio at most 200 (the processor's limit). The processor keeps such
    a size as it is, so an observation image never needs more vision units or windows than the
    rollout's shape plan holds for one (`shapes.image_caps`): model-written code cannot make a
    shape outside the plan, nor a ValueError in the processor."""
    im = Image.open(io.BytesIO(png))
    im.load()
    im = im.convert("RGB")
    w, h = im.size
    s = min(1.0, (max_pixels / (w * h)) ** 0.5)
    tw, th = (max(factor, int(x * s) // factor * factor) for x in (w, h))
    while tw * th > max_pixels and max(tw, th) > factor:  # the floor of 1 multiple can overshoot
        tw, th = (tw - factor, th) if tw >= th else (tw, th - factor)
    tw, th = min(tw, 200 * th), min(th, 200 * tw)
    if (tw, th) != (w, h):
        im = im.resize((tw, th), Image.BICUBIC)
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
