"""The turn loop on the tiny model with a scripted sandbox (fakes.FakePool) and scripted policies.

Every test that compares numbers recomputes the trajectory with ONE full forward over its final
tokens and images (the trainer's `token_logprobs`) and requires the recorded log-probs of the
sampled tokens to match: that checks at once that the cache held exactly `tokens`, that images
appended mid-trajectory are in context, and that their M-RoPE positions equal a full recomputation.
"""

import jax
import numpy as np
import pytest
from fakes import FakePool
from rollout_helpers import full_logprobs, random_image, small_config

from codedance_jax.protocol import render_observation
from codedance_jax.rollout import RolloutEngine, SamplingConfig, load_jsonl, rl_prompt, save_jsonl

ATOL = 2e-4  # |recorded - recomputed| log-prob; observed ~1e-6 in float32

CODE_IMG = '<think>crop</think>\n<code>\n```python\nshow(56, 56)\nprint("size 56")\n```\n</code>'
ANSWER = "<think>so</think>\n<answer>42</answer>"


@pytest.fixture(scope="module")
def engine(model, processor):
    return RolloutEngine(model, processor, small_config(), SamplingConfig(greedy=True))


def make_prompts(processor, n, seed=0, fmt="code"):
    return [
        rl_prompt(processor, f"q{seed}-{i}", f"What is shown? ({seed}, {i})", [random_image(seed * 10 + i)], fmt)
        for i in range(n)
    ]


def assert_logprobs_match(model, processor, trajs, temperature=1.0):
    ref = full_logprobs(model, processor, trajs, temperature)
    for t, lp in zip(trajs, ref, strict=True):
        m = np.asarray(t.loss_mask, bool)
        assert m.sum() > 0
        np.testing.assert_allclose(np.asarray(t.logprobs)[m], lp[m], atol=ATOL, err_msg=t.id)
        assert np.all(np.asarray(t.logprobs)[~m] == 0)
    return ref


def test_greedy_cache_sampling_equals_full_forward(engine, model, processor):
    trajs, stats = engine.rollout(make_prompts(processor, 3), group_size=2)
    assert_logprobs_match(model, processor, trajs)
    for t in trajs:
        assert t.finish_reason in ("turn_tokens", "stop", "answer")
        sampled = np.nonzero(t.loss_mask)[0]
        assert len(sampled) == engine.cfg.max_turn_tokens or t.finish_reason != "turn_tokens"
    for a, b in zip(trajs[::2], trajs[1::2], strict=True):  # greedy group members agree
        assert a.tokens == b.tokens
    assert stats.generated_tokens == sum(sum(t.loss_mask) for t in trajs)
    # Argmax check with the full forward's logits at the sampled positions of one row.
    _check_argmax(model, processor, trajs[0])


def _check_argmax(model, processor, t):
    logits = np.asarray(model(np.asarray([t.tokens]), None, *processor.encode_images(t.images)))[0]
    limit = len(processor.tokenizer)
    for pos in np.nonzero(t.loss_mask)[0]:
        assert int(np.argmax(logits[pos - 1, :limit])) == t.tokens[pos]


def test_code_turn_with_image_continues_with_image_in_context(engine, model, processor):
    pool = FakePool()
    scripts = {(0, 0): CODE_IMG, (1, 0): '<code>\n```python\nprint("hi")\n```\n</code>', (1, 1): ANSWER}
    trajs, stats = engine.rollout(make_prompts(processor, 2, seed=1), 1, pool, script=lambda r, m: scripts.get((r, m)))
    t0, t1 = trajs
    assert t0.turn_status == ["ok", "no_code"] and t0.finish_reason == "turn_tokens"  # turn 1 sampled to its budget
    assert len(t0.images) == 2 and t0.image_grid_thw == [[1, 4, 6], [1, 4, 4]]
    assert t1.turn_status == ["ok", "no_code"] and t1.answer == "42" and t1.finish_reason == "answer"
    assert t1.num_tool_calls == 1 and t1.num_executions == 1 and len(t1.images) == 1

    # Token in, token out: prompt, the scripted turn, the observation exactly as rendered, turn 1.
    tok = processor.tokenizer
    code_ids = tok.encode(CODE_IMG)
    obs_ids = tok.encode(render_observation("size 56", [4]))
    p = t0.prompt_len
    assert t0.tokens[p : p + len(code_ids)] == code_ids
    assert t0.tokens[p + len(code_ids) : p + len(code_ids) + len(obs_ids)] == obs_ids
    n1 = engine.cfg.max_turn_tokens
    assert t0.loss_mask == [0] * p + [1] * len(code_ids) + [0] * len(obs_ids) + [1] * n1
    assert t0.turn_ids == [-1] * p + [0] * len(code_ids) + [-1] * len(obs_ids) + [1] * n1
    # Sessions open in the order rows reach `<code>`, not in row order.
    assert all(s.files.keys() == {"image.png"} for s in pool.sessions)
    assert sorted(s.calls for s in pool.sessions) == [['print("hi")\n'], ['show(56, 56)\nprint("size 56")\n']]

    ref = assert_logprobs_match(model, processor, trajs)
    # Control: another picture in place of the observation's image changes what follows it.
    other = full_logprobs(model, processor, trajs, replace_images={(0, 1): random_image(99, 56, 56)})
    after = np.asarray(t0.turn_ids) == 1
    assert np.abs(other[0][after] - ref[0][after]).max() > 1e-3


def test_turn_statuses_failures_and_loss_masks(engine, model, processor):
    code = "<code>\n```python\n{}\n```\n</code>"
    first = [
        code.format("raise"),  # error
        code.format("while True: pass"),  # timeout
        code.format("os._exit(1)"),  # crashed
        "<code>x = 1</code>",  # malformed: no fenced block, never executed
        code.format("boom"),  # submit raises: crashed
        code.format("garbage"),  # the result cannot be handled: this row ends with an error
        '<code>\n```python\nprint("a")\n```\n</code>\n',  # '>\n' is one token: the host check stops it
        ANSWER,
    ]
    pool = FakePool(delay_s=0.01)
    trajs, stats = engine.rollout(
        make_prompts(processor, 8, seed=2), 1, pool, script=lambda r, m: first[r] if m == 0 else ANSWER
    )
    got = [(t.turn_status, t.finish_reason) for t in trajs]
    assert got == [
        (["error", "no_code"], "answer"),
        (["timeout", "no_code"], "answer"),
        (["crashed", "no_code"], "answer"),
        (["error", "no_code"], "answer"),
        (["crashed", "no_code"], "answer"),
        ([], "error"),
        (["ok", "no_code"], "answer"),
        (["no_code"], "answer"),
    ]
    assert "malformed code block" in trajs[3].turns[0]["observation"] and trajs[3].num_executions == 0
    assert "session lost" in trajs[4].turns[0]["observation"]
    assert "AttributeError" in trajs[5].error
    assert trajs[1].turns[0]["observation"].endswith("[status: timeout]")
    assert stats.rollbacks == 1
    rolled = trajs[6]
    turn0 = [x for x, m in zip(rolled.tokens, rolled.turn_ids, strict=True) if m == 0]
    assert processor.decode(turn0).endswith("</code>\n")  # the stop token is kept, nothing after it
    assert rolled.tokens[rolled.prompt_len + len(turn0)] == processor.im_end_id
    for t in trajs:
        assert all((m == 1) == (i >= 0) for m, i in zip(t.loss_mask, t.turn_ids, strict=True))
    ok = [t for t in trajs if t.finish_reason != "error"]
    assert_logprobs_match(model, processor, ok)  # the rolled-back tokens are not in the cache


def test_budgets(model, processor):
    pool = FakePool()
    cfg = small_config(max_turns=2, max_new_tokens=60)
    engine = RolloutEngine(model, processor, cfg, SamplingConfig(greedy=True))
    short = "<code>\n```python\nshow(56, 56)\n```\n</code>"
    scripts = [lambda m: short, lambda m: None, lambda m: CODE_IMG if m == 0 else None]
    trajs, _ = engine.rollout(make_prompts(processor, 3, seed=3), 1, pool, script=lambda r, m: scripts[r](m))
    t0, t1, t2 = trajs
    # Turn budget: code in every turn; the last turn's code runs but nothing is appended after it.
    assert t0.finish_reason == "max_turns" and t0.turn_status == ["ok", "ok"] and t0.num_executions == 2
    assert len(t0.images) == 2 and t0.turn_ids[-1] == 1 and t0.loss_mask[-1] == 1
    assert t1.finish_reason == "turn_tokens" and sum(t1.loss_mask) == cfg.max_turn_tokens
    assert t2.finish_reason == "new_tokens" and sum(t2.loss_mask) == cfg.max_new_tokens
    assert all(max(t.turn_ids) < cfg.max_turns for t in trajs)


def test_tool_call_format(model, processor):
    engine = RolloutEngine(model, processor, small_config(turn_format="tool_call"), SamplingConfig(greedy=True))
    call = '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "show(56, 56)\\nprint(\\"ok\\")"}}\n</tool_call>'
    scripts = {(0, 0): call, (0, 1): ANSWER, (1, 0): "<tool_call>\n{not json}\n</tool_call>", (1, 1): ANSWER}
    pool = FakePool()
    trajs, _ = engine.rollout(
        make_prompts(processor, 2, seed=4, fmt="tool_call"), 1, pool, script=lambda r, m: scripts.get((r, m))
    )
    t0, t1 = trajs
    assert t0.turn_status == ["ok", "no_code"] and t0.answer == "42" and len(t0.images) == 2
    assert pool.sessions[0].calls == ['show(56, 56)\nprint("ok")']
    text = processor.decode(t0.tokens[t0.prompt_len :])
    assert "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nok\n</tool_response><|vision_start|>" in text
    assert t1.turn_status == ["error", "no_code"] and "not valid JSON" in t1.turns[0]["observation"]
    assert_logprobs_match(model, processor, trajs)


def test_no_new_compilations_after_warmup(engine, processor):
    pool = FakePool()

    def script_a(r, m):
        return [CODE_IMG, None][r % 2] if m == 0 else ANSWER

    def script_b(r, m):  # other content, other lengths, an image of another size in the same bucket
        return ["<code>\n```python\nshow(56, 84)\n```\n</code>", ANSWER][r % 2] if m == 0 else "<answer>7</answer>"

    engine.rollout(make_prompts(processor, 4, seed=5), 1, pool, script=script_a)
    trajs, stats = engine.rollout(make_prompts(processor, 4, seed=6), 1, pool, script=script_b)
    assert trajs[0].image_grid_thw[-1] == [1, 6, 4] and trajs[1].answer == "42"
    assert stats.compiles == 0


def test_sampling_is_seeded_and_reproducible(model, processor, tmp_path):
    prompts = make_prompts(processor, 2, seed=7)
    script = {(0, 0): CODE_IMG}

    def run(seed, overlap, delay=0.0):
        eng = RolloutEngine(model, processor, small_config(overlap=overlap), SamplingConfig(temperature=1.0, seed=seed))
        return eng.rollout(prompts, 2, FakePool(delay), script=lambda r, m: script.get((r % 2, m)))

    # The sequential schedule is deterministic; with overlap the schedule follows sandbox timing,
    # and keys are per row and token, but sampling near-uniform tiny-model distributions can
    # still flip on float reduction-order differences, so only the sequential runs are compared.
    a, _ = run(0, False)
    b, _ = run(0, False)
    c, _ = run(1, False)
    d, stats = run(0, True, delay=0.02)
    assert [t.tokens for t in a] == [t.tokens for t in b] and [t.logprobs for t in a] == [t.logprobs for t in b]
    assert [t.tokens for t in a] != [t.tokens for t in c]
    assert a[0].tokens != a[1].tokens  # group members draw differently
    assert_logprobs_match(model, processor, a + d[:2])
    assert stats.executions == 2 and d[0].turn_status[0] == "ok"

    # Records round-trip through JSON lines + PNGs, and still recompute to their log-probs.
    path = save_jsonl(a, tmp_path)
    back = load_jsonl(path)
    assert [t.tokens for t in back] == [t.tokens for t in a] and back[0].images[1].size == a[0].images[1].size
    assert back[0].turn_status == a[0].turn_status and back[0].temperature == 1.0
    assert_logprobs_match(model, processor, back)


def test_turn_text_and_vision_inputs_are_recorded(engine, processor, tmp_path):
    """Each turn's `text` is the decode of exactly its sampled ids; each image's vision input (the
    prompt's, then the observations') is kept in memory in image order, and left out of the JSONL."""
    import json

    scripts = {(0, 0): CODE_IMG, (0, 1): ANSWER, (1, 0): CODE_IMG}
    trajs, _ = engine.rollout(make_prompts(processor, 2, seed=5), group_size=2, sandbox=FakePool(),
                              script=lambda r, m: scripts.get((r, m)))
    assert len(trajs[0].images) == 2 and len(trajs[1].images) == 2 and trajs[0].answer == "42"
    for t in trajs:
        tokens, turn_ids = np.asarray(t.tokens), np.asarray(t.turn_ids)
        assert len(t.turns) == turn_ids.max() + 1
        for m, turn in enumerate(t.turns):
            assert turn["text"] == processor.decode(tokens[turn_ids == m].tolist()), (t.id, m)
        assert len(t.vision) == len(t.images) == len(t.image_grid_thw)
        for (pv, grid), im, want in zip(t.vision, t.images, t.image_grid_thw, strict=True):
            assert grid.tolist() == want and pv.shape[0] == np.prod(want)
            np.testing.assert_array_equal(pv, processor.encode_images([im])[0])
    assert trajs[0].turns[0]["text"] == CODE_IMG and trajs[0].turns[1]["text"] == ANSWER

    path = save_jsonl(trajs, tmp_path)
    with open(path) as f:
        recs = [json.loads(line) for line in f]
    assert all("vision" not in r for r in recs)
    assert [[u["text"] for u in r["turns"]] for r in recs] == [[u["text"] for u in t.turns] for t in trajs]
    back = load_jsonl(path)
    assert all(t.vision == [] for t in back) and [t.turns for t in back] == [t.turns for t in trajs]


def test_batched_appends_keep_trajectories_and_save_calls(model, processor):
    """append_min_frac only changes when observations are appended, not what the rows see."""
    prompts = make_prompts(processor, 4, seed=9)

    def script(r, m):
        return ['<code>\n```python\nprint("a")\n```\n</code>', ANSWER][min(m, 1)] if r % 4 else ANSWER

    out = {}
    for frac in (0.0, 1.0):
        eng = RolloutEngine(model, processor, small_config(append_min_frac=frac), SamplingConfig(greedy=True))
        out[frac] = eng.rollout(prompts, 2, FakePool(0.01), script=script)
    (a, sa), (b, sb) = out[0.0], out[1.0]
    assert [t.tokens for t in a] == [t.tokens for t in b]
    np.testing.assert_allclose(np.concatenate([t.logprobs for t in a]), np.concatenate([t.logprobs for t in b]),
                               atol=1e-5)
    assert sb.appends <= sa.appends and sb.appends >= 1


def test_sessions_open_only_for_rows_that_write_the_tool_call_tag(model, processor):
    """A row gets a sandbox session when its turn first shows `<code>` (while the block is still
    being decoded), never if it answers without it; each with its own prompt's image, all closed."""
    import time

    from codedance_jax.rollout.prompts import session_files

    prompts = make_prompts(processor, 3, seed=13)
    mention = "<think>maybe <code> helps, no</think>\n<answer>7</answer>"  # the tag, but no call

    def script(r, m):
        if r % 4 == 0:
            return CODE_IMG if m == 0 else ANSWER
        return mention if r % 4 == 1 else ANSWER

    pool = FakePool(0.01)
    eng = RolloutEngine(model, processor, small_config(), SamplingConfig(greedy=True))
    trajs, stats = eng.rollout(prompts, 4, pool, script=script)
    coders = [i for i in range(12) if i % 4 == 0]
    assert [t.turn_status[0] for t in trajs] == ["ok" if i in coders else "no_code" for i in range(12)]
    assert stats.executions == len(coders)
    assert len(pool.sessions) == 6  # rows 0, 1, 4, 5, 8, 9: the tag, not the call, opens a session
    want = sorted(tuple(sorted(session_files(prompts[i // 4].images).items())) for i in range(12) if i % 4 < 2)
    assert sorted(tuple(sorted(s.files.items())) for s in pool.sessions) == want
    assert sorted(len(s.calls) for s in pool.sessions) == [0, 0, 0, 1, 1, 1]
    deadline = time.time() + 10
    while not all(s.closed for s in pool.sessions) and time.time() < deadline:
        time.sleep(0.01)
    assert all(s.closed for s in pool.sessions)


def test_shared_prefill_and_row_subsets_keep_trajectories(model, processor):
    """Each prompt is prefilled once for its group, appends / decode chunks run only the rows
    taking part (row buckets of batch_multiple x 2^k) and the KV cache grows on demand
    (`cache_grow`): the trajectories are those of whole-batch calls into a full-size cache."""
    prompts = make_prompts(processor, 3, seed=11)

    def script(r, m):  # rows 0, 3, 6, ...: code with an image, then answer; others answer / sample
        if r % 3 == 0:
            return CODE_IMG if m == 0 else ANSWER
        return ANSWER if r % 3 == 1 else None

    out = {}
    for mult in (4, 16):  # 12 rows: buckets 4, 8, 12 (subsets) vs one bucket of 16 (whole batch)
        grow = 64 if mult == 4 else 0  # 64 slots, grown to the 256-token prompt, then by 64 to 512
        eng = RolloutEngine(model, processor, small_config(batch_multiple=mult, cache_grow=grow), SamplingConfig(greedy=True))
        out[mult] = eng.rollout(prompts, 4, FakePool(0.01), script=script)
    (a, sa), (b, sb) = out[4], out[16]
    assert [t.tokens for t in a] == [t.tokens for t in b]
    np.testing.assert_allclose(np.concatenate([t.logprobs for t in a]), np.concatenate([t.logprobs for t in b]),
                               atol=1e-5)
    assert a[0].turn_status[0] == "ok" and a[0].image_grid_thw == b[0].image_grid_thw and len(a[0].images) == 2
    assert sa.executions == sb.executions == 4
    assert sa.cache_growths >= 2 and sb.cache_growths == 0
    assert_logprobs_match(model, processor, a)


def test_a_growing_cache_takes_a_chunk_past_its_full_size_by_growing_then_compacting(model, processor):
    """A chunk that fits neither the grown nor the full-size cache as it stands (write index near
    the end) grows the cache to its full size and compacts there, as a full-size cache would; the
    demo's sampled evaluation once failed here (512 of 640 slots, a 192-token observation)."""
    from codedance_jax.rollout.config import RolloutStats
    from codedance_jax.rollout.device_batch import DeviceBatch
    from codedance_jax.rollout.engine import RolloutState
    from codedance_jax.rollout.rows import pad_row

    eng = RolloutEngine(model, processor, small_config(cache_len=512, cache_grow=256), SamplingConfig(greedy=True))
    # 250 slots used, all holes (nothing valid); no sandbox side: only the cache is exercised
    batch = DeviceBatch(model.init_cache(8, 256), index=250)
    st = RolloutState(rows=[pad_row(i) for i in range(8)], batch=batch, host=None, stats=RolloutStats())
    eng._ensure_room(st, 300)  # 550 > 512: grow to 512, then compaction frees the holes
    assert batch.cache.max_len == 512 and batch.index == 0
    assert st.stats.cache_growths == 1 and st.stats.compactions == 1


def test_release_drops_the_cache_and_weights_until_set_model(model, processor):
    """Between GRPO steps the engine keeps no device arrays (`release`): the update and the next
    placement get the chips' memory. Rolling out before `set_model` is a clear error; after it,
    the trajectories are the unreleased engine's."""
    eng = RolloutEngine(model, processor, small_config(), SamplingConfig(greedy=True))
    prompts = make_prompts(processor, 2, seed=3)
    before, _ = eng.rollout(prompts, 2)
    assert eng.last_batch is not None and eng.sampler.state is not None
    eng.release()
    assert eng.last_batch is None and eng.sampler.state is None and eng.cache is None
    assert not any(isinstance(x, jax.Array) for x in vars(eng.model).values())  # no parameter left
    with pytest.raises(RuntimeError, match="set_model"):
        eng.rollout(prompts, 2)
    with pytest.raises(RuntimeError, match="set_model"):
        eng.warm_up(2, 2)
    eng.set_model(model)
    after, _ = eng.rollout(prompts, 2)
    assert [t.tokens for t in after] == [t.tokens for t in before]
    assert [t.logprobs for t in after] == [t.logprobs for t in before]
