"""TFDS array_record build + grain pipeline: loss masks, batch contract, buckets, sharding, resume."""

import io
import json
import os

import numpy as np
import pytest
from data_helpers import multi_turn_record, write_jsonl, write_png
from PIL import Image

from codedance_jax.model.rope import mrope_positions
from codedance_jax.model.vision import make_plan
from codedance_jax.train.batching import check_buckets
from data import chat, sft_tfds
from data.featurize import featurize
from data.sft_pipeline import make_sft_iterator
from data.trajectory import MalformedRecordError, read_jsonl

BUCKETS = [(128, 16, 8), (256, 32, 16), (512, 64, 32)]
NUM_GOOD = 12  # records that fit a bucket
LONG_LINE = 14  # the line of the record that fits none


def _records(tmp):
    rng = np.random.default_rng(0)
    words = "bar chart value axis label crop zoom count red blue".split()
    recs = [multi_turn_record()]
    for i in range(1, NUM_GOOD):
        n_img = i % 3  # 0, 1 or 2 images in the user turn
        paths = []
        for j in range(n_img):
            h, w = (int(x) for x in rng.integers(30, 130, 2))
            write_png(os.path.join(tmp, f"img/{i}_{j}.png"), h, w, seed=100 * i + j)
            paths.append(f"img/{i}_{j}.png")
        question = " ".join(rng.choice(words, 4 + 2 * i * i))
        turns = [{"role": "user", "content": "<image>" * n_img + f"Q{i}: {question}"}]
        for t in range(1 + i % 2):
            turns += [
                {
                    "role": "assistant",
                    "content": f"<think>step {t}</think>\n<code>\n```python\nprint({t})\n```\n</code>",
                },
                {"role": "observation", "content": f"{t}"},
            ]
        turns.append({"role": "assistant", "content": f"<answer>{i}</answer>"})
        recs.append({"id": f"r{i}", "images": paths, "messages": turns})
    recs.append('{"broken": ')  # line 13: counted by the builder
    recs.append(
        {
            "id": "long",
            "images": [],
            "messages": [{"role": "user", "content": "word " * 700}, {"role": "assistant", "content": "x"}],
        }
    )
    return recs


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("sft"))
    write_png(os.path.join(tmp, "img/q.png"), 60, 80, 0)
    write_png(os.path.join(tmp, "img/crop.png"), 56, 56, 1)
    path = write_jsonl(os.path.join(tmp, "train.jsonl"), _records(tmp))
    report = sft_tfds.build_dataset([path], os.path.join(tmp, "tfds"), "tiny")
    return path, os.path.join(tmp, "tfds"), report


def _iter(built, processor, model_cfg, **kw):
    args = dict(batch_size=2, buckets=BUCKETS, seed=3, shard_index=0, shard_count=1, num_threads=2)
    args.update(kw)
    return make_sft_iterator(sft_tfds.open_source(built[1], "tiny"), processor, model_cfg, **args)


def _rows(batch):
    """Each row's unpadded token ids, as a tuple (identifies the trajectory)."""
    return [tuple(ids[m == 1]) for ids, m in zip(batch["input_ids"], batch["attention_mask"], strict=True)]


def test_build_reports_and_reads_back(built):
    path, data_dir, report = built
    assert report.num_ok == NUM_GOOD + 1 and dict(report.counts) == {"bad_json": 1}
    assert (report.problems[0].file, report.problems[0].line) == (path, 13)
    with open(os.path.join(sft_tfds.dataset_dir(data_dir, "tiny"), sft_tfds.REPORT_FILE)) as f:
        assert json.load(f)["counts"] == {"bad_json": 1}
    source = sft_tfds.open_source(data_dir, "tiny")
    assert len(source) == NUM_GOOD + 1
    want = {t.id: t for t in read_jsonl([path])}
    for i in range(len(source)):
        got = sft_tfds.to_trajectory(source[i])
        assert got == want[got.id]  # messages, PNG bytes and source line survive the round trip
    again = sft_tfds.build_dataset([path], data_dir, "tiny")  # reuses the data and its report
    assert dict(again.counts) == {"bad_json": 1}


def test_builder_stop_mode_raises_file_line(built, tmp_path):
    with pytest.raises(MalformedRecordError, match=r"train\.jsonl:13: bad_json"):
        sft_tfds.build_dataset([built[0]], tmp_path / "stop", "tiny", on_error="stop")


def test_loss_mask_is_exactly_the_assistant_tokens(built, processor, model_cfg):
    (traj,) = [t for t in read_jsonl([built[0]]) if t.id == "mt-0"]
    it = make_sft_iterator([traj], processor, model_cfg, batch_size=1, buckets=BUCKETS, shard_index=0, shard_count=1)
    batch = next(it)
    n = int(batch["attention_mask"][0].sum())
    ids, tgt, mask = batch["input_ids"][0, :n], batch["targets"][0], batch["loss_mask"][0]
    assistant = [m.content for m in traj.messages if m.role == "assistant"]
    assert processor.decode(tgt[mask == 1]) == "".join(a + "<|im_end|>" for a in assistant)
    # Trained tokens are contiguous runs, one per assistant turn; observation and image tokens are never trained.
    runs = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])) == 1)
    assert len(runs) == 2
    assert not mask[tgt == processor.image_token_id].any() and mask[n - 1 :].sum() == 0
    assert int(batch["num_tokens"][0]) == int(mask.sum())
    # One tokenization of the whole conversation gives exactly the processor's ids (no drift).
    text = processor.apply_chat_template(chat.template_messages(traj.messages))
    images = [Image.open(io.BytesIO(b)) for b in traj.images]
    np.testing.assert_array_equal(processor(text=[text], images=images)["input_ids"][0], ids)
    np.testing.assert_array_equal(tgt[: n - 1], ids[1:])


def test_batch_contract_vision_plan_and_positions(built, processor, model_cfg, grids):
    vc = model_cfg.vision
    q, u = vc.merge_unit, vc.window_merged**2
    seen = 0
    for batch in _iter(built, processor, model_cfg, num_epochs=1):
        b, t = batch["input_ids"].shape
        nb = batch["out_index"].shape[1]
        wb = batch["unit_src"].shape[1] // u
        assert (t, nb, wb) in BUCKETS
        shapes = {
            "attention_mask": (b, t),
            "targets": (b, t),
            "loss_mask": (b, t),
            "positions": (3, b, t),
            "pixel_values": (b, nb * q, vc.patch_dim),
            "pos_hw": (b, wb * u * q, 2),
            "image_id": (b, wb * u),
            "num_tokens": (b,),
        }
        assert {k: batch[k].shape for k in shapes} == shapes
        assert batch["loss_mask"].dtype == np.float32 and batch["pixel_values"].dtype == np.float32
        assert all(batch[k].dtype == np.int32 for k in batch if k not in ("loss_mask", "pixel_values"))
        for r in range(b):
            ids = batch["input_ids"][r]
            n_img = int((ids == model_cfg.image_token_id).sum())
            grid = grids[_rows(batch)[r]]
            pos, _ = mrope_positions(
                ids[None],
                batch["attention_mask"][r][None],
                grid,
                image_token_id=model_cfg.image_token_id,
                spatial_merge_size=vc.spatial_merge_size,
            )
            np.testing.assert_array_equal(batch["positions"][:, r], pos[:, 0])
            plan = make_plan(grid if grid is not None else np.zeros((0, 3)), vc, num_windows=wb, num_units=nb)
            for k in ("unit_src", "pos_hw", "image_id", "out_index"):
                np.testing.assert_array_equal(batch[k][r], getattr(plan, k))
            # Image features line up: one valid merged unit per image token of the row.
            assert plan.num_units == n_img == int((batch["unit_src"][r] >= 0).sum())
            assert np.abs(batch["pixel_values"][r, n_img * q :]).sum() == 0
            if n_img:
                assert np.abs(batch["pixel_values"][r, : n_img * q]).sum() > 0
            seen += 1
    assert seen == NUM_GOOD


@pytest.fixture(scope="module")
def grids(built, processor, model_cfg):
    """Unpadded token ids of each good record -> its image_grid_thw (None without images)."""
    buckets = check_buckets(BUCKETS)
    out = {}
    for t in read_jsonl([built[0]]):
        ex = featurize(t, processor, model_cfg, buckets)
        out[tuple(ex.input_ids)] = ex.grid_thw if len(ex.grid_thw) else None
    return out


def test_too_long_is_counted_and_stop_raises(built, processor, model_cfg):
    it = _iter(built, processor, model_cfg, num_epochs=1)
    batches = list(it)
    assert sum(len(b["input_ids"]) for b in batches) == NUM_GOOD
    assert it.report.counts["too_long"] == 1
    (p,) = it.report.problems
    assert (p.file, p.line, p.kind) == (built[0], LONG_LINE, "too_long")
    with pytest.raises(MalformedRecordError, match=rf"train\.jsonl:{LONG_LINE}: too_long"):
        list(_iter(built, processor, model_cfg, num_epochs=1, on_error="stop"))


def test_buckets_bound_the_shapes(built, processor, model_cfg):
    for batch_size in (1, 3):
        shapes = set()
        for batch in _iter(built, processor, model_cfg, num_epochs=3, batch_size=batch_size):
            shapes.add(tuple(v.shape for v in batch.values()))
        assert 1 < len(shapes) <= len(BUCKETS)
        assert {s[0][1] for s in shapes} <= {b[0] for b in BUCKETS}
    # Hosts agreeing on the largest bucket: every batch gets that shape.
    it = _iter(built, processor, model_cfg, num_epochs=1, agree_bucket=lambda i: len(BUCKETS) - 1)
    assert {b["input_ids"].shape[1] for b in it} == {BUCKETS[-1][0]}


def test_host_shards_are_disjoint_and_cover(built, processor, model_cfg):
    kw = dict(batch_size=1, num_epochs=1, shard_count=3, drop_remainder=False)
    shards = [sum((_rows(b) for b in _iter(built, processor, model_cfg, shard_index=i, **kw)), []) for i in range(3)]
    sets = [set(s) for s in shards]
    assert all(len(s) == len(set(s)) for s in shards)
    assert not (sets[0] & sets[1]) and not (sets[0] & sets[2]) and not (sets[1] & sets[2])
    assert len(sets[0] | sets[1] | sets[2]) == NUM_GOOD


def test_order_is_deterministic_and_state_resumes(built, processor, model_cfg):
    def run(seed, skip=0, state=None, n=6):
        it = _iter(built, processor, model_cfg, num_epochs=None, seed=seed)
        if state is not None:
            it.set_state(json.loads(json.dumps(state)))  # what a checkpoint stores
        for _ in range(skip):
            next(it)
        return it, [_rows(next(it)) for _ in range(n)]

    _, a = run(3)
    _, b = run(3)
    _, c = run(4)
    assert a == b and a != c
    it, _ = run(3, n=2)
    state = it.get_state()
    _, resumed = run(3, state=state, n=4)
    assert resumed == a[2:6]


def test_example_cache_gives_the_same_batches_and_featurizes_each_record_once(built, processor, model_cfg, monkeypatch):
    from data import featurize as features

    calls = []
    real = features.featurize
    monkeypatch.setattr(features, "featurize", lambda traj, *a, **k: calls.append(traj.source) or real(traj, *a, **k))
    n = 3 * NUM_GOOD  # three epochs of batch 1
    kw = dict(batch_size=1, num_epochs=None, group_window=2)
    plain = [next(it) for it in [_iter(built, processor, model_cfg, **kw)] for _ in range(n)]
    uncached_calls, calls[:] = len(calls), []
    cached_it = _iter(built, processor, model_cfg, cache_mb=64, **kw)
    cached = [next(cached_it) for _ in range(n)]
    # Each record featurized once, then read back (prefetch threads may start the next epoch's copy
    # of a record before this epoch's is cached: a few duplicates, harmless), against every epoch.
    assert len(set(calls)) >= NUM_GOOD
    assert len(calls) <= 1.5 * len(set(calls)) and uncached_calls >= n
    for a, b in zip(plain, cached, strict=True):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    # A budget smaller than one example caches nothing: the same batches, featurized every epoch.
    calls[:] = []
    tiny_it = _iter(built, processor, model_cfg, cache_mb=1e-6, **kw)
    assert all(np.array_equal(next(tiny_it)["input_ids"], p["input_ids"]) for p in plain)
    assert len(calls) >= n


@pytest.mark.parametrize("fmt", ["code", "tool_call"])
def test_loss_mask_with_unicode_and_tool_call_format(tmp_path, processor, model_cfg, fmt):
    """Offsets are characters, not bytes: multi-byte text keeps the mask exact, in both turn formats."""
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>'
    record = {
        "id": "u",
        "images": [],
        "messages": [
            {"role": "user", "content": "图里有几根柱子？ 🙂"},
            {"role": "assistant", "content": f"<think>先数一数 — ça va ✓</think>\n{call}"},
            {"role": "observation", "content": "温度 25°C ✓"},
            {"role": "assistant", "content": "<answer>三</answer>"},
        ],
    }
    (traj,) = read_jsonl([write_jsonl(tmp_path / "u.jsonl", [record])])
    it = make_sft_iterator(
        [traj], processor, model_cfg, batch_size=1, buckets=BUCKETS, shard_index=0, shard_count=1, turn_format=fmt
    )
    batch = next(it)
    mask = batch["loss_mask"][0]
    want = "".join(m.content + "<|im_end|>" for m in traj.messages if m.role == "assistant")
    assert processor.decode(batch["targets"][0][mask == 1]) == want
    tag = {"code": "interpreter", "tool_call": "tool_response"}[fmt]
    assert f"<{tag}>\n温度 25°C ✓\n</{tag}>" in processor.decode(batch["input_ids"][0])


def test_padded_row_gives_the_same_image_features_as_unpadded(built, processor, model_cfg, grids):
    """The tiny vision tower on a padded batch row: its first n features equal the unpadded encoding."""
    import jax
    from flax import nnx

    from codedance_jax.model.vision import VisionTower

    # Random weights without tracing the initializers (each would compile: ~20 s on CPU).
    graphdef, state = nnx.split(
        nnx.eval_shape(lambda: VisionTower(model_cfg.vision, dtype=jax.numpy.float32, rngs=nnx.Rngs(0)))
    )
    rng = np.random.default_rng(0)
    state = jax.tree.map(lambda x: (0.1 * rng.standard_normal(x.shape)).astype(np.float32), state)
    tower = nnx.merge(graphdef, state)
    encode = nnx.jit(lambda m, *a: m(*a), graph=False)
    keys = ("pixel_values", "unit_src", "pos_hw", "image_id", "out_index")
    (traj,) = [t for t in read_jsonl([built[0]]) if t.id == "mt-0"]
    batch = next(
        make_sft_iterator([traj], processor, model_cfg, batch_size=1, buckets=BUCKETS[1:], shard_index=0, shard_count=1)
    )
    grid = grids[_rows(batch)[0]]
    pixel_values, _ = processor.encode_images([Image.open(io.BytesIO(b)) for b in traj.images])
    plan = make_plan(grid, model_cfg.vision)
    want = encode(
        tower, pixel_values[None], plan.unit_src[None], plan.pos_hw[None], plan.image_id[None], plan.out_index[None]
    )[0]
    got = encode(tower, *(batch[k] for k in keys))[0]  # the tower takes the batch as its group axis
    n = plan.num_units
    assert got.shape[0] == BUCKETS[1][1] and n == int((batch["input_ids"][0] == model_cfg.image_token_id).sum())
    np.testing.assert_allclose(np.asarray(got[:n]), np.asarray(want), rtol=1e-5, atol=1e-5)


def _segments(batch):
    """Each packed example's token ids (by segment), as tuples."""
    out = []
    for ids, seg in zip(batch["input_ids"], batch["segment_ids"], strict=True):
        out += [tuple(ids[seg == k]) for k in range(1, int(seg.max()) + 1)]
    return out


def test_packed_batches_hold_the_same_examples_in_fewer_rows(built, processor, model_cfg):
    """data.pack: the same examples per batch, in the same order of batches, several to a row; the
    same loss tokens; rows a multiple of pack_row_multiple; hosts agree on the row count."""
    pack = tuple(max(b[i] for b in BUCKETS) * (2 if i == 0 else 1) for i in range(3))
    plain = _iter(built, processor, model_cfg, num_epochs=1, batch_size=3)
    packed = _iter(built, processor, model_cfg, num_epochs=1, batch_size=3, pack=pack, pack_row_multiple=2)
    n = 0
    for a, b in zip(plain, packed, strict=True):
        assert sorted(_rows(a)) == sorted(_segments(b))
        assert a["loss_mask"].sum() == b["loss_mask"].sum() and b["input_ids"].shape[1] == pack[0]
        assert b["input_ids"].shape[0] % 2 == 0 and b["input_ids"].shape[0] <= 4
        n += 1
    assert n > 1
    agreed = _iter(built, processor, model_cfg, num_epochs=1, batch_size=3, pack=pack, agree_bucket=lambda i: 3)
    assert {b["input_ids"].shape[0] for b in agreed} == {3}
    with pytest.raises(ValueError, match="must hold the largest bucket"):
        _iter(built, processor, model_cfg, pack=(8, 1, 1))
