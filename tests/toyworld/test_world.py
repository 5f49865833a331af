"""generate_world: all files, counts, held-out eval grid, and byte-identical output for one seed."""

import hashlib
import json
import os

import pytest
from toyworld_sizes import KNOBS, TINY

from data.toyworld import generate_world, load_prompts
from data.toyworld.tasks import verify_answer
from data.trajectory import read_jsonl


def _digest(d):
    h = {}
    for root, _, files in os.walk(d):
        for name in files:
            if name == "world.json":
                continue
            p = os.path.join(root, name)
            with open(p, "rb") as f:
                h[os.path.relpath(p, d)] = hashlib.sha256(f.read()).hexdigest()
    return h


def test_files_and_counts(world):
    d, info = world
    for rel in ("sft/sft.jsonl", "rl/prompts.jsonl", "eval/prompts.jsonl", "world.json", "processor/tokenizer.json"):
        assert os.path.isfile(os.path.join(d, rel)), rel
    with open(os.path.join(d, "world.json")) as f:
        assert json.load(f) == info
    assert info["splits"]["eval"]["counts"] == {
        f"{f}/{x}": 1 for f in ("bars", "count", "find") for x in ("easy", "hard")
    }
    assert sum(info["splits"]["sft"]["counts"].values()) == 12 and sum(info["splits"]["rl"]["counts"].values()) == 8
    assert info["sandbox"]["cells"] >= 6  # the hard SFT items ran code
    tok = info["sft_tokens_per_trajectory"]
    assert tok["hard"]["mean"] > tok["easy"]["mean"] > 16
    trajs = list(read_jsonl([os.path.join(d, "sft", "sft.jsonl")], on_error="stop"))
    assert len(trajs) == 12
    # Some easy SFT items are solved with code (a cold start that over-uses tools); world.json counts them.
    assert info["easy_code_rate"] == 0.5
    # Every calibration knob is recorded (hard_direct_rate at its default: every hard item uses code).
    assert info["error_rate"] == 0.3 and info["hard_direct_rate"] == 0.0 and info["hard_items_direct"] == 0
    with open(os.path.join(d, "sft", "sft.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    easy_code = [r for r in rows if r["meta"]["difficulty"] == "easy" and "<code>" in r["messages"][1]["content"]]
    assert info["easy_items_with_code"] == len(easy_code) >= 1
    assert all(r["meta"]["cells"] == 1 and r["meta"]["error"] is None for r in easy_code)
    assert info["easy_code_families"] == ["count", "bars", "find"]  # the default: every family
    by_family = {}
    for r in easy_code:
        by_family[r["meta"]["family"]] = by_family.get(r["meta"]["family"], 0) + 1
    assert info["easy_items_with_code_by_family"] == dict(sorted(by_family.items()))


def test_easy_code_families_in_world(pool, tmp_path):
    """A cue: only `count` easy items use code, and world.json says so; an unknown family is refused."""
    info = generate_world(tmp_path / "w", pool=pool, hard_frac=0.0, error_rate=0.0, easy_code_rate=1.0,
                          easy_code_families=("count",), vocab_size=400, **dict(TINY, n_rl=3, n_eval=6))
    assert info["easy_code_families"] == ["count"]
    assert info["easy_items_with_code_by_family"] == {"count": info["splits"]["sft"]["counts"]["count/easy"]}
    assert info["easy_items_with_code"] == info["splits"]["sft"]["counts"]["count/easy"] > 0
    with pytest.raises(ValueError, match="unknown families"):
        generate_world(tmp_path / "x", pool=pool, easy_code_families=("counting",), **TINY)


@pytest.mark.parametrize("split", ["rl", "val", "eval"])
def test_prompts_load_and_verify(world, split):
    d, _ = world
    rows = load_prompts(os.path.join(d, split, "prompts.jsonl"))
    assert len(rows) == TINY[f"n_{split}"]
    for r in rows:
        assert set(r) >= {"id", "family", "difficulty", "question", "answer", "images", "image_paths"}
        assert len(r["images"]) == 1 and r["images"][0].mode == "RGB"
        assert r["id"].startswith(split)
        assert verify_answer(r["images"][0], r["question"]) == r["answer"]  # the PNG on disk is exact


def test_deterministic(world, pool, tmp_path):
    d, _ = world
    info = generate_world(tmp_path / "again", pool=pool, **KNOBS, **TINY)
    assert _digest(d) == _digest(tmp_path / "again")
    assert info["special_ids"] == world[1]["special_ids"]
    other = dict(TINY, seed=TINY["seed"] + 1)
    generate_world(tmp_path / "other", pool=pool, **KNOBS, **other)
    a = open(os.path.join(d, "sft", "sft.jsonl"), "rb").read()
    b = open(tmp_path / "other" / "sft" / "sft.jsonl", "rb").read()
    assert a != b


def test_splits_are_disjoint(world):
    """The four splits (SFT, RL, validation, test) share no image; each has its own split code."""
    from data.toyworld.world import SPLIT_CODES

    assert len(set(SPLIT_CODES.values())) == len(SPLIT_CODES) == 4
    d, info = world
    assert info["splits"]["val"]["n"] == TINY["n_val"] > 0
    seen = {}
    for split, rel in (("sft", "sft/sft.jsonl"), ("rl", "rl/prompts.jsonl"), ("val", "val/prompts.jsonl"),
                       ("eval", "eval/prompts.jsonl")):
        with open(os.path.join(d, rel)) as f:
            for line in f:
                png = os.path.join(d, split, json.loads(line)["images"][0])
                with open(png, "rb") as g:
                    key = hashlib.sha256(g.read()).hexdigest()
                assert key not in seen, (split, seen.get(key))
                seen[key] = split


# The digest of the fixture's world as generated on the machine that recorded it (every file but
# world.json, whose timings vary). Another machine with the pinned requirements must write the same
# bytes: the images (PIL), the expert's sandbox outputs, the trajectories and the trained tokenizer.
# A deliberate change of the world's generation changes it: record the new value printed on failure.
WORLD_DIGEST = "34e193d6483ab92532742dfedab47ec45c4baf68ef2d3ba829bf26af074488a8"


def test_same_world_bytes_on_any_machine(world):
    d, _ = world
    h = hashlib.sha256(json.dumps(sorted(_digest(d).items())).encode()).hexdigest()
    assert h == WORLD_DIGEST, (
        f"the tiny world's bytes differ from the recorded ones: digest {h}. Either this machine generates "
        "a different world from the same seed (a library version or platform difference: see WORKSPACE.md, "
        "reproducibility), or the generation changed on purpose: then set WORLD_DIGEST to it.")
