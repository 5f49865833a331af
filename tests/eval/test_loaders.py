"""Every loader parses its format: VLMEvalKit TSV and each benchmark's release, built here."""

import os

import pytest
from eval_fixtures import BENCHES, SIZES, TSV_ROWS, write_released, write_tsv

from eval import load_benchmark, rule_score


@pytest.mark.parametrize("bench", BENCHES)
@pytest.mark.parametrize("fmt", ["tsv", "released"])
def test_loader_parses(tmp_path, bench, fmt):
    path = write_tsv(str(tmp_path), bench) if fmt == "tsv" else write_released(str(tmp_path), bench)
    items = load_benchmark(bench, path)
    rows = TSV_ROWS[bench]
    assert len(items) == 3
    for k, (it, row) in enumerate(zip(items, rows, strict=True)):
        assert str(it.answer) == row["answer"]
        (im,) = it.pil_images()
        assert im.size == SIZES[k] and im.mode == "RGB"
        assert it.question.strip()
        # The row carries what the scorer reads: the gold answer scores as correct (or defers).
        verdict = rule_score(bench, _gold_reply(bench, it.row), it.row)
        assert verdict in (True, None), (bench, fmt, it.row)
        if bench in ("VStarBench", "HRBench4K", "HRBench8K", "WeMath"):
            assert it.row[row["answer"]] == row[row["answer"]]
            assert "Options:\nA. " in it.question and "Please select the correct answer" in it.question
    # The directory works too: the known file name is found in it.
    assert [i.index for i in load_benchmark(bench, str(tmp_path))] == [i.index for i in items]


def _gold_reply(bench, row):
    if bench == "MathVista" and row.get("question_type") == "multi_choice":
        return row["answer_option"]
    return str(row["answer"])


def test_released_formats_fill_vlmevalkit_fields(tmp_path):
    mv = load_benchmark(
        "MathVista", write_released(str(tmp_path / "a"), "MathVista") if os.makedirs(tmp_path / "a") is None else ""
    )
    assert mv[0].row["answer_option"] == "B" and mv[0].row["choices"] == "['3/11', '8/11']"
    assert rule_score("MathVista", "B", mv[0].row) is True and rule_score("MathVista", "A", mv[0].row) is False
    os.makedirs(tmp_path / "b")
    wm = load_benchmark("WeMath", write_released(str(tmp_path / "b"), "WeMath"))
    assert (wm[2].row["A"], wm[2].row["C"], wm[2].row["key"]) == ("8", "10", "2steps_multi")
    os.makedirs(tmp_path / "c")
    vs = load_benchmark("VStarBench", write_released(str(tmp_path / "c"), "VStarBench"))
    assert vs[0].row["question"] == "What colour is the cup?" and vs[0].row["B"] == "blue"
    assert vs[0].index == "200" and "Answer with the option" not in vs[0].question


def test_tsv_shared_image_and_missing_cells(tmp_path):
    items = load_benchmark("HRBench4K", write_tsv(str(tmp_path), "HRBench4K", share_image=True))
    assert items[2].images == items[0].images  # the image of index 100
    items = load_benchmark("MathVista", write_tsv(str(tmp_path), "MathVista"))
    assert items[1].row["choices"] is None  # an empty cell is missing, as pandas reads it


def test_missing_file_names_expected_file_and_source(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        load_benchmark("HRBench8K", str(tmp_path))
    msg = str(e.value)
    assert "hr_bench_8k.tsv" in msg and "huggingface.co/datasets/DreamMr/HR-Bench" in msg and "downloaded" in msg


def test_bad_rows_are_errors_not_skips(tmp_path):
    p = tmp_path / "ChartQA_TEST.tsv"
    p.write_text("index\timage\tquestion\tanswer\n1\tnot-base64!\tq\t3\n")
    with pytest.raises(ValueError, match=r"ChartQA_TEST.tsv:2: cannot read the image of index 1"):
        load_benchmark("ChartQA", str(p))
    p.write_text("index\tquestion\tanswer\n1\tq\t\n")
    with pytest.raises(ValueError, match="no answer"):
        load_benchmark("ChartQA", str(p))
    p.write_text("index\tquestion\tanswer\n1\tq\t3\n1\tq\t4\n")
    with pytest.raises(ValueError, match="occurs twice"):
        load_benchmark("ChartQA", str(p))
