"""`Processor`: text + images -> the model's numpy inputs, equal to transformers' Qwen2_5_VLProcessor.

`processor(text=[...], images=[...])` returns `input_ids` / `attention_mask` int64 [B, T],
`pixel_values` float32 [P, C*2*14*14], `image_grid_thw` int64 [n_images, 3] and
`mm_token_type_ids` int64 [B, T] (1 on image tokens; transformers v5 returns it and its
`get_rope_index` reads it). Each `<|image_pad|>` in the text, in order over the whole batch, is
expanded to grid_t*grid_h*grid_w / merge_size**2 copies before tokenizing; the placeholder count
must equal the number of images over the batch (per-sample counts may differ, as in transformers).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from codedance_jax.processing.image import PREPROCESSOR_CONFIG, ImageConfig, encode_images, flatten_images
from codedance_jax.processing.tokenizer import Tokenizer

IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"


class Processor:
    """Tokenizer + image processor of a Qwen2.5-VL checkpoint."""

    def __init__(self, tokenizer: Tokenizer, image_config: ImageConfig):
        self.tokenizer = tokenizer
        self.image_config = image_config
        self.image_token = IMAGE_TOKEN
        self.image_token_id = tokenizer.token_to_id(IMAGE_TOKEN)
        self.video_token_id = tokenizer.token_to_id(VIDEO_TOKEN)
        self.vision_start_id = tokenizer.token_to_id(VISION_START)
        self.vision_end_id = tokenizer.token_to_id(VISION_END)
        self.im_start_id = tokenizer.token_to_id(IM_START)
        self.im_end_id = tokenizer.token_to_id(IM_END)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, padding_side: str | None = None) -> Processor:
        """Load from a Hugging Face checkpoint directory (tokenizer files + preprocessor_config.json)."""
        return cls(Tokenizer.from_pretrained(path, padding_side=padding_side), ImageConfig.from_pretrained(path))

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write tokenizer + preprocessor files that transformers' AutoProcessor/AutoTokenizer load."""
        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)
        self.tokenizer.save_pretrained(path)
        with open(os.path.join(path, PREPROCESSOR_CONFIG), "w") as f:
            json.dump(self.image_config.to_dict(), f, indent=2)

    # ---- ids -------------------------------------------------------------------------------

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_id

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def padding_side(self) -> str:
        return self.tokenizer.padding_side

    @padding_side.setter
    def padding_side(self, side: str) -> None:
        if side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {side!r}")
        self.tokenizer.padding_side = side

    def num_image_tokens(self, grid_thw: Sequence[int] | np.ndarray) -> int | np.ndarray:
        """Placeholder count for one image's (t, h, w), or per row of an [n, 3] array."""
        g = np.asarray(grid_thw, dtype=np.int64)
        n = g.prod(axis=-1) // self.image_config.merge_size**2
        return int(n) if g.ndim == 1 else n

    def encode_images(self, images: Any) -> tuple[np.ndarray, np.ndarray]:
        """PIL images / arrays -> (pixel_values [P, patch_dim] float32, image_grid_thw [n, 3] int64)."""
        return encode_images(images, self.image_config)

    def decode(self, ids: Sequence[int] | np.ndarray, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, ids: Any, skip_special_tokens: bool = False) -> list[str]:
        return self.tokenizer.batch_decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False, **kwargs: Any
    ) -> str:
        """Render one conversation (see `Tokenizer.apply_chat_template`)."""
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)

    def expand_image_tokens(self, text: Sequence[str], grid_thw: np.ndarray) -> list[str]:
        """Replace the i-th `<|image_pad|>` over the batch by `num_image_tokens(grid_thw[i])` copies."""
        counts = [t.count(self.image_token) for t in text]
        if sum(counts) != len(grid_thw):
            raise ValueError(
                f"The total number of {self.image_token} tokens in the prompts should be the same as the number "
                f"of images passed. Found total {sum(counts)} {self.image_token} tokens (per sample {counts}) "
                f"and {len(grid_thw)} images."
            )
        out, k = [], 0
        for t in text:
            pieces = t.split(self.image_token)
            buf = [pieces[0]]
            for piece in pieces[1:]:
                buf.append(self.image_token * self.num_image_tokens(grid_thw[k]))
                buf.append(piece)
                k += 1
            out.append("".join(buf))
        return out

    def __call__(
        self,
        text: str | Sequence[str] | None = None,
        images: Any = None,
        padding: bool | str = True,
        padding_side: str | None = None,
        max_length: int | None = None,
        pad_to_multiple_of: int | None = None,
    ) -> dict[str, np.ndarray]:
        """Tokenize `text` with images expanded; numpy outputs (see the module docstring).

        `images` is a flat list over the batch, or one list per sample (flattened in order).
        Default `padding=True` pads to the longest sample on the tokenizer's padding side.
        """
        if text is None and images is None:
            raise ValueError("You need to provide at least one input to call Processor")
        out: dict[str, np.ndarray] = {}
        flat = flatten_images(images)
        if images is not None:
            out["pixel_values"], out["image_grid_thw"] = self.encode_images(flat)
        if text is None:
            return out
        if isinstance(text, str):
            text = [text]
        if not all(isinstance(t, str) for t in text):
            raise ValueError("`text` must be a string or list of strings.")
        counts = [t.count(self.image_token) for t in text]
        if any(VIDEO_TOKEN in t for t in text):
            raise ValueError(f"{VIDEO_TOKEN} found in the text: videos are not supported, only images")
        if images is None and any(counts):
            raise ValueError(f"Found {sum(counts)} {self.image_token} tokens in the text but no images were passed.")
        if images is not None:
            text = self.expand_image_tokens(text, out["image_grid_thw"])
        ids = self.tokenizer.encode_batch(text)
        expected = [t.count(self.image_token) for t in text]
        got = [row.count(self.image_token_id) for row in ids]
        if got != expected:  # e.g. a placeholder glued to text the tokenizer merges differently
            raise ValueError(f"image token count mismatch between text ({expected}) and input_ids ({got})")
        batch = self.tokenizer.pad(
            ids,
            padding=padding,
            max_length=max_length,
            pad_to_multiple_of=pad_to_multiple_of,
            padding_side=padding_side,
        )
        out["input_ids"] = batch["input_ids"]
        out["attention_mask"] = batch["attention_mask"]
        out["mm_token_type_ids"] = (out["input_ids"] == self.image_token_id).astype(np.int64)
        return out
