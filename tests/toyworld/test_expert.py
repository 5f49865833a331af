"""The scripted expert: its code really runs in the sandbox, and its answers come from the observations."""

import contextlib
import dataclasses
import io
import json
import re

import numpy as np
import pytest
from PIL import Image

from codedance_jax.protocol import observation_text
from data.toyworld import FAMILIES, ExpertError, expert_trajectory, make_item
from data.toyworld.expert import BUGS, EASY_COUNT_CODE, THINK, _crop_color, buggy_code, expert_code, png_bytes
from data.toyworld.world import write_sft
from data.trajectory import read_jsonl

pytestmark = pytest.mark.usefixtures("pool")


def _turns(rec):
    return [m["role"] for m in rec["messages"]]


@pytest.mark.parametrize("family,count_questions", [(f, ("count_target",)) for f in FAMILIES]
                         + [("count", ("count_color",))])
def test_hard_trajectory_runs_clean(pool, family, count_questions):
    for seed in range(4):
        item = make_item(family, "hard", seed, f"{family}-{seed}", count_questions=count_questions)
        rec = expert_trajectory(item, pool.new_session, np.random.default_rng(seed), error_rate=0.0)
        assert _turns(rec) == ["user", "assistant", "observation", "assistant"]
        code, obs, final = rec["messages"][1:]
        assert "[status:" not in obs["content"] and "<code>\n```python\n" in code["content"]
        assert final["content"].endswith(f"<answer>{item.answer}</answer>")
        # The answer is printed by the code (count, bars) or shown in the crop (find).
        if family == "count":
            assert obs["content"] == f"count: {item.answer}"
        elif family == "bars":
            assert item.answer in obs["content"].split() and obs["content"].startswith("tallest: ")
        else:
            assert obs["num_images"] == 1 and len(rec["image_data"]) == 2
            crop = np.asarray(Image.open(io.BytesIO(rec["image_data"][1])).convert("RGB"))
            assert crop.shape == (112, 112, 3)
            from data.toyworld import PALETTE

            assert np.all(crop == PALETTE[item.answer], axis=-1).sum() > 200  # the enlarged shape
        assert rec["meta"]["cells"] == 1 and rec["meta"]["error"] is None


@pytest.mark.parametrize("family", FAMILIES)
def test_recovered_error(pool, family):
    item = make_item(family, "hard", 11, f"{family}-err")
    rec = expert_trajectory(item, pool.new_session, np.random.default_rng(0), error_rate=1.0)
    assert _turns(rec) == ["user", "assistant", "observation", "assistant", "observation", "assistant"]
    bad, err, fix, ok = rec["messages"][1:5]
    assert err["content"].endswith("[status: error]") and "Traceback" in err["content"]
    assert "<think>The code failed with " in fix["content"] and "<code>" in fix["content"]
    assert bad["content"] != fix["content"] and "[status:" not in ok["content"]
    assert rec["meta"]["error"] in BUGS[family] and rec["meta"]["cells"] == 2
    assert rec["messages"][-1]["content"].endswith(f"<answer>{item.answer}</answer>")
    # Tracebacks stay inside the cell: no path of the machine that generated the data.
    assert "/site-packages/" not in err["content"] and ".py" not in err["content"]


def test_every_bug_fails_and_the_fix_succeeds(pool):
    for family in FAMILIES:
        item = make_item(family, "hard", 2, "b")
        with pool.new_session({"image.png": png_bytes(item.image)}) as s:
            for bug in BUGS[family]:
                r = s.execute(buggy_code(item, bug))
                assert r.status == "error", (family, bug, r)
                assert "NameError" in r.stderr
            r = s.execute(expert_code(item))
            assert r.status == "ok", (family, r)


def test_easy_items_answer_directly(pool):
    def no_session(files):
        raise AssertionError("easy items must not use the sandbox with easy_code_rate=0")

    for family in FAMILIES:
        for seed in range(10):
            item = make_item(family, "easy", seed, "e")
            rec = expert_trajectory(item, no_session, np.random.default_rng(seed), error_rate=1.0, easy_code_rate=0.0)
            assert _turns(rec) == ["user", "assistant"]
            content = rec["messages"][1]["content"]
            assert content.startswith("<think>") and content.endswith(f"</think>\n<answer>{item.answer}</answer>")
            assert "<code>" not in content
            assert rec["meta"]["cells"] == 0 and len(rec["image_data"]) == 1


@pytest.mark.parametrize("family", FAMILIES)
def test_easy_with_code_runs_clean(pool, family):
    """easy_code_rate=1: the easy item is solved by code that runs cleanly (never a bug, even with
    error_rate=1), and the answer read from the observation is right."""
    for seed in range(4):
        item = make_item(family, "easy", seed, f"{family}-easy-{seed}")
        rec = expert_trajectory(item, pool.new_session, np.random.default_rng(seed), error_rate=1.0, easy_code_rate=1.0)
        assert _turns(rec) == ["user", "assistant", "observation", "assistant"]
        code, obs, final = rec["messages"][1:]
        think = THINK[family, "easy_code"].format(answer=item.answer)
        assert code["content"].startswith(f"<think>{think}</think>\n<code>\n```python\n")
        # The choice comes after the description, which is the direct answer's too (issue 47).
        direct = THINK[family, "easy"].format(answer=item.answer)
        shared = think.split(", but ")[0]
        assert direct.startswith(shared + ", so ") and item.answer in shared
        assert expert_code(item).rstrip() in code["content"]
        assert "[status:" not in obs["content"]
        assert final["content"].endswith(f"<answer>{item.answer}</answer>")
        if family == "count":
            assert obs["content"] == f"count: {item.answer}"
        elif family == "bars":
            assert obs["content"].startswith(f"tallest: {item.answer} ")
        else:
            assert obs["num_images"] == 1 and len(rec["image_data"]) == 2
            assert _crop_color(rec["image_data"][1]) == item.answer
        assert rec["meta"]["cells"] == 1 and rec["meta"]["error"] is None


def _run_here(code: str, item) -> str:
    item.image.save("image.png")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code, {})
    return out.getvalue()


def test_easy_count_code_is_exact(tmp_path, monkeypatch):
    """EASY_COUNT_CODE (all non-white connected components) counts every easy count image right."""
    monkeypatch.chdir(tmp_path)
    for seed in range(300):
        item = make_item("count", "easy", seed, "c")
        assert _run_here(EASY_COUNT_CODE, item) == f"count: {item.answer}\n", seed


def test_hard_count_code_is_exact(tmp_path, monkeypatch):
    """The hard count cell (colour mask, components, fill-ratio kinds) is exact on every image."""
    monkeypatch.chdir(tmp_path)
    for seed in range(400):
        item = make_item("count", "hard", seed, "c")
        assert _run_here(expert_code(item), item) == f"count: {item.answer}\n", seed


@pytest.mark.parametrize("difficulty", ["easy", "hard"])
def test_bars_code_is_exact(tmp_path, monkeypatch, difficulty):
    monkeypatch.chdir(tmp_path)
    for seed in range(200):
        item = make_item("bars", difficulty, seed, "b")
        top = max(item.meta["bars"], key=lambda b: b["height"])
        assert _run_here(expert_code(item), item) == f"tallest: {top['color']} {top['height']}\n", seed


def test_templates_are_short_and_digit_light():
    """No RGB literal, hardly any digits: the question's words are the only variable parts."""
    for family in FAMILIES:
        for difficulty in ("easy", "hard"):
            item = make_item(family, difficulty, 1, "t")
            code = expert_code(item)
            assert code.startswith("import numpy as np\nimport cv2\nfrom PIL import Image, ImageColor\n")
            assert not re.search(r"\(\d+, \d+, \d+\)", code)
            assert sum(ch.isdigit() for ch in code) <= 16, (family, difficulty)
            assert len(code.splitlines()) <= 9
            if family == "count" and difficulty == "hard":
                assert f"getrgb('{item.meta['color']}')" in code and f"== '{item.meta['kind']}s')" in code


class _Opened(Exception):
    pass


def _uses_code(item, rng, rate, hard_direct_rate=0.0, error_rate=0.0):
    def factory(files):
        raise _Opened

    try:
        expert_trajectory(item, factory, rng, error_rate=error_rate, easy_code_rate=rate,
                          hard_direct_rate=hard_direct_rate)
    except _Opened:
        return True
    return False


def test_easy_code_rate_is_honoured():
    items = [make_item(FAMILIES[i % 3], "easy", i, f"r{i}") for i in range(60)]
    used = [_uses_code(it, np.random.default_rng([i, 7]), 0.3) for i, it in enumerate(items)]
    assert 8 <= sum(used) <= 28  # Binomial(60, 0.3): mean 18, sd 3.5
    assert used == [_uses_code(it, np.random.default_rng([i, 7]), 0.3) for i, it in enumerate(items)]
    assert not any(_uses_code(it, np.random.default_rng([i, 7]), 0.0) for i, it in enumerate(items))
    assert all(_uses_code(it, np.random.default_rng([i, 7]), 1.0) for i, it in enumerate(items))


def test_easy_code_families_cue_the_choice():
    """easy_code_families: only those families' easy items can use code (rate easy_code_rate), the
    others always answer directly; the families in the cue draw exactly as without it."""
    items = [make_item(FAMILIES[i % 3], "easy", i, f"c{i}") for i in range(90)]
    rng = np.random.default_rng
    fams = ("count", "bars")

    def used(rate, families):
        out = []
        for i, it in enumerate(items):
            def factory(files):
                raise _Opened
            try:
                expert_trajectory(it, factory, rng([i, 7]), error_rate=0.0, easy_code_rate=rate,
                                  easy_code_families=families)
                out.append(False)
            except _Opened:
                out.append(True)
        return out

    cued, free = used(0.75, fams), used(0.75, None)
    in_cue = [it.family in fams for it in items]
    assert not any(u for u, c in zip(cued, in_cue, strict=True) if not c)
    assert [u for u, c in zip(cued, in_cue, strict=True) if c] == [u for u, c in zip(free, in_cue, strict=True) if c]
    n = sum(cued)
    assert 36 <= n <= 54  # Binomial(60, 0.75): mean 45, sd 3.4
    assert sum(used(1.0, fams)) == 60 and not any(used(0.0, fams)) and sum(used(1.0, ())) == 0


def test_hard_direct_rate_is_honoured():
    """hard_direct_rate: hard items answered by sight (right answer, no code, no sandbox); easy items
    untouched; 0 draws no direct answer."""
    hard = [make_item(FAMILIES[i % 3], "hard", i, f"h{i}") for i in range(60)]
    rng = np.random.default_rng

    def direct(rate, er=0.3):
        return [not _uses_code(it, rng([i, 7]), 0.3, rate, er) for i, it in enumerate(hard)]

    got = direct(0.3)
    assert 8 <= sum(got) <= 28 and got == direct(0.3)  # Binomial(60, 0.3): mean 18, sd 3.5
    assert not any(direct(0.0)) and all(direct(1.0))
    easy = [make_item(FAMILIES[i % 3], "easy", i, f"e{i}") for i in range(30)]
    assert ([_uses_code(it, rng([i, 7]), 0.3, 1.0) for i, it in enumerate(easy)]
            == [_uses_code(it, rng([i, 7]), 0.3, 0.0) for i, it in enumerate(easy)])

    def no_session(files):
        raise AssertionError("a direct hard answer must not use the sandbox")

    for i, item in enumerate(hard[:6]):
        rec = expert_trajectory(item, no_session, rng(i), error_rate=1.0, hard_direct_rate=1.0)
        assert [m["role"] for m in rec["messages"]] == ["user", "assistant"]
        assert rec["messages"][1]["content"].endswith(f"<answer>{item.answer}</answer>")
        assert rec["meta"]["cells"] == 0 and rec["meta"]["error"] is None and len(rec["images"]) == 1
    count = next(it for it in hard if it.family == "count")
    text = expert_trajectory(count, no_session, rng(0), hard_direct_rate=1.0)["messages"][1]["content"]
    assert f"{count.meta['color']} {count.meta['kind']}s by eye" in text


def test_expert_rejects_wrong_ground_truth(pool):
    """The expert checks the observation against the ground truth and refuses a mismatch."""
    for family in FAMILIES:
        item = make_item(family, "hard", 4, "w")
        wrong = dataclasses.replace(item, answer="purple" if family == "find" else "999")
        with pytest.raises(ExpertError):
            expert_trajectory(wrong, pool.new_session, np.random.default_rng(0), error_rate=0.0)


def test_records_validate_and_render(pool, tmp_path):
    from data.chat import render

    items = [make_item(f, d, 7, f"{f}-{d}") for f in FAMILIES for d in ("easy", "hard")]
    recs = [
        expert_trajectory(it, pool.new_session, np.random.default_rng(i), error_rate=0.5) for i, it in enumerate(items)
    ]
    path = write_sft(str(tmp_path), recs)
    trajs = list(read_jsonl([path], on_error="stop"))
    assert [t.id for t in trajs] == [it.id for it in items]
    for t, rec in zip(trajs, recs, strict=True):
        assert list(t.images) == rec["image_data"]  # PNGs written as returned
        text = render(t.messages).text
        assert text.count("<|image_pad|>") == len(rec["images"])
        obs = [m for m in rec["messages"] if m["role"] == "observation"]
        for m in obs:
            assert f"<interpreter>\n{m['content']}\n</interpreter>" in text
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    assert all("image_data" not in r and "timing" not in r for r in rows)


def test_observation_is_the_real_output(pool):
    item = make_item("count", "hard", 9, "o")
    rec = expert_trajectory(item, pool.new_session, np.random.default_rng(0), error_rate=0.0)
    with pool.new_session({"image.png": png_bytes(item.image)}) as s:
        r = s.execute(rec["messages"][1]["content"].split("```python\n")[1].split("\n```")[0])
    assert rec["messages"][2]["content"] == observation_text(r.stdout, r.stderr, r.status)
