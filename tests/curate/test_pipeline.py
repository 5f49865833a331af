"""Each stage on small toy inputs against the scripted stand-in over HTTP, and the pipeline's output."""

import json
import os

from data.trajectory import read_jsonl
from runs.curate import pipeline, stages
from runs.curate.stagefile import read_stage


def test_validate_drops_uninformative_and_wrong_gold(ctx):
    c, items = ctx(corrupt_rate=0.5, uninformative_rate=0.3)
    out = [stages.validate(c, r) for r in items]
    for r, o in zip(items, out, strict=True):
        corrupt = r["answer"] != r["meta"]["true_answer"]
        assert o.get("drop") in ({"uninformative", "qa_bad"} if corrupt else {None, "uninformative"})
        if corrupt and o.get("drop") != "uninformative":
            assert o["drop"] == "qa_bad"
    assert {o.get("drop") for o in out} == {None, "qa_bad", "uninformative"}


def test_stratify_by_weak_pass_rate(ctx):
    c, items = ctx()
    out = [stages.stratify(c, r) for r in items]
    for r, o in zip(items, out, strict=True):
        m = r["meta"]
        want = "trivial" if m["difficulty"] == "easy" else "medium" if m["family"] == "find" else "hard"
        assert o["difficulty"] == want, (r["id"], o["pass_rate"])
        assert o["pass_rate"] == {"trivial": 1.0, "medium": 0.5, "hard": 0.0}[want]
        assert (o["direct"] is not None) == (want != "hard")
    c.cfg.stratify.trivial = "drop"
    assert all(stages.stratify(c, r).get("drop") == "trivial" for r in items if r["meta"]["difficulty"] == "easy")


def test_synthesize_medium_hard_trivial_then_filter_and_verify(ctx):
    c, items = ctx(bug_rate=1.0)
    c.cfg.synthesize.grounding.select = "off"  # the medium find item takes the Table 9 path (test_grounding.py: Table 6)
    strat = [stages.stratify(c, r) for r in items[:6] + items[6:]]
    by = {}
    for r in strat:
        by.setdefault(r["difficulty"], r)
    med, hard, triv = (stages.synthesize(c, by[d]) for d in ("medium", "hard", "trivial"))
    # medium: one reply, its imagined "box: 0 0 999 999" replaced by the real output of the find code
    assert med["mode"] == "single_turn" and med["replaced"] == 1 and med["cell_status"] == ["ok"]
    obs = [m for m in med["messages"] if m["role"] == "observation"]
    assert len(obs) == 1 and obs[0]["content"].startswith("box: ") and "999" not in obs[0]["content"]
    assert obs[0]["num_images"] == 1 and len(med["images"]) == 2
    assert os.path.isfile(os.path.join(c.workdir, med["images"][1]))
    # hard: the buggy first cell failed for real, the teacher saw the error and fixed it
    assert hard["mode"] == "multi_turn" and hard["cell_status"] == ["error", "ok"]
    hobs = [m["content"] for m in hard["messages"] if m["role"] == "observation"]
    assert "NameError" in hobs[0] and "[status: error]" in hobs[0] and "[status" not in hobs[1]
    assert triv["mode"] == "direct" and [m["role"] for m in triv["messages"]] == ["user", "assistant"]
    for r in (med, hard, triv):
        assert stages.rule_filter(c, r).get("drop") is None
        assert stages.cross_validate(c, r).get("drop") is None


def test_faulty_teacher_is_filtered(ctx):
    c, items = ctx(num_items=12, wrong_rate=1.0)
    hard = next(stages.stratify(c, r) for r in items if r["meta"]["difficulty"] == "hard" and
                r["meta"]["family"] != "find")
    t = stages.synthesize(c, hard)
    assert stages.rule_filter(c, t)["drop"] == "answer_mismatch"
    assert stages.cross_validate(c, t)["drop"] == "verifier_bad"


def test_unrecovered_and_bad_box_are_filtered(ctx):
    c, items = ctx(bug_rate=1.0, unrecovered_rate=1.0, bad_box_rate=1.0)
    rows = [stages.stratify(c, r) for r in items if r["meta"]["difficulty"] == "hard"]
    hard = next(r for r in rows if r["difficulty"] == "hard")
    assert stages.rule_filter(c, stages.synthesize(c, hard))["drop"] == "unrecovered_error"
    med = next(r for r in rows if r["difficulty"] == "medium")  # find: the teacher states a box
    assert stages.rule_filter(c, stages.synthesize(c, med))["drop"] == "bad_box"


def test_pipeline_end_to_end_writes_sft_jsonl_tfds_and_report(make_config, tmp_path):
    c = make_config(num_items=12, corrupt_rate=0.1, bug_rate=0.5, wrong_rate=0.3, uninformative_rate=0.1,
                    bad_box_rate=0.5, unrecovered_rate=0.5, verifier_bad_rate=0.2)
    c.output.tfds, c.output.report_per_reason = True, 1
    rep = pipeline.run(c, str(tmp_path), log=lambda s: None)
    trajs = list(read_jsonl([tmp_path / "sft.jsonl"]))
    assert len(trajs) == rep["kept"] > 0 and rep["tfds_records"] == rep["kept"]
    st = rep["stages"]
    assert st["validate"]["in"] == 12
    for a, b in zip(pipeline.STAGES, pipeline.STAGES[1:], strict=False):
        assert st[b]["in"] == st[a]["kept"]
        assert st[a]["in"] == st[a]["kept"] + sum(st[a]["dropped"].values())
    assert st["verify"]["kept"] == rep["kept"]
    assert sum(rep["difficulty"].values()) == st["stratify"]["in"]
    assert os.path.isfile(tmp_path / "report.html") and json.load(open(tmp_path / "report.json")) == rep
    # the report shows every drop reason of every stage, one example each (report_per_reason=1)
    html = open(tmp_path / "report.html").read()
    reasons = [(n, r) for n in pipeline.STAGES for r in sorted(st[n]["dropped"])]  # the report sorts them
    assert {n for n, _ in reasons} == {"validate", "filter", "verify"} and len(reasons) >= 4, reasons
    assert html.count('<h3 class="reason"') == len(reasons)
    sections = html.split("<h2>Dropped, by stage and reason</h2>")[1].split('<h3 class="reason"')[1:]
    for (n, r), sec in zip(reasons, sections, strict=True):
        assert sec.startswith(f' id="drop-{n}-{r}">{n}: {r} ({st[n]["dropped"][r]} dropped, 1 shown)')
        assert sec.count(f"dropped: {r}</h3>") == 1 and "<img" in sec
    assert html.count("<h2>Kept trajectories</h2>") == 1
    kept_part = html.split("<h2>Kept trajectories</h2>")[1].split("<h2>")[0]
    assert kept_part.count("<h3>") == min(rep["kept"], c.output.report_kept)
    for r in read_stage(str(tmp_path), "verify"):
        assert not r.get("drop") or r["drop"] == "verifier_bad"
    # a second run pays nothing and changes nothing
    rep2 = pipeline.run(c, str(tmp_path), log=lambda s: None)
    assert all(v["requests"] == 0 for v in rep2["cache"].values())
    assert {k: v for k, v in rep2.items() if k != "cache"} == {k: v for k, v in rep.items() if k != "cache"}


def test_reply_with_special_tokens_is_dropped_as_malformed(ctx):
    c, items = ctx()
    r = stages.stratify(c, items[0])
    t = stages.synthesize(c, r)
    t["messages"][-1]["content"] += "<|im_end|>"
    assert stages.rule_filter(c, t)["drop"] == "malformed"
