"""TFDS builder: SFT trajectory JSONL files -> an array_record dataset, read back with `tfds` data sources.

Layout: `{data_dir}/sft_trajectories/{name}/{DATA_VERSION}/` holds the array_record shards of one
`train` split, TFDS metadata, and `build_report.json` (the `DataReport` of malformed records).
Every record is validated by `data.trajectory` while it is generated; images are stored as
encoded PNG bytes (other formats are re-encoded losslessly) and decoded with PIL by the reader
(`data.sft_pipeline`), so no TensorFlow op touches them.

Features per example: `id`, `source` ("file:line"), `images` (PNG bytes, in order of
appearance), and per message `roles`, `contents`, `num_images`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence

import numpy as np
import tensorflow_datasets as tfds

from codedance_jax.errors import ConfigError, MissingPathError
from data import failed_build
from data.trajectory import DataReport, Message, Trajectory, read_jsonl

DATA_VERSION = "1.0.0"
BUILDER_NAME = "sft_trajectories"
REPORT_FILE = "build_report.json"


@dataclasses.dataclass(kw_only=True)
class SftTrajectoriesConfig(tfds.core.BuilderConfig):
    jsonl_paths: tuple[str, ...] = ()
    on_error: str = "skip"


class SftTrajectories(tfds.core.GeneratorBasedBuilder):
    """Multi-turn SFT trajectories with images (see `data/trajectory.py` for the JSONL format)."""

    VERSION = tfds.core.Version(DATA_VERSION)
    RELEASE_NOTES = {DATA_VERSION: "Trajectory JSONL with PNG images."}
    BUILDER_CONFIGS = [SftTrajectoriesConfig(name="default")]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.report = DataReport()

    def _info(self) -> tfds.core.DatasetInfo:
        text_seq = tfds.features.Sequence(tfds.features.Text())
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict(
                {
                    "id": tfds.features.Text(),
                    "source": tfds.features.Text(),
                    "images": tfds.features.Sequence(tfds.features.Tensor(shape=(), dtype=np.object_)),
                    "roles": text_seq,
                    "contents": text_seq,
                    "num_images": tfds.features.Sequence(tfds.features.Tensor(shape=(), dtype=np.int32)),
                }
            ),
            description="CodeDance SFT trajectories (multi-turn, images in user turns and observations).",
        )

    def _split_generators(self, dl_manager):
        del dl_manager
        if not self.builder_config.jsonl_paths:
            raise ValueError("SftTrajectoriesConfig.jsonl_paths is empty: pass the trajectory JSONL files")
        return {"train": self._generate_examples(self.builder_config.jsonl_paths)}

    def _generate_examples(self, paths: Sequence[str]):
        index = {os.path.abspath(p): i for i, p in enumerate(paths)}
        yield from self._examples(paths, index)
        # An entirely malformed dataset stops here (build_dataset removes what TFDS began), rather
        # than in TFDS's "No examples were yielded".
        self.report.check_usable(", ".join(paths))

    def _examples(self, paths, index):
        for traj in read_jsonl(paths, on_error=self.builder_config.on_error, report=self.report):
            # The key fixes the record order TFDS shuffles into; it names the file by its position
            # in the list, not its path, so the same files built anywhere give the same order.
            file, _, line = traj.source.rpartition(":")
            yield (
                f"{index.get(os.path.abspath(file), file)}:{line}",
                {
                    "id": traj.id,
                    "source": traj.source,
                    "images": list(traj.images),
                    "roles": [m.role for m in traj.messages],
                    "contents": [m.content for m in traj.messages],
                    "num_images": np.asarray([m.num_images for m in traj.messages], np.int32),
                },
            )


def dataset_dir(data_dir: str | os.PathLike, name: str) -> str:
    return os.path.join(os.fspath(data_dir), BUILDER_NAME, name, DATA_VERSION)


def build_dataset(
    jsonl_paths: Sequence[str | os.PathLike],
    data_dir: str | os.PathLike,
    name: str = "default",
    *,
    on_error: str = "skip",
) -> DataReport:
    """Validate and convert JSONL trajectories into an array_record TFDS dataset.

    Returns the `DataReport` (also written to `build_report.json` beside the data). With
    `on_error="stop"` the first malformed record raises `MalformedRecordError` (file:line and fix);
    when no record is usable a `DataError` gives the count and the first problem. Either way
    nothing is left on disk. An existing dataset of the same name is kept as is (TFDS reuses it)
    and the report of the build that wrote it is returned.
    """
    if on_error not in ("skip", "stop"):
        raise ConfigError(f"on_error must be 'skip' or 'stop', got {on_error!r}")
    bad = [p for p in jsonl_paths if not isinstance(p, (str, os.PathLike))]
    if bad:
        raise ConfigError(f"trajectory files must be paths, got {bad[0]!r}", "give --config.data.jsonl=FILE[,FILE]")
    paths = tuple(os.path.abspath(os.fspath(p)) for p in jsonl_paths)
    for p in paths:
        if not os.path.isfile(p):
            raise MissingPathError(f"trajectory file {p} not found", "check --config.data.jsonl")
    config = SftTrajectoriesConfig(name=name, jsonl_paths=paths, on_error=on_error)
    report_file = os.path.join(dataset_dir(data_dir, name), REPORT_FILE)
    builder = SftTrajectories(config=config, data_dir=os.fspath(data_dir), file_format="array_record")
    if builder.is_prepared() and os.path.isfile(report_file):
        with open(report_file) as f:
            return DataReport.from_json(json.load(f))
    failed_build.prepare(builder, dataset_dir(data_dir, name))
    with open(report_file, "w") as f:
        json.dump(builder.report.to_json(), f, indent=2)
    return builder.report


def open_source(data_dir: str | os.PathLike, name: str = "default", split: str = "train"):
    """Random-access data source (len / getitem) over a built dataset, for `grain.MapDataset.source`."""
    path = dataset_dir(data_dir, name)
    if not os.path.isdir(path):
        raise MissingPathError(f"no dataset at {path}", "build it first with data.sft_tfds.build_dataset (launch.sft does)")
    return tfds.builder_from_directory(path).as_data_source(split=split)


def _text(x) -> str:
    return x.decode("utf-8") if isinstance(x, bytes) else str(x)


def to_trajectory(record) -> Trajectory:
    """A decoded TFDS record (dict of numpy values) or a `Trajectory` -> `Trajectory`."""
    if isinstance(record, Trajectory):
        return record
    roles, contents = record["roles"], record["contents"]
    counts = np.asarray(record["num_images"]).reshape(-1)
    messages = tuple(Message(_text(r), _text(c), int(n)) for r, c, n in zip(roles, contents, counts, strict=True))
    images = tuple(bytes(b) for b in record["images"])
    return Trajectory(_text(record["id"]), messages, images, _text(record["source"]))
