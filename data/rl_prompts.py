"""RL prompts: JSONL files -> an array_record TFDS dataset, and the step-indexed reader GRPO uses.

Prompt JSONL (one object per line; image paths relative to the file):

    {"id": "count-hard-0007", "question": "How many red circles are in the image?", "answer": "5",
     "images": ["img/count-hard-0007.png"], "family": "count", "difficulty": "hard"}

`id`, `question`, `answer` and `images` are required; every other key is kept as metadata
(`meta`, JSON text) and comes back with the prompt, so evaluation can break accuracy down by it.
The dataset lives in `{data_dir}/rl_prompts/{name}/1.0.0/` (images as PNG bytes).

`PromptSchedule` decides which prompts step s uses: epoch e is a permutation of all prompts drawn
from (seed, e); step s takes the next `prompts_per_step` of the concatenated epochs. It has no
state beyond the step number, so a resumed run draws exactly the prompts the killed one would
have; each host reads its contiguous share `[host*n:(host+1)*n]` of the step's prompts.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from collections.abc import Sequence

import numpy as np
import tensorflow_datasets as tfds
from PIL import Image

from codedance_jax.errors import DataError, MissingPathError
from data import failed_build

DATA_VERSION = "1.0.0"
BUILDER_NAME = "rl_prompts"
REQUIRED = ("id", "question", "answer", "images")


@dataclasses.dataclass
class RLPrompt:
    id: str
    question: str
    answer: str
    images: list  # PIL images
    meta: dict
    image_paths: list = dataclasses.field(default_factory=list)  # as written in the JSONL (relative)


def read_prompts_jsonl(path: str | os.PathLike, load_images: bool = True) -> list[RLPrompt]:
    """Read a prompt JSONL file; errors name file:line and the missing field."""
    path = os.fspath(path)
    root = os.path.dirname(os.path.abspath(path))
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise DataError(f"{path}:{n}: not a JSON object ({e})", "one prompt per line") from e
            if not isinstance(rec, dict):
                raise DataError(f"{path}:{n}: not a JSON object", "one prompt object per line")
            missing = [k for k in REQUIRED if k not in rec]
            if missing:
                raise DataError(f"{path}:{n}: prompt lacks {missing}", f"every prompt needs {list(REQUIRED)}")
            if not isinstance(rec["images"], list):
                raise DataError(f"{path}:{n}: field 'images' must be a list", "give paths relative to the file")
            ims = []
            for rel in rec["images"]:
                p = os.path.join(root, rel)
                if not os.path.isfile(p):
                    raise MissingPathError(f"{path}:{n}: image {rel!r} not found at {p}",
                                           "image paths are relative to the JSONL file's directory")
                if load_images:
                    with Image.open(p) as im:
                        ims.append(im.convert("RGB"))
                else:
                    ims.append(p)
            meta = {k: v for k, v in rec.items() if k not in REQUIRED}
            out.append(RLPrompt(str(rec["id"]), str(rec["question"]), str(rec["answer"]), ims, meta,
                                list(rec["images"])))
    return out


@dataclasses.dataclass(kw_only=True)
class RLPromptsConfig(tfds.core.BuilderConfig):
    jsonl_paths: tuple[str, ...] = ()


class RLPrompts(tfds.core.GeneratorBasedBuilder):
    """Questions with images and reference answers, for GRPO rollouts and evaluation."""

    VERSION = tfds.core.Version(DATA_VERSION)
    RELEASE_NOTES = {DATA_VERSION: "Prompt JSONL with PNG images."}
    BUILDER_CONFIGS = [RLPromptsConfig(name="default")]

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict({
                "id": tfds.features.Text(),
                "question": tfds.features.Text(),
                "answer": tfds.features.Text(),
                "meta": tfds.features.Text(),
                "images": tfds.features.Sequence(tfds.features.Tensor(shape=(), dtype=np.object_)),
            }),
            description="CodeDance RL prompts (question, images, reference answer, metadata).",
        )

    def _split_generators(self, dl_manager):
        del dl_manager
        if not self.builder_config.jsonl_paths:
            raise ValueError("RLPromptsConfig.jsonl_paths is empty: pass the prompt JSONL files")
        return {"train": self._generate_examples(self.builder_config.jsonl_paths)}

    def _generate_examples(self, paths: Sequence[str]):
        for i, path in enumerate(paths):
            for n, p in enumerate(read_prompts_jsonl(path, load_images=False)):
                pngs = [_png(file, f"{path} (prompt {p.id})") for file in p.images]
                # Keys name files by position (not path): the same files give the same order anywhere.
                yield f"{i}:{n:08d}", {"id": p.id, "question": p.question, "answer": p.answer,
                                       "meta": json.dumps(p.meta, sort_keys=True), "images": pngs}


def _png(file: str, where: str) -> bytes:
    try:
        with Image.open(file) as im:
            buf = io.BytesIO()
            im.convert("RGB").save(buf, format="PNG")
            return buf.getvalue()
    except OSError as e:  # PIL's UnidentifiedImageError and truncated files are OSErrors
        raise DataError(f"{where}: image {file} does not decode ({e})", "give PNG/JPEG files PIL can read") from e


def dataset_dir(data_dir: str | os.PathLike, name: str) -> str:
    return os.path.join(os.fspath(data_dir), BUILDER_NAME, name, DATA_VERSION)


def build_prompts(jsonl_paths: Sequence[str | os.PathLike], data_dir: str | os.PathLike, name: str = "default") -> int:
    """Convert prompt JSONL files into an array_record dataset (kept if it exists); returns its size."""
    paths = tuple(os.path.abspath(os.fspath(p)) for p in jsonl_paths)
    for p in paths:
        if not os.path.isfile(p):
            raise MissingPathError(f"prompt file {p} not found", "check --config.data.jsonl / eval_jsonl")
    builder = RLPrompts(config=RLPromptsConfig(name=name, jsonl_paths=paths), data_dir=os.fspath(data_dir),
                        file_format="array_record")
    if not builder.is_prepared():
        # Check every record before TFDS writes anything (cheap: no image is read here).
        if not sum(len(read_prompts_jsonl(p, load_images=False)) for p in paths):
            raise DataError(f"{', '.join(paths)}: no prompts (empty files)", "give one prompt object per line")
        failed_build.prepare(builder, dataset_dir(data_dir, name))
    return builder.info.splits["train"].num_examples


def open_prompts(data_dir: str | os.PathLike, name: str = "default", split: str = "train"):
    """Random-access source of decoded records (`to_prompt` turns one into an `RLPrompt`)."""
    path = dataset_dir(data_dir, name)
    if not os.path.isdir(path):
        raise MissingPathError(f"no prompt dataset at {path}", "build it with data.rl_prompts.build_prompts")
    return tfds.builder_from_directory(path).as_data_source(split=split)


def _text(x) -> str:
    return x.decode("utf-8") if isinstance(x, bytes) else str(x)


def to_prompt(record) -> RLPrompt:
    ims = []
    for b in record["images"]:
        with Image.open(io.BytesIO(bytes(b))) as im:
            ims.append(im.convert("RGB"))
    return RLPrompt(_text(record["id"]), _text(record["question"]), _text(record["answer"]), ims,
                    json.loads(_text(record["meta"]) or "{}"))


@dataclasses.dataclass(frozen=True)
class PromptSchedule:
    """Which prompt indices a step uses (see the module docstring); stateless, so resume is exact."""

    num_prompts: int
    prompts_per_step: int
    seed: int = 0

    def __post_init__(self):
        if self.num_prompts < 1:
            raise ValueError("the prompt dataset is empty")
        if self.prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be >= 1, got {self.prompts_per_step}")

    def _epoch(self, e: int) -> np.ndarray:
        return np.random.default_rng([self.seed, e]).permutation(self.num_prompts)

    def indices(self, step: int, host: int = 0, hosts: int = 1) -> list[int]:
        start = step * self.prompts_per_step
        out = []
        for k in range(start, start + self.prompts_per_step):
            e, i = divmod(k, self.num_prompts)
            out.append(int(self._epoch(e)[i]))
        # Contiguous shares: the host-major allgather of the hosts' rows is then the global batch in
        # one-process order (and the rollout seeds, offset by global row, match a one-process run).
        n = len(out) // hosts
        return out[host * n : (host + 1) * n]
