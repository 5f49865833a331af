"""The trajectory record (SPEC section 2 contract) and its JSON-lines files with PNG images beside.

Contract fields: id, prompt_id, tokens, loss_mask, turn_ids, logprobs, temperature, images,
turn_status, answer, correct, rewards, policy. Added here: turns (per assistant turn: status,
observation text, n_images, code, stop, and `text`, the decode of exactly the turn's sampled ids;
what `rl.turn_arrays` and scoring read), image_grid_thw, num_turns,
num_tool_calls (closed call blocks) and num_executions (those that ran), finish_reason, timings
group (index of the sample within its prompt's group) and prompt_len.

`tokens` are exactly the ids the model saw, in order: prompt, then per turn the sampled ids
(loss_mask 1, turn_ids m, their log-probs) and the observation ids (loss_mask 0, turn_ids -1,
logprob 0). Images are in order of appearance in `tokens`: the prompt's, then each observation's,
each saved as the PNG of the exact image that was given to the processor.

`vision` holds each image's processed vision input as the rollout computed it, (pixel_values
float32[P, patch_dim], grid_thw int[3]) in the order of `images`, so training need not run the
image processor again. It lives in memory only: `save_jsonl` does not write it (the PNGs are the
record) and `load_jsonl` leaves it empty.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from collections.abc import Iterable
from typing import Any

import numpy as np
from PIL import Image

FINISH_REASONS = (
    "answer",  # closed </answer>
    "stop",  # <|im_end|> / <|endoftext|> without answer or code
    "max_turns",  # the turn budget ended a trajectory still writing code
    "turn_tokens",  # a turn hit max_turn_tokens without a stop
    "new_tokens",  # the trajectory hit max_new_tokens
    "length",  # the next observation would exceed max_total_tokens
    "error",  # the host failed on this trajectory (message in `error`); the batch went on
)


@dataclasses.dataclass
class Trajectory:
    id: str
    prompt_id: str
    group: int
    prompt_len: int
    tokens: list[int]
    loss_mask: list[int]
    turn_ids: list[int]
    logprobs: list[float]
    temperature: float
    images: list[Any]  # PIL images in memory; paths relative to the workdir once saved
    image_grid_thw: list[list[int]]
    turn_status: list[str]
    turns: list[dict]
    answer: str | None = None
    correct: bool | None = None
    rewards: dict = dataclasses.field(default_factory=dict)
    policy: str | None = None
    finish_reason: str = ""
    error: str | None = None
    num_tool_calls: int = 0
    num_executions: int = 0
    timings: dict = dataclasses.field(default_factory=dict)
    vision: list = dataclasses.field(default_factory=list, repr=False)  # [(pixel_values, grid_thw)] per image

    @property
    def num_turns(self) -> int:
        return len(self.turn_status)

    def response_text(self, processor) -> str:
        """Everything after the prompt, decoded (assistant turns and observations)."""
        return processor.decode(self.tokens[self.prompt_len :])


# Fields kept in memory only: neither written by `save_jsonl` nor read by `load_jsonl`.
IN_MEMORY_FIELDS = frozenset({"vision"})


def split_vision(pixel_values, grid_thw) -> list[tuple[np.ndarray, np.ndarray]]:
    """The processor's batched vision input (pixel_values [P, patch_dim] over the images in order,
    grid_thw [n, 3]) as one (pixel_values [t*h*w, patch_dim], grid_thw int[3]) pair per image."""
    grid = np.asarray(grid_thw).reshape(-1, 3)
    pv = np.asarray(pixel_values)
    sizes = np.prod(grid, axis=1)
    if int(sizes.sum()) != pv.shape[0]:
        raise ValueError(f"pixel_values has {pv.shape[0]} patch rows but image_grid_thw describes {int(sizes.sum())}")
    return list(zip(np.split(pv, np.cumsum(sizes)[:-1]), grid, strict=True))


def _jsonable(v):
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    raise TypeError(f"not JSON serializable: {type(v).__name__}")


def save_jsonl(
    trajectories: Iterable[Trajectory],
    workdir: str | os.PathLike,
    name: str = "trajectories.jsonl",
    image_dir: str = "images",
    append: bool = False,
) -> str:
    """Write one JSON object per trajectory to `workdir/name`, images to `workdir/image_dir/{id}-{k}.png`."""
    workdir = os.fspath(workdir)
    os.makedirs(os.path.join(workdir, image_dir), exist_ok=True)
    path = os.path.join(workdir, name)
    with open(path, "a" if append else "w") as f:
        for t in trajectories:
            # shallow: images stay as they are
            rec = {f.name: getattr(t, f.name) for f in dataclasses.fields(t) if f.name not in IN_MEMORY_FIELDS}
            paths = []
            for k, im in enumerate(t.images):
                rel = os.path.join(image_dir, f"{t.id}-{k}.png")
                if isinstance(im, str):
                    rel = im
                else:
                    im.save(os.path.join(workdir, rel), format="PNG")
                paths.append(rel)
            rec["images"] = paths
            rec["num_turns"] = t.num_turns
            f.write(json.dumps(rec, default=_jsonable) + "\n")
    return path


def load_jsonl(path: str | os.PathLike, load_images: bool = True) -> list[Trajectory]:
    """Read `save_jsonl` output; images come back as PIL images (or relative paths)."""
    path = os.fspath(path)
    root = os.path.dirname(os.path.abspath(path))
    fields = {f.name for f in dataclasses.fields(Trajectory)} - IN_MEMORY_FIELDS
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not a JSON object ({e}); each line holds one trajectory") from e
            missing = {"id", "tokens", "loss_mask", "turn_ids", "logprobs", "images"} - set(rec)
            if missing:
                raise ValueError(f"{path}:{n}: trajectory record lacks {sorted(missing)}")
            if load_images:
                ims = []
                for rel in rec["images"]:
                    with open(os.path.join(root, rel), "rb") as g:
                        im = Image.open(io.BytesIO(g.read()))
                        im.load()
                    ims.append(im)
                rec["images"] = ims
            out.append(Trajectory(**{k: v for k, v in rec.items() if k in fields}))
    return out
