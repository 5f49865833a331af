"""The demo report writer: files, tables, targets, plots, escaping, NaN tolerance."""

import dataclasses
import html
import json
import os
import re

import numpy as np
import pytest
from PIL import Image

from codedance_jax.rl.scoring import summarize
from codedance_jax.rollout.record import Trajectory, save_jsonl
from runs.demo.checks import lookup
from runs.demo.numbers import fmt_metric
from runs.demo.plots import series
from runs.demo.report import write_report

FAMILIES = ("count", "bars", "find")
EVIL = "<script>alert('x')</script>"


@dataclasses.dataclass
class DemoTrajectory(Trajectory):
    """A record as the demo writes it: the decoded response and the item's metadata ride along."""

    text: str | None = None
    meta: dict = dataclasses.field(default_factory=dict)


def _image(rng, size):
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def _trajectories(rng, n_per_group=3, evil_at=0):
    out = []
    for fam in FAMILIES:
        for diff in ("easy", "hard"):
            for j in range(n_per_group):
                i = len(out)
                tool = diff == "hard" or rng.random() < 0.5
                # The first record of each hard group (always correct, so always shown) fails its cell:
                # the page must show a traceback whatever the other records draw.
                first = "error" if (diff, j) == ("hard", 0) else str(rng.choice(["ok", "ok", "error"]))
                status = ([first] if tool else []) + ["no_code"]
                turns = []
                images = [_image(rng, 28 * int(rng.integers(2, 5)))]
                for st in status:
                    n_img = int(st == "ok")
                    images += [_image(rng, 28)] * n_img
                    turns.append({"status": st, "n_images": n_img,
                                  "observation": "Traceback: <boom>" if st == "error" else ("out: 3" if tool else None),
                                  "code": "print(img.size)" if st != "no_code" else None})
                gold = str(int(rng.integers(0, 7)))
                correct = bool(rng.random() < 0.6) if j else bool(i % 2)
                answer = EVIL if i == evil_at else (gold if correct else "9")
                n_tok = int(rng.integers(8, 20))
                out.append(DemoTrajectory(
                    id=f"{fam}-{diff}-{j}", prompt_id=f"{fam}-{diff}-{j}", group=0, prompt_len=4,
                    tokens=rng.integers(0, 1000, n_tok).tolist(), loss_mask=[0] * 4 + [1] * (n_tok - 4),
                    turn_ids=[-1] * 4 + [0] * (n_tok - 4), logprobs=rng.normal(size=n_tok).tolist(),
                    temperature=1.0, images=images, image_grid_thw=[], turn_status=status, turns=turns,
                    answer=answer, correct=correct, rewards={"total": float(rng.random()), "acc": float(correct)},
                    finish_reason="answer",
                    text=f"<code>print(1)</code> then <answer>{answer}</answer>",
                    meta={"family": fam, "difficulty": diff, "question": f"How many <b>shapes</b>? #{i}",
                          "gold": gold},
                ))
    return out


def _metrics(rng, n, keys):
    rows = []
    for s in range(1, n + 1):
        rows.append({"step": s, **{k: float(rng.random()) for k in keys}})
    return rows


@pytest.fixture
def demo(tmp_path):
    rng = np.random.default_rng()
    evals, paths = {}, {}
    for name in ("sft", "grpo"):
        trajs = _trajectories(rng)
        paths[name] = save_jsonl(trajs, tmp_path / "work" / "eval" / name)
        evals[name] = summarize(trajs, [float(t.correct) for t in trajs], [t.meta for t in trajs],
                                ("family", "difficulty"))
    sft = [{"step": s, "loss": float(3 * rng.random() / s)} for s in range(1, 12)]
    grpo = _metrics(rng, 6, ["reward/total", "accuracy", "avg_turns", "exec_success", "train/entropy",
                             "tool_rate", "difficulty=easy/tool_rate", "difficulty=hard/tool_rate"])
    return tmp_path, evals, paths, sft, grpo


def _png_ok(path):
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        assert im.size[0] > 100 and im.size[1] > 100


def test_report_files_tables_and_escaping(demo):
    tmp_path, evals, paths, sft, grpo = demo
    out = tmp_path / "report"
    written = write_report(str(out), evals=evals, eval_trajectories=paths, sft_metrics=sft, grpo_metrics=grpo,
                           world={"families": list(FAMILIES), "n_train": 120}, timings={"sft": 12.5, "grpo": 40.25},
                           targets={"hard_accuracy": 0.9, "overall_accuracy": 0.75})
    for rel in ("report.md", "summary.json", "report.html"):
        assert os.path.isfile(out / rel) and written[rel] == str(out / rel)
    plots = sorted(k for k in written if k.startswith("plots/"))
    assert plots == sorted(f"plots/{s}.png" for s in ("sft_loss", "grpo_reward", "grpo_accuracy", "grpo_turns",
                                                      "grpo_exec_success", "grpo_entropy", "grpo_tool_rate"))
    for rel in plots:
        _png_ok(written[rel])

    md = (out / "report.md").read_text()
    for name, s in evals.items():
        row = next(line for line in md.splitlines() if line.startswith(f"| {name} |"))
        assert fmt_metric("accuracy", s["accuracy"]) in row
        assert fmt_metric("avg_turns", s["avg_turns"]) in row
        assert fmt_metric("tool_rate", s["tool_rate"]) in row
        # family x difficulty
        v = s["family=bars,difficulty=hard/accuracy"]
        row = next(line for line in md.splitlines() if line.startswith("| bars | hard |"))
        assert fmt_metric("accuracy", v) in row
    assert fmt_metric("accuracy", 0.25) == "25.0%" and fmt_metric("exec_success", float("nan")) == "n/a"
    assert "12.50" in md and "40.25" in md and "n_train" in md

    summary = json.loads((out / "summary.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert summary["eval_order"] == ["sft", "grpo"]
    res = summary["targets"]["results"]["grpo"]["hard_accuracy"]
    assert res["value"] == pytest.approx(evals["grpo"]["difficulty=hard/accuracy"])
    assert res["met"] == (evals["grpo"]["difficulty=hard/accuracy"] >= 0.9)

    page = (out / "report.html").read_text()
    assert "<script>" not in page  # the model's answer and text are escaped, and the page has no script
    assert html.escape(EVIL) in page
    assert "How many &lt;b&gt;shapes&lt;/b&gt;?" in page
    assert "Traceback: &lt;boom&gt;" in page
    srcs = re.findall(r'<img src="([^"]+)"', page)
    assert any(s.startswith("plots/") for s in srcs)
    traj_imgs = [s for s in srcs if not s.startswith("plots/")]
    assert traj_imgs and all(s.startswith("../work/eval/") for s in traj_imgs)
    for s in srcs:  # every image resolves from the report's folder
        assert os.path.isfile(out / html.unescape(s)), s
    # examples: both evals, every family x difficulty, correct and wrong
    for fam in FAMILIES:
        for diff in ("easy", "hard"):
            assert f"<summary>{fam} / {diff}</summary>" in page
    assert 'data-verdict="correct"' in page and 'data-verdict="wrong"' in page


def test_targets_met_and_not_met(tmp_path):
    rng = np.random.default_rng()
    hi = float(rng.uniform(0.91, 0.99))  # above both thresholds
    lo = float(rng.uniform(0.3, 0.7))  # below both
    mid = float(rng.uniform(0.76, 0.89))  # overall met, hard not
    easy_sft, easy_grpo = float(rng.uniform(0.6, 0.9)), float(rng.uniform(0.05, 0.4))

    def summ(acc, hard_acc, easy_rate, hard_rate):
        return {"accuracy": acc, "avg_turns": float(rng.uniform(1, 3)), "exec_success": float("nan"),
                "tool_calls": float(rng.uniform(0, 2)), "tool_rate": float(rng.random()), "n": 60,
                "difficulty=hard/accuracy": hard_acc, "difficulty=easy/accuracy": float(rng.random()),
                "difficulty=easy/tool_rate": easy_rate, "difficulty=hard/tool_rate": hard_rate}

    evals = {"sft": summ(mid, lo, easy_sft, 0.95), "grpo": summ(hi, hi, easy_grpo, 0.85),
             "grpo_no_rbat": summ(lo, float("nan"), easy_grpo, 0.5)}
    targets = {"hard_accuracy": 0.9, "overall_accuracy": 0.75}
    out = tmp_path / "r"
    write_report(str(out), evals=evals, eval_trajectories={}, sft_metrics=[], grpo_metrics=[], targets=targets)
    s = json.loads((out / "summary.json").read_text())
    r = s["targets"]["results"]
    assert r["grpo"]["hard_accuracy"]["met"] and r["grpo"]["overall_accuracy"]["met"]
    assert not r["sft"]["hard_accuracy"]["met"] and r["sft"]["overall_accuracy"]["met"]
    assert not r["grpo_no_rbat"]["hard_accuracy"]["met"] and r["grpo_no_rbat"]["hard_accuracy"]["value"] is None
    assert s["targets"]["all_met"] == {"sft": False, "grpo": True, "grpo_no_rbat": False}
    checks = s["adaptive_checks"]
    assert [c["met"] for c in checks] == [True, True]

    md = (out / "report.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| hard_accuracy |"))
    assert f"{fmt_metric('accuracy', lo)} NOT met" in row and f"{fmt_metric('accuracy', hi)} met" in row
    assert "n/a NOT met" in row
    assert "does not lower accuracy vs sft: **met**" in md
    page = (out / "report.html").read_text()
    assert f'<td class="notmet">{fmt_metric("accuracy", lo)} NOT met</td>' in page
    assert f'<td class="met">{fmt_metric("accuracy", hi)} met</td>' in page
    assert f"easy tool-call rate sft {fmt_metric('tool_rate', easy_sft)} -> grpo {fmt_metric('tool_rate', easy_grpo)}" in md
    assert "SFT loss: no data" in md and not os.listdir(out / "plots")

    # GRPO lowers accuracy and keeps calling tools on easy items: both checks fail, honestly.
    evals["grpo"] = summ(lo, hi, easy_sft + 0.05, 0.6)
    write_report(str(out), evals=evals, eval_trajectories={}, sft_metrics=[], grpo_metrics=[], targets=targets)
    s = json.loads((out / "summary.json").read_text())
    assert [c["met"] for c in s["adaptive_checks"]] == [False, False]
    assert "**NOT met**" in (out / "report.md").read_text()
    # Only SFT evaluated: the checks are not evaluated rather than passed.
    write_report(str(out), evals={"sft": evals["sft"]}, eval_trajectories=None, sft_metrics=None, grpo_metrics=None)
    s = json.loads((out / "summary.json").read_text())
    assert [c["met"] for c in s["adaptive_checks"]] == [None, None]


def test_nan_and_missing_metrics(tmp_path):
    rng = np.random.default_rng()
    nan = float("nan")
    sft = [{"step": s, "loss": nan if s % 3 == 0 else float(rng.random())} for s in range(1, 8)]
    sft.append({"step": 8, "grad_norm": 1.0})  # a row without the loss
    grpo = [{"step": s, "accuracy": float(rng.random()), "exec_success": nan, "reward/total": "bad",
             "difficulty=easy/tool_rate": float(rng.random())} for s in range(1, 5)]
    evals = {"sft": {"accuracy": float(rng.random()), "avg_turns": nan, "exec_success": nan, "n": 3},
             "grpo": {}}
    written = write_report(str(tmp_path / "r"), evals=evals, eval_trajectories={"grpo": str(tmp_path / "missing.jsonl")},
                           sft_metrics=sft, grpo_metrics=grpo, targets={"hard_accuracy": 0.9},
                           timings={"sft": nan}, world={"nested": {"a": [1, 2]}})
    assert sorted(k for k in written if k.startswith("plots/")) == [
        "plots/grpo_accuracy.png", "plots/grpo_tool_rate.png", "plots/sft_loss.png"]
    for k in written:
        if k.endswith(".png"):
            _png_ok(written[k])
    assert series(sft, "loss")[0] == [1, 2, 4, 5, 7]
    s = json.loads((tmp_path / "r" / "summary.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert s["evals"]["sft"]["exec_success"] is None
    assert set(s["plots_without_data"]) == {"GRPO mean reward", "GRPO average turns", "GRPO execution success",
                                            "GRPO policy entropy"}
    md = (tmp_path / "r" / "report.md").read_text()
    assert "GRPO policy entropy: no data" in md and "n/a" in md and '"nested"' in md
    assert "No trajectories" in (tmp_path / "r" / "report.html").read_text()


def test_lookup():
    s = {"accuracy": 0.5, "difficulty=hard/accuracy": 0.25, "family=count/tool_rate": 0.75,
         "family=count,difficulty=hard/accuracy": 0.125}
    assert lookup(s, "overall_accuracy") == 0.5 and lookup(s, "accuracy") == 0.5
    assert lookup(s, "hard_accuracy") == 0.25 and lookup(s, "count_tool_rate") == 0.75
    assert lookup(s, "family=count,difficulty=hard/accuracy") == 0.125
    assert lookup(s, "easy_accuracy") is None and lookup(s, "bogus") is None
    assert fmt_metric("n", 60.0) == "60" and fmt_metric("avg_turns", None) == "n/a"


def test_intervals_differences_and_sampled_pairs(tmp_path):
    """Every rate carries its 95% interval in both reports; greedy and sampled pairs get a differences
    table (Newcombe), a paired accuracy table item by item (McNemar and Tango greedy, the bootstrap
    sampled, Newcombe beside them) and their own adaptive checks."""
    from eval.intervals import bootstrap_difference, difference, mcnemar_exact, rate_intervals, tango_interval
    from runs.demo.numbers import fmt_interval, fmt_p

    rng = np.random.default_rng()
    evals, paths, trajs_of = {}, {}, {}
    for name in ("sft", "sft_sampled", "grpo", "grpo_sampled"):
        k = 3 if name.endswith("_sampled") else 1  # a sampled evaluation: k draws of every item
        trajs = [t for _ in range(k) for t in _trajectories(rng, n_per_group=4)]
        metas = [t.meta for t in trajs]
        s = summarize(trajs, [float(t.correct) for t in trajs], metas, ("family", "difficulty"))
        evals[name] = {**s, **rate_intervals(trajs, metas, ("family", "difficulty")),
                       "samples_per_item": k}
        paths[name] = save_jsonl(trajs, tmp_path / "work" / name)
        trajs_of[name] = trajs
    out = tmp_path / "report"
    write_report(str(out), evals=evals, eval_trajectories=paths, sft_metrics=[], grpo_metrics=[])

    def ci_text(v, ci):  # a group without executions has no execution success (n/a, no interval)
        return "n/a" if np.isnan(v) else f"{fmt_metric('accuracy', v)} [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]"

    md = (out / "report.md").read_text()
    page = (out / "report.html").read_text()
    for name, s in evals.items():
        row = next(line for line in md.splitlines() if line.startswith(f"| {name} |"))
        for m in ("accuracy", "tool_rate", "exec_success"):
            assert ci_text(s[m], s[f"{m}_ci95"]) in row, (name, m)
            assert html.escape(ci_text(s[m], s[f"{m}_ci95"])) in page
        key = "family=find,difficulty=hard/tool_rate"
        assert html.escape(ci_text(s[key], s[f"{key}_ci95"])) in page
    section = md.split("### Execution success")[1]
    row = next(line for line in section.splitlines() if line.startswith("| bars | easy |"))
    for s in evals.values():
        key = "family=bars,difficulty=easy/exec_success"
        assert ci_text(s[key], s[f"{key}_ci95"]) in row

    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["differences"]) == ["grpo - sft", "grpo_sampled - sft_sampled"]
    d = summary["differences"]["grpo_sampled - sft_sampled"]["tool-call rate, easy"]
    b, a = evals["sft_sampled"], evals["grpo_sampled"]
    k = "difficulty=easy/tool_rate"
    assert d["diff"] == pytest.approx(a[k] - b[k])
    assert d["ci95"] == pytest.approx(list(difference(b[k], b[f"{k}_ci95"], a[k], a[f"{k}_ci95"])))
    assert d["excludes_0"] == (d["ci95"][0] > 0 or d["ci95"][1] < 0)
    assert "## Changes" in md and "grpo_sampled - sft_sampled" in md
    assert len(summary["adaptive_checks"]) == 4
    assert "grpo_sampled does not lower accuracy vs sft_sampled" in md
    assert summary["evals"]["grpo"]["accuracy_ci95"] == pytest.approx(evals["grpo"]["accuracy_ci95"])

    # Accuracy item by item: summary.json's numbers from the records, and both tables in both files.
    paired = summary["paired_accuracy"]
    assert list(paired) == ["grpo - sft", "grpo_sampled - sft_sampled"]
    right = {name: {} for name in trajs_of}
    for name, trajs in trajs_of.items():
        for t in trajs:
            right[name].setdefault(t.prompt_id, []).append(float(t.correct))
    ids = list(right["sft"])
    greedy = paired["grpo - sft"]
    assert (greedy["sampled"], greedy["n_items"], greedy["before_only"], greedy["after_only"]) == (False, 24, 0, 0)
    for g, cell_ids in (("all", ids), ("family=bars,difficulty=hard", [i for i in ids if i.startswith("bars-hard")])):
        cell = greedy["groups"][g]
        b = sum(right["grpo"][i][0] > right["sft"][i][0] for i in cell_ids)
        c = sum(right["grpo"][i][0] < right["sft"][i][0] for i in cell_ids)
        assert (cell["n_items"], cell["b"], cell["c"]) == (len(cell_ids), b, c)
        assert cell["mcnemar_p"] == mcnemar_exact(b, c)
        assert cell["paired_ci95"] == pytest.approx(list(tango_interval(b, c, len(cell_ids))))
        key = "accuracy" if g == "all" else f"{g}/accuracy"
        # Newcombe's interval from the records is the one from the summaries' Wilson intervals.
        want = difference(evals["sft"][key], evals["sft"][f"{key}_ci95"], evals["grpo"][key], evals["grpo"][f"{key}_ci95"])
        assert cell["newcombe_ci95"] == pytest.approx(list(want))
        assert cell["diff"] == pytest.approx(evals["grpo"][key] - evals["sft"][key])
    sampled = paired["grpo_sampled - sft_sampled"]
    assert sampled["sampled"] and "mcnemar_p" not in sampled["groups"]["all"]
    sids = list(right["sft_sampled"])
    acc_b = [np.mean(right["sft_sampled"][i]) for i in sids]
    acc_a = [np.mean(right["grpo_sampled"][i]) for i in sids]
    cell = sampled["groups"]["all"]
    assert cell["paired_ci95"] == pytest.approx(list(bootstrap_difference(acc_b, acc_a, 2000, 0)))
    b, a = evals["sft_sampled"], evals["grpo_sampled"]
    assert cell["diff"] == pytest.approx(a["accuracy"] - b["accuracy"])
    assert cell["newcombe_ci95"] == pytest.approx(summary["differences"]["grpo_sampled - sft_sampled"]["accuracy"]["ci95"])

    section = md.split("### Accuracy item by item, greedy: grpo - sft")[1].split("###")[0]
    assert ("| family | difficulty | items | sft | grpo | difference | paired 95% interval | b / c | McNemar p "
            "| Newcombe 95% interval |") in section
    cell = greedy["groups"]["family=bars,difficulty=hard"]
    row = next(line for line in section.splitlines() if line.startswith("| bars | hard |"))
    assert row.split(" | ")[2:] == [
        "4", fmt_metric("accuracy", cell["before"]), fmt_metric("accuracy", cell["after"]),
        f"{100 * cell['diff']:+.1f} pts", fmt_interval(cell["paired_ci95"]), f"{cell['b']} / {cell['c']}",
        fmt_p(cell["mcnemar_p"]), fmt_interval(cell["newcombe_ci95"]) + " |"]
    section = md.split("### Accuracy item by item, sampled: grpo_sampled - sft_sampled")[1].split("##")[0]
    assert "McNemar" not in section.split("|", 1)[1] and "paired 95% interval (bootstrap)" in section
    row = next(line for line in section.splitlines() if line.startswith("| all | all | 24 |"))
    assert fmt_interval(sampled["groups"]["all"]["paired_ci95"]) in row
    assert fmt_interval(sampled["groups"]["all"]["newcombe_ci95"]) in row
    assert "Accuracy item by item, greedy: grpo - sft</h3>" in page and "<th>McNemar p</th>" in page


def test_tool_use_section(demo):
    """The analytics table per eval x family, the calls not in the SFT data, and the GRPO curve."""
    tmp_path, evals, paths, sft, grpo = demo
    sft_data = tmp_path / "sft.jsonl"
    sft_data.write_text(json.dumps({"messages": [
        {"role": "assistant", "content": "<code>\n```python\nprint(1)\n```\n</code>"}]}) + "\n")
    crop = "from PIL import Image\nim = Image.open('image.png')\nim.crop((0, 0, 8, 8)).save('c.png')\n"
    grpo_recs = tmp_path / "grpo_trajectories.jsonl"
    with open(grpo_recs, "w") as f:
        for step in (1, 2, 3):
            for j in range(2):
                code = crop if j < step - 1 else "print(2)"
                f.write(json.dumps({"prompt_id": f"p{j}", "policy": f"/w/grpo/policies/step_{step - 1}", "meta": {},
                                    "turns": [{"status": "ok", "code": code}]}) + "\n")
    out = tmp_path / "report"
    written = write_report(str(out), evals=evals, eval_trajectories=paths, sft_metrics=sft, grpo_metrics=grpo,
                           sft_data=str(sft_data), grpo_trajectories=str(grpo_recs))
    assert "plots/grpo_tool_use.png" in written
    _png_ok(written["plots/grpo_tool_use.png"])
    md = (out / "report.md").read_text()
    assert "## Tool use (from the executed cells)" in md
    for name in evals:
        assert any(line.startswith(f"| {name} | all |") for line in md.splitlines())
        assert any(line.startswith(f"| {name} | find |") for line in md.splitlines())
    s = json.loads((out / "summary.json").read_text())
    t = s["tool_use"]
    assert t["sft_calls"] == 1  # print
    g = t["evals"]["grpo"]["all"]  # the fixture's cells run print(img.size): print is in the SFT data
    assert g["novel_calls"] == [] and g["novel_cell_rate"] == 0 and g["top_calls"][0][0] == "print"
    assert [r["behaviour/crop"] for r in t["grpo_curves"]] == [0.0, 0.5, 1.0]
    assert "grpo_tool_use.png" in (out / "report.html").read_text()


def test_grpo_step_rates_with_intervals(tmp_path):
    """Per GRPO step: accuracy and tool-call rate of its rollouts, per difficulty (from the RL prompts'
    metadata), each with the clustered Wilson interval; drawn as plots/grpo_step_rates.png."""
    from eval.intervals import rate_intervals
    from runs.demo.plots import step_rates

    rng = np.random.default_rng()
    metas = tmp_path / "prompts.jsonl"
    metas.write_text("".join(json.dumps({"id": f"rl-{i}", "difficulty": "easy" if i % 2 else "hard"}) + "\n"
                             for i in range(6)))
    recs = []
    for step in range(3):
        # Each step draws one hard (even id) and one easy (odd id) prompt and a third of either, so every
        # step has both difficulties and their intervals exist.
        hard_i, easy_i = rng.choice([0, 2, 4]), rng.choice([1, 3, 5])
        third = rng.choice([i for i in range(6) if i not in (hard_i, easy_i)])
        for i in (hard_i, easy_i, third):
            for _ in range(4):  # a group of 4 rollouts per prompt
                recs.append({"prompt_id": f"rl-{i}@{step // 2}", "policy": f"/w/grpo/policies/step_{step}",
                             "correct": bool(rng.random() < 0.5),
                             "turn_status": ["ok", "no_code"] if rng.random() < 0.5 else ["no_code"]})
    path = tmp_path / "trajectories.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    diff = {f"rl-{i}": {"difficulty": "easy" if i % 2 else "hard"} for i in range(6)}
    rows = step_rates(recs, diff)
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["n"] == 12 for r in rows)
    second = [r for r in recs if r["policy"].endswith("step_1")]
    hard = [r for r in second if diff[r["prompt_id"].split("@")[0]]["difficulty"] == "hard"]
    assert hard  # GRPO's `{id}@{epoch}` prompt ids find their metadata
    assert rows[1]["difficulty=hard/accuracy"] == pytest.approx(np.mean([r["correct"] for r in hard]))
    want = rate_intervals(second, [diff[r["prompt_id"].split("@")[0]] for r in second], ("difficulty",))
    assert rows[1]["difficulty=hard/accuracy_ci95"] == pytest.approx(want["difficulty=hard/accuracy_ci95"])
    assert rows[1]["accuracy_ci95"] == pytest.approx(want["accuracy_ci95"])
    assert rows[1]["tool_rate"] == pytest.approx(np.mean([len(r["turn_status"]) > 1 for r in second]))
    written = write_report(str(tmp_path / "r"), evals={}, eval_trajectories={}, sft_metrics=[], grpo_metrics=[],
                           grpo_trajectories=str(path), prompt_metas=str(metas))
    _png_ok(written["plots/grpo_step_rates.png"])
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert s["grpo_step_rates"][1]["accuracy_ci95"] == pytest.approx(want["accuracy_ci95"])
    assert "grpo_step_rates.png" in (tmp_path / "r" / "report.md").read_text()


def test_effect_checks_grpo_against_sft(tmp_path):
    """Issue 18's targets read from the evaluations and their differences: met, not met, not evaluated."""
    from eval.intervals import wilson

    def ev(acc, easy_tool, hard_tool, hard_acc, n=120):
        s = {}
        for key, v, m in (("accuracy", acc, n), ("difficulty=easy/tool_rate", easy_tool, n // 2),
                          ("difficulty=hard/tool_rate", hard_tool, n // 2), ("difficulty=hard/accuracy", hard_acc, n // 2)):
            s[key], s[f"{key}_ci95"] = v, list(wilson(round(v * m), m))
        return s

    rng = np.random.default_rng()
    base = float(rng.uniform(0.4, 0.6))
    evals = {"sft": ev(base, 0.4, 1.0, 0.8), "sft_sampled": ev(base, 0.5, 0.95, 0.7),
             "grpo": ev(base - 0.1, 0.1, 0.95, 0.85), "grpo_sampled": ev(base + 0.2, 0.2, 0.92, 0.75)}
    spec = {"accuracy_gain": 0.05, "easy_tool_rate_ratio": 0.5, "hard_tool_rate_min": 0.9}
    write_report(str(tmp_path), evals=evals, eval_trajectories={}, sft_metrics=[], grpo_metrics=[],
                 effect_targets=spec)
    s = json.loads((tmp_path / "summary.json").read_text())
    got = {c["name"]: c["met"] for c in s["effect_checks"]}
    assert got["sampled accuracy grpo_sampled >= sft_sampled + 5 pts, interval above 0"] is True
    assert got["greedy accuracy does not fall"] is False  # 10 points lower, honestly NOT met
    assert got["greedy accuracy grpo >= sft + 5 pts, interval above 0"] is False  # no records: Newcombe's
    assert got["sampled accuracy, hard does not fall"] is True
    assert got["greedy easy-item tool-call rate grpo <= 0.5 x sft"] is True
    assert got["sampled easy-item tool-call rate grpo_sampled <= 0.5 x sft_sampled"] is True
    assert got["sampled hard-item tool-call rate grpo_sampled >= 90.0%"] is True
    md = (tmp_path / "report.md").read_text()
    assert "### GRPO against SFT (issue 18)" in md and "greedy accuracy does not fall: **NOT met**" in md
    # A gain whose interval reaches 0 is not enough; without sampled evaluations: not evaluated.
    evals["grpo_sampled"] = ev(base + 0.06, 0.2, 0.92, 0.75, n=24)
    evals["sft_sampled"] = ev(base, 0.5, 0.95, 0.7, n=24)
    write_report(str(tmp_path), evals=evals, eval_trajectories={}, sft_metrics=[], grpo_metrics=[], effect_targets=spec)
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["effect_checks"][0]["met"] is False
    evals["sft"] = ev(base, 0.0, 1.0, 0.8)  # SFT calls no tool on easy items: nothing to halve
    write_report(str(tmp_path), evals=evals, eval_trajectories={}, sft_metrics=[], grpo_metrics=[], effect_targets=spec)
    s = json.loads((tmp_path / "summary.json").read_text())
    assert {c["name"]: c["met"] for c in s["effect_checks"]}["greedy easy-item tool-call rate grpo <= 0.5 x sft"] is None
    del evals["grpo_sampled"]
    write_report(str(tmp_path), evals=evals, eval_trajectories={}, sft_metrics=[], grpo_metrics=[], effect_targets=spec)
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["effect_checks"][0]["met"] is None


def test_greedy_gain_judged_on_the_paired_interval(tmp_path):
    """+5 points on 120 items, 6 items gained and none lost: Newcombe's interval reaches below 0, the
    paired (Tango) one does not, and the greedy gain target reads the paired one where the records are."""
    from eval.intervals import mcnemar_exact, tango_interval, wilson

    rng = np.random.default_rng()
    n, base = 120, int(rng.integers(70, 90))
    order = rng.permutation(n)
    right = {"sft": set(order[:base].tolist()), "grpo": set(order[:base + 6].tolist())}
    evals, paths = {}, {}
    for name, ok in right.items():
        recs = [{"prompt_id": f"q{i}", "correct": i in ok, "turn_status": [],
                 "meta": {"family": "count", "difficulty": "easy" if i % 2 else "hard"}} for i in range(n)]
        paths[name] = tmp_path / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rng.permutation(recs)))  # order: irrelevant
        evals[name] = {"accuracy": len(ok) / n, "accuracy_ci95": list(wilson(len(ok), n)), "n": n}
    name = "greedy accuracy grpo >= sft + 5 pts, interval above 0"
    write_report(str(tmp_path / "r"), evals=evals, eval_trajectories={k: str(v) for k, v in paths.items()},
                 sft_metrics=[], grpo_metrics=[], effect_targets={"accuracy_gain": 0.05})
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    cell = s["paired_accuracy"]["grpo - sft"]["groups"]["all"]
    assert (cell["b"], cell["c"], cell["diff"]) == (6, 0, pytest.approx(0.05))
    assert cell["mcnemar_p"] == pytest.approx(mcnemar_exact(6, 0)) and cell["paired_ci95"][0] > 0
    assert cell["paired_ci95"] == pytest.approx(list(tango_interval(6, 0, n)))
    assert cell["newcombe_ci95"][0] < 0 and s["differences"]["grpo - sft"]["accuracy"]["excludes_0"] is False
    check = next(c for c in s["effect_checks"] if c["name"] == name)
    assert check["met"] is True and "McNemar p = 0.031" in check["detail"]
    # Without the records only the summaries' Newcombe interval is left: not enough.
    write_report(str(tmp_path / "r"), evals=evals, eval_trajectories={}, sft_metrics=[], grpo_metrics=[],
                 effect_targets={"accuracy_gain": 0.05})
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    check = next(c for c in s["effect_checks"] if c["name"] == name)
    assert check["met"] is False and "Newcombe" in check["detail"] and s["paired_accuracy"] == {}


def test_cell_loss_check():
    """Issue 35's "no family x difficulty cell loses more than 5 points greedy", read from the paired
    comparison's cells (a whole-difficulty or whole-family group does not count as a cell)."""
    from runs.demo.checks import effect_checks

    def cell(diff):
        return {"diff": diff, "paired_ci95": [diff - 0.1, diff + 0.1], "n_items": 40}

    name = "greedy: no family x difficulty cell of grpo loses more than 5 pts"
    for worst, met in ((-0.05, True), (-0.075, False), (0.0, True)):
        groups = {"all": cell(0.1), "difficulty=easy": cell(-0.2), "family=count,difficulty=easy": cell(worst),
                  "family=find,difficulty=hard": cell(0.75)}
        got = effect_checks({}, {}, {"cell_loss_max": 0.05}, paired={"grpo - sft": {"groups": groups}})
        check = next(c for c in got if c["name"] == name)
        assert check["met"] is met, (worst, check)
        assert "family=count,difficulty=easy" in check["detail"]
    got = effect_checks({}, {}, {"cell_loss_max": 0.05}, paired=None)
    assert next(c for c in got if c["name"] == name)["met"] is None
