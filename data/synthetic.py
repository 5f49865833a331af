"""A handful of synthetic SFT trajectories (shapes to count) so the tiny preset runs anywhere.

Not the toy world (which executes real code in the sandbox): the code turns here are written
with a plausible interpreter output, enough to exercise images in user turns and observations,
multi-turn loss masks and bucketing. Ground truth is exact by construction.
"""

from __future__ import annotations

import json
import os

import numpy as np
from PIL import Image, ImageDraw

COLORS = {"red": (220, 30, 30), "blue": (30, 60, 220), "green": (30, 170, 60)}


def _image(rng, path: str, size=(112, 84)):
    img = Image.new("RGB", size, "white")
    d = ImageDraw.Draw(img)
    counts = {c: 0 for c in COLORS}
    for _ in range(int(rng.integers(2, 7))):
        c = list(COLORS)[int(rng.integers(0, 3))]
        x, y = int(rng.integers(0, size[0] - 12)), int(rng.integers(0, size[1] - 12))
        d.rectangle([x, y, x + 10, y + 10], fill=COLORS[c])
        counts[c] += 1
    img.save(path)
    return counts


def write_synthetic_sft(out_dir: str, n: int, seed: int = 0) -> str:
    """Writes `n` trajectories and their PNGs under out_dir; returns the JSONL path."""
    os.makedirs(os.path.join(out_dir, "img"), exist_ok=True)
    rng = np.random.default_rng(seed)
    path = os.path.join(out_dir, "sft.jsonl")
    with open(path, "w") as f:
        for i in range(n):
            rel = f"img/{i}.png"
            counts = _image(rng, os.path.join(out_dir, rel))
            color = list(COLORS)[i % 3]
            q = f"<image>\nQuestion: How many {color} squares are in the image?"
            if i % 2 == 0:
                msgs = [{"role": "user", "content": q},
                        {"role": "assistant", "content": f"<think>I can count them directly.</think>\n<answer>{counts[color]}</answer>"}]
                images = [rel]
            else:
                crop = f"img/{i}_crop.png"
                Image.open(os.path.join(out_dir, rel)).crop((0, 0, 56, 56)).save(os.path.join(out_dir, crop))
                code = ("from PIL import Image\nimport numpy as np\nimg = np.array(Image.open('image.png'))\n"
                        "print(int(((img[..., 0] > 150) & (img[..., 1] < 100)).sum() // 121))")
                msgs = [{"role": "user", "content": q},
                        {"role": "assistant", "content": f"<think>Let me measure with code.</think>\n<code>\n```python\n{code}\n```\n</code>"},
                        {"role": "observation", "content": f"{counts[color]}", "num_images": 1},
                        {"role": "assistant", "content": f"<think>The code counted {counts[color]}.</think>\n<answer>{counts[color]}</answer>"}]
                images = [rel, crop]
            f.write(json.dumps({"id": f"syn-{i}", "images": images, "messages": msgs}) + "\n")
    return path
