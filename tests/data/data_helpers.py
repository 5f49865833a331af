"""Helpers for the data tests: PNG and JSONL writers, a hand-built multi-turn trajectory."""

import json
import os

import numpy as np


def write_png(path, height, width, seed):
    from PIL import Image

    os.makedirs(os.path.dirname(path), exist_ok=True)
    rgb = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(path)


def write_jsonl(path, records):
    """`records`: dicts (dumped as JSON) or raw strings (written as the line, for broken JSON)."""
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def multi_turn_record(rid="mt-0", q_img="img/q.png", crop_img="img/crop.png"):
    """A hand-built code trajectory: an image in the user turn and one in the observation."""
    return {
        "id": rid,
        "images": [q_img, crop_img],
        "messages": [
            {"role": "user", "content": "<image>\nQuestion: how many red bars are there?"},
            {
                "role": "assistant",
                "content": "<think>Let me crop the chart.</think>\n<code>\n```python\nprint(crop.size)\n```\n</code>",
            },
            {"role": "observation", "content": "(56, 56)", "num_images": 1},
            {"role": "assistant", "content": "<think>Three bars are red.</think>\n<answer>3</answer>"},
        ],
    }
