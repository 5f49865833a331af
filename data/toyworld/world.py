"""Generate the toy world to disk: SFT trajectories, RL prompts, held-out eval prompts, the tokenizer.

Layout under `out_dir`:

    sft/sft.jsonl, sft/img/*.png          expert trajectories (data.trajectory format)
    rl/prompts.jsonl, rl/img/*.png        {"id", "family", "difficulty", "question", "answer", "images"}
    val/prompts.jsonl, val/img/*.png      the validation split (`n_val` > 0): a balanced family x difficulty
                                          grid; every calibration and recipe choice reads it
    eval/prompts.jsonl, eval/img/*.png    the test split, the same grid: reported once per frozen configuration
    {val,eval}/probes.jsonl               `n_probe` items of each fragile sub-cell (`PROBE_KINDS`), kept out
                                          of the grids and reported apart
    processor/                            the toy tokenizer + preprocessor (Processor.from_pretrained)
    world.json                            counts, tokens per trajectory, easy items with code,
                                          sandbox time, vocab size

Item `i` of a split is drawn from `default_rng([seed, split code, i])`, so splits never share a
random stream; val items whose image and question equal an SFT or RL item's, and eval (test) items
equal to an SFT, RL or val item, are redrawn (counted in world.json), so the four splits are disjoint. Everything but the timings in world.json is a function of the arguments: the
experts of different items run concurrently (threads, sandbox cells in parallel) and are written
in item order.

The calibration knobs (`configs/demo.py` world fields, all recorded in world.json with what they
produced): `hard_frac` (share of hard SFT and RL items), `easy_code_rate` (share of easy SFT items
the expert solves with code, see `data.toyworld.expert`: the SFT policy over-uses tools a little,
so that RL with R_BAT has an easy-item tool-call rate to lower; `easy_items_with_code`),
`easy_code_families` (the families whose easy items can use code; with a rate above one half the
code is the majority mode for those questions, so greedy decoding takes it too;
`easy_items_with_code_by_family`), `hard_direct_rate` (share of hard SFT items answered by sight, without code: room for RL to raise
accuracy; `hard_items_direct`), `hard_direct_families` (the families whose hard items can be
answered by sight; `hard_items_direct_by_family`), `bars_questions` (what hard bars items ask:
the tallest bar's colour and/or its height in pixels), `count_questions` (what hard count items
ask: a colour's shapes and/or a colour and kind), `easy_count_colors` (the colours easy count
shapes are drawn in) and `error_rate` (share of hard SFT items whose first cell fails and
is fixed; `recovered_errors`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import io
import json
import os
import time
from typing import Any

import numpy as np
from PIL import Image

from codedance_jax.processing.image import smart_resize
from data.chat import render
from data.toyworld.expert import expert_trajectory, png_bytes, user_content
from data.toyworld.tasks import ANSWER_COLORS, BARS_HARD_QUESTIONS, DIFFICULTIES, FAMILIES, Item, make_item
from data.toyworld.tokenizer import DEFAULT_MAX_PIXELS, DEFAULT_VOCAB, write_toy_processor_files
from data.trajectory import Message, parse_record

# "eval" is the test split (reported once per frozen configuration); "val" is the validation split,
# where every calibration, recipe choice and reading of errors is done (issue 47).
SPLIT_CODES = {"sft": 1, "rl": 2, "eval": 3, "val": 4}
EVAL_SPLITS = ("val", "eval")
# Probes: fragile sub-cells that the SFT and RL splits hold at their natural rates, kept out of the
# val / test grids (whose cells stay what they are designed to be) and written beside them as
# {split}/probes.jsonl, `n_probe` items of each kind, reported on their own (issue 47). Their random
# streams: split code 10 + the eval split's code, then the probe's index.
PROBE_KINDS: dict[str, tuple[str, str, dict]] = {
    "yellow_easy_count": ("count", "easy", {"easy_count_colors": ("yellow",)}),
    "color_kind_count": ("count", "hard", {"count_questions": ("count_target",), "count_target_rate": None}),
}
SANDBOX_LIMITS = dict(timeout_s=20.0, memory_mb=512)


def split_plan(split: str, n: int, seed: int, hard_frac: float) -> list[tuple[str, str]]:
    """(family, difficulty) of each item: eval cycles the 6 cells; sft/rl give each family
    round(hard_frac * share) hard items, shuffled."""
    if split in EVAL_SPLITS:
        cells = [(f, d) for f in FAMILIES for d in DIFFICULTIES]
        return [cells[i % len(cells)] for i in range(n)]
    plan = []
    for k, fam in enumerate(FAMILIES):
        m = len(range(k, n, len(FAMILIES)))
        hard = round(hard_frac * m)
        plan += [(fam, "hard")] * hard + [(fam, "easy")] * (m - hard)
    order = np.random.default_rng([seed, SPLIT_CODES[split], 999]).permutation(n)
    return [plan[i] for i in order]


def _key(item: Item) -> str:
    return hashlib.sha256(png_bytes(item.image) + item.question.encode()).hexdigest()


def make_split(split: str, n: int, seed: int, hard_frac: float, exclude: set[str] | None = None,
               **item_options):
    """The items of one split; items whose key is in `exclude` are redrawn. Returns (items, redraws).
    `item_options`: `make_item`'s keyword options (`bars_questions`, `count_questions`, `easy_count_colors`)."""
    items, redraws = [], 0
    for i, (fam, diff) in enumerate(split_plan(split, n, seed, hard_frac)):
        attempt = 0
        while True:
            key = [seed, SPLIT_CODES[split], i] + ([attempt] if attempt else [])
            item = make_item(fam, diff, np.random.default_rng(key), f"{split}-{i:05d}", **item_options)
            if not exclude or _key(item) not in exclude:
                break
            attempt += 1
            redraws += 1
        items.append(item)
    return items, redraws


def grid_options(item_options: dict) -> dict:
    """The val / test grids' item options when probes are written apart: no probe kind in them."""
    opts = dict(item_options)
    colors = tuple(c for c in opts.get("easy_count_colors", ANSWER_COLORS) if c != "yellow")
    questions = tuple(q for q in opts.get("count_questions", ("count_target",)) if q != "count_target")
    if not colors or not questions:
        raise ValueError("with probes (n_probe > 0) the grids need a non-yellow easy count colour and the "
                         "count_color question")
    opts.update(easy_count_colors=colors, count_questions=questions, count_target_rate=None)
    return opts


def make_probes(split: str, n: int, seed: int, exclude: set[str], **item_options) -> list[Item]:
    """`n` items of each `PROBE_KINDS` entry for eval split `split`, ids `{split}-probe-{kind}-{i}`."""
    items = []
    for k, (kind, (fam, diff, over)) in enumerate(PROBE_KINDS.items()):
        for i in range(n):
            attempt = 0
            while True:
                key = [seed, 10 + SPLIT_CODES[split], k, i] + ([attempt] if attempt else [])
                item = make_item(fam, diff, np.random.default_rng(key), f"{split}-probe-{kind}-{i:03d}",
                                 **{**item_options, **over})
                if _key(item) not in exclude:
                    break
                attempt += 1
            exclude.add(_key(item))
            items.append(item)
    return items


def _write_png(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def probe(item: Item) -> str:
    """The item's reported probe, "" for none: `yellow_easy_count` (easy count shapes in yellow, one
    channel away from white), `color_kind_count` (a hard count that names a colour and a kind),
    `touching` (two touching shapes of the asked colour: the connected-components count is one short)."""
    m = item.meta
    if (item.family, item.difficulty) == ("count", "easy") and m["shapes"] and m["shapes"][0]["color"] == "yellow":
        return "yellow_easy_count"
    if m.get("question_kind") == "count_target":
        return "color_kind_count"
    if m.get("touching"):
        return "touching"
    return ""


def write_prompts(directory: str, items: list[Item], name: str = "prompts.jsonl") -> str:
    """`name` (prompts.jsonl) + `img/{id}.png` under `directory`; returns the JSONL path. Each row's
    `probe` names the fragile sub-cell it belongs to (`probe`), "" for none."""
    os.makedirs(os.path.join(directory, "img"), exist_ok=True)
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        for it in items:
            rel = f"img/{it.id}.png"
            _write_png(os.path.join(directory, rel), png_bytes(it.image))
            row = {
                "id": it.id,
                "family": it.family,
                "difficulty": it.difficulty,
                "question": it.question,
                "answer": it.answer,
                "images": [rel],
                "probe": probe(it),
            }
            f.write(json.dumps(row) + "\n")
    return path


def write_sft(directory: str, records: list[dict[str, Any]]) -> str:
    """`sft.jsonl` + the records' PNGs under `directory` (drops `image_data` and `timing`)."""
    os.makedirs(os.path.join(directory, "img"), exist_ok=True)
    path = os.path.join(directory, "sft.jsonl")
    with open(path, "w") as f:
        for rec in records:
            for rel, data in zip(rec["images"], rec["image_data"], strict=True):
                _write_png(os.path.join(directory, rel), data)
            row = {k: v for k, v in rec.items() if k not in ("image_data", "timing")}
            f.write(json.dumps(row) + "\n")
    return path


def load_prompts(jsonl_path: str | os.PathLike) -> list[dict[str, Any]]:
    """Rows of a prompts.jsonl with `images` loaded as RGB PIL images (`image_paths` keeps the paths)."""
    from data.rl_prompts import read_prompts_jsonl

    return [{"id": p.id, "question": p.question, "answer": p.answer, **p.meta, "images": p.images,
             "image_paths": p.image_paths} for p in read_prompts_jsonl(jsonl_path)]


def run_experts(
    items: list[Item], pool, seed: int, *, error_rate: float, threads: int, easy_code_rate: float = 0.3,
    hard_direct_rate: float = 0.0, easy_code_families: tuple[str, ...] | None = None,
    hard_direct_families: tuple[str, ...] | None = None,
) -> list[dict[str, Any]]:
    """Expert records of `items`, in order; the cells (hard items, easy items with code) run
    concurrently in `pool`."""

    def one(i: int) -> dict[str, Any]:
        rng = np.random.default_rng([seed, SPLIT_CODES["sft"], i, 7])
        return expert_trajectory(items[i], pool.new_session, rng, error_rate=error_rate, easy_code_rate=easy_code_rate,
                                 hard_direct_rate=hard_direct_rate, easy_code_families=easy_code_families,
                                 hard_direct_families=hard_direct_families)

    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as ex:
        return list(ex.map(one, range(len(items))))


def _image_tokens(size: tuple[int, int], max_pixels: int) -> int:
    h, w = smart_resize(size[1], size[0], factor=28, min_pixels=3136, max_pixels=max_pixels)
    return (h // 28) * (w // 28)


def _stats(xs: list[int]) -> dict[str, float]:
    if not xs:
        return {"n": 0}
    a = np.asarray(xs)
    return {
        "n": len(xs),
        "mean": round(float(a.mean()), 1),
        "median": float(np.median(a)),
        "min": int(a.min()),
        "max": int(a.max()),
    }


def generate_world(
    out_dir: str | os.PathLike,
    *,
    n_sft: int,
    n_rl: int,
    n_eval: int,
    seed: int = 0,
    hard_frac: float = 0.5,
    pool=None,
    workers: int = 2,
    error_rate: float = 0.15,
    easy_code_rate: float = 0.3,
    hard_direct_rate: float = 0.0,
    easy_code_families: tuple[str, ...] | None = None,
    hard_direct_families: tuple[str, ...] | None = None,
    bars_questions: tuple[str, ...] = BARS_HARD_QUESTIONS,
    count_questions: tuple[str, ...] = ("count_target",),
    easy_count_colors: tuple[str, ...] = ANSWER_COLORS,
    count_target_rate: float | None = None,
    count_touch_rate: float = 0.0,
    find_colors: tuple[str, ...] = ANSWER_COLORS,
    n_val: int = 0,
    n_probe: int = 0,
    vocab_size: int = DEFAULT_VOCAB,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> dict[str, Any]:
    """Write the world (see the module docstring) and return the contents of world.json.

    `pool`: an open `SandboxPool` to use; without one a pool of `workers` workers is created and
    closed here. `workers` also sets the expert threads (4 per worker: session set-up and the
    host side overlap with cells).
    """
    t_start = time.monotonic()
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    qs = dict(bars_questions=tuple(bars_questions), count_questions=tuple(count_questions),
              easy_count_colors=tuple(easy_count_colors), count_target_rate=count_target_rate,
              count_touch_rate=count_touch_rate, find_colors=tuple(find_colors))
    # The SFT items have no touching shapes: there the expert's count would be wrong, and cold-start
    # data keeps only trajectories that reach the right answer (the paper filters its SFT data so).
    sft_items, _ = make_split("sft", n_sft, seed, hard_frac, **{**qs, "count_touch_rate": 0.0})
    rl_items, _ = make_split("rl", n_rl, seed, hard_frac, **qs)
    seen = {_key(it) for it in sft_items + rl_items}
    grid = grid_options(qs) if n_probe else qs
    val_items, val_redraws = make_split("val", n_val, seed, hard_frac, exclude=seen, **grid)
    seen |= {_key(it) for it in val_items}
    eval_items, redraws = make_split("eval", n_eval, seed, hard_frac, exclude=seen, **grid)
    seen |= {_key(it) for it in eval_items}
    probes = {sp: make_probes(sp, n_probe, seed, seen, **qs) if n_probe and n else []
              for sp, n in (("val", n_val), ("eval", n_eval))}

    t_sb = time.monotonic()
    for name, fams in (("easy_code_families", easy_code_families), ("hard_direct_families", hard_direct_families)):
        unknown = set(fams or ()) - set(FAMILIES)
        if unknown:
            raise ValueError(f"{name}: unknown families {sorted(unknown)}; expected some of {FAMILIES}")
    easy_code_families = None if easy_code_families is None else tuple(easy_code_families)
    hard_direct_families = None if hard_direct_families is None else tuple(hard_direct_families)
    knobs = dict(error_rate=error_rate, easy_code_rate=easy_code_rate, hard_direct_rate=hard_direct_rate,
                 easy_code_families=easy_code_families, hard_direct_families=hard_direct_families)
    if pool is None:
        from sandbox import SandboxPool

        with SandboxPool(num_workers=workers, **SANDBOX_LIMITS) as own:
            records = run_experts(sft_items, own, seed, threads=4 * workers, **knobs)
    else:
        records = run_experts(sft_items, pool, seed, threads=4 * workers, **knobs)
    sandbox_wall = time.monotonic() - t_sb

    sft_path = write_sft(os.path.join(out_dir, "sft"), records)
    write_prompts(os.path.join(out_dir, "rl"), rl_items)
    write_prompts(os.path.join(out_dir, "eval"), eval_items)
    if val_items:
        write_prompts(os.path.join(out_dir, "val"), val_items)
    for sp, items in probes.items():
        if items:
            write_prompts(os.path.join(out_dir, sp), items, "probes.jsonl")

    # Tokenizer corpus: every SFT text as rendered for training, and every RL / eval prompt.
    sft_msgs = [parse_record({k: r[k] for k in ("id", "images", "messages")})[2] for r in records]
    prompts = [[Message("user", user_content(it.question), 1)]
               for it in rl_items + val_items + eval_items + probes["val"] + probes["eval"]]
    texts = [render(m).text for m in sft_msgs] + [render(m).text for m in prompts]
    special = write_toy_processor_files(
        os.path.join(out_dir, "processor"), texts, vocab_size=vocab_size, max_pixels=max_pixels
    )

    from codedance_jax.processing import Processor

    proc = Processor.from_pretrained(os.path.join(out_dir, "processor"))
    tokens: dict[str, list[int]] = collections.defaultdict(list)
    for rec, msgs in zip(records, sft_msgs, strict=True):
        sizes = [Image.open(io.BytesIO(b)).size for b in rec["image_data"]]
        text = render(msgs, [_image_tokens(s, max_pixels) for s in sizes]).text
        n = len(proc.tokenizer.encode(text))
        tokens[rec["meta"]["difficulty"]].append(n)
        tokens["all"].append(n)

    def counts(items):
        c = collections.Counter(f"{it.family}/{it.difficulty}" for it in items)
        return dict(sorted(c.items()))

    errors = collections.Counter(r["meta"]["error"] for r in records if r["meta"]["error"])
    world = {
        "seed": seed,
        "hard_frac": hard_frac,
        "splits": {
            "sft": {"n": n_sft, "counts": counts(sft_items), "path": os.path.relpath(sft_path, out_dir)},
            "rl": {"n": n_rl, "counts": counts(rl_items), "path": "rl/prompts.jsonl"},
            "eval": {
                "n": n_eval,
                "counts": counts(eval_items),
                "path": "eval/prompts.jsonl",
                "redrawn_duplicates": redraws,
            },
            "val": {
                "n": n_val,
                "counts": counts(val_items),
                "path": "val/prompts.jsonl" if val_items else None,
                "redrawn_duplicates": val_redraws,
            },
        },
        "probes": {sp: dict(sorted(collections.Counter(probe(it) for it in items).items()))
                   for sp, items in probes.items()},
        "touching_items": {k: sum(1 for it in items if it.meta.get("touching"))
                           for k, items in (("rl", rl_items), ("val", val_items), ("eval", eval_items))},
        "sft_tokens_per_trajectory": {k: _stats(v) for k, v in sorted(tokens.items())},
        "recovered_errors": dict(sorted(errors.items())),
        "easy_code_rate": easy_code_rate,
        "easy_code_families": list(FAMILIES if easy_code_families is None else easy_code_families),
        "easy_items_with_code": sum(1 for r in records if r["meta"]["difficulty"] == "easy" and r["meta"]["cells"] > 0),
        "easy_items_with_code_by_family": dict(sorted(collections.Counter(
            r["meta"]["family"] for r in records if r["meta"]["difficulty"] == "easy" and r["meta"]["cells"] > 0).items())),
        "hard_direct_rate": hard_direct_rate,
        "hard_direct_families": list(FAMILIES if hard_direct_families is None else hard_direct_families),
        "hard_items_direct": sum(1 for r in records if r["meta"]["difficulty"] == "hard" and r["meta"]["cells"] == 0),
        "hard_items_direct_by_family": dict(sorted(collections.Counter(
            r["meta"]["family"] for r in records if r["meta"]["difficulty"] == "hard" and r["meta"]["cells"] == 0).items())),
        "bars_questions": list(bars_questions),
        "count_questions": list(count_questions),
        "easy_count_colors": list(easy_count_colors),
        "count_target_rate": count_target_rate,
        "count_touch_rate": count_touch_rate,
        "find_colors": list(find_colors),
        "error_rate": error_rate,
        "sandbox": {
            "cells": sum(r["meta"]["cells"] for r in records),
            "cell_s": round(sum(r["timing"]["sandbox_s"] for r in records), 2),
            "wall_s": round(sandbox_wall, 2),
        },
        "vocab_size": len(proc.tokenizer),
        "bpe_vocab_size": min(special.values()),
        "special_ids": special,
        "generation_s": round(time.monotonic() - t_start, 2),
    }
    with open(os.path.join(out_dir, "world.json"), "w") as f:
        json.dump(world, f, indent=2)
    return world
