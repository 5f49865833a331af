"""Small benchmark files in every supported format, written by the tests themselves (never real data).

`write_tsv(dir, bench)` writes VLMEvalKit's TSV for `bench`; `write_released(dir, bench)` the benchmark's
own release layout. Both hold the same three items (ITEMS), with random images of known sizes.
"""

import base64
import csv
import io
import json
import os

import numpy as np
from PIL import Image

SIZES = [(40, 30), (56, 28), (28, 44)]


def png(i: int) -> bytes:
    w, h = SIZES[i % 3]
    arr = np.random.default_rng(100 + i).integers(0, 255, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


MCQ_ROWS = [
    dict(
        question="What colour is the cup?",
        A="red",
        B="blue",
        C="green",
        D="white",
        answer="B",
        category="single",
        cycle_category="0",
    ),
    dict(
        question="Where is the dog?",
        A="left",
        B="right",
        C="top",
        D="bottom",
        answer="A",
        category="cross",
        cycle_category="1",
    ),
    dict(question="How many cars?", A="1", B="2", C="3", D="4", answer="D", category="single", cycle_category="0"),
]

TSV_ROWS = {
    "CountBenchQA": [dict(question="How many dogs are there?", answer=str(n)) for n in (3, 7, 10)],
    "PixmoCount": [
        dict(question=f"How many {k} are there in this image?", answer=str(n))
        for k, n in (("cats", 2), ("birds", 5), ("cups", 0))
    ],
    "VStarBench": [{k: v for k, v in r.items() if k not in ("cycle_category",)} for r in MCQ_ROWS],
    "HRBench4K": MCQ_ROWS,
    "HRBench8K": MCQ_ROWS,
    "ChartQA": [
        dict(question="What is the peak value?", answer="45"),
        dict(question="Which year?", answer="2019"),
        dict(question="Is it rising?", answer="Yes"),
    ],
    "CharXiv": [
        dict(question="What is the maximum?", answer="0.5", inst_category="3"),
        dict(question="Which line is highest?", answer="blue", inst_category="1"),
        dict(question="How many subplots?", answer="4", inst_category="3"),
    ],
    "MathVista": [
        dict(
            question="Hint: ...\nQuestion: What fraction is blue?\nChoices:\n(A) 3/11\n(B) 8/11",
            answer="8/11",
            question_type="multi_choice",
            answer_type="text",
            choices="['3/11', '8/11']",
            answer_option="B",
            task="figure question answering",
            skills="['arithmetic reasoning']",
        ),
        dict(
            question="Which number is missing?",
            answer="14",
            question_type="free_form",
            answer_type="integer",
            choices=None,
            answer_option=None,
            task="math word problem",
            skills="['algebraic reasoning']",
        ),
        dict(
            question="What is the ratio?",
            answer="1.5",
            question_type="free_form",
            answer_type="float",
            choices=None,
            answer_option=None,
            task="textbook question answering",
            skills="['arithmetic reasoning']",
        ),
    ],
    "MathVision": [
        dict(question="Which shape? (A) 1 (B) 2 (C) 3", answer="C", choices="['1', '2', '3']", category="geometry"),
        dict(question="Compute the area.", answer="12", choices="[]", category="metric"),
        dict(question="Find x.", answer="2/3", choices="[]", category="algebra"),
    ],
    "MathVerse": [
        dict(
            question="Find AB.",
            answer="22.3",
            question_for_eval="Find AB.",
            problem_version="Text Lite",
            metadata="{'subfield': 'Length'}",
        ),
        dict(
            question="Which option?",
            answer="C",
            question_for_eval="Which option?",
            problem_version="Vision Only",
            metadata="{'subfield': 'Angle'}",
        ),
        dict(
            question="Find the area.",
            answer="12",
            question_for_eval="Find the area.",
            problem_version="Text Dominant",
            metadata="{'subfield': 'Area'}",
        ),
    ],
    "WeMath": [
        dict(question="Step 1?", A="3", B="4", answer="A", ID="7", key="2steps_1"),
        dict(question="Step 2?", A="5", B="6", answer="B", ID="7", key="2steps_2"),
        dict(question="Both steps?", A="8", B="9", C="10", answer="C", ID="7", key="2steps_multi"),
    ],
}

BENCHES = list(TSV_ROWS)


def write_tsv(d: str, bench: str, name: str | None = None, share_image: bool = False, repeat: int = 1) -> str:
    """`repeat` > 1: the three items again (new indices 103, 104, ...), for batches of more rows."""
    from eval.benchmarks import get_benchmark

    rows = TSV_ROWS[bench] * repeat
    cols = ["index", "image"] + [k for k in dict.fromkeys(k for r in rows for k in r)]
    path = os.path.join(d, name or get_benchmark(bench).tsv)
    with open(path, "w", newline="") as f:
        w = csv.writer(f, delimiter="\t")  # quotes fields with newlines, as pandas' to_csv does
        w.writerow(cols)
        for i, r in enumerate(rows):
            img = base64.b64encode(png(i)).decode()
            if share_image and i == 2:
                img = "100"  # VLMEvalKit stores a repeated image as the index of the row that holds it
            vals = {"index": str(100 + i), "image": img, **r}
            w.writerow(["" if vals.get(c) is None else str(vals[c]) for c in cols])
    return path


def _save_images(d: str, sub: str, names: list[str]) -> None:
    os.makedirs(os.path.join(d, sub), exist_ok=True)
    for i, n in enumerate(names):
        with open(os.path.join(d, sub, n), "wb") as f:
            f.write(png(i))


def _parquet(path: str, records: list[dict]) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def write_released(d: str, bench: str) -> str:
    rows = TSV_ROWS[bench]
    if bench == "CountBenchQA":
        recs = [
            dict(
                question=r["question"], number=int(r["answer"]), text="a caption", image={"bytes": png(i), "path": None}
            )
            for i, r in enumerate(rows)
        ]
        return _parquet(os.path.join(d, "countbench.parquet"), recs)
    if bench == "PixmoCount":
        _save_images(d, "images", [f"sha{i}.jpg" for i in range(3)])
        recs = [
            dict(label=lab, count=n, image_sha256=f"sha{i}", image_url=f"https://example.invalid/{i}.jpg")
            for i, (lab, n) in enumerate((("cats", 2), ("birds", 5), ("cups", 0)))
        ]
        return _parquet(os.path.join(d, "pixmo_count.parquet"), recs)
    if bench == "VStarBench":
        _save_images(d, "direct_attributes", [f"sa_{i}.jpg" for i in range(3)])
        path = os.path.join(d, "test_questions.jsonl")
        with open(path, "w") as f:
            for i, r in enumerate(rows):
                opts = "\n".join(f"({k}) {r[k]}" for k in "ABCD")
                text = f"{r['question']}\n{opts}\nAnswer with the option's letter from the given choices directly."
                f.write(
                    json.dumps(
                        dict(
                            question_id=200 + i,
                            image=f"direct_attributes/sa_{i}.jpg",
                            text=text,
                            category=r["category"],
                            label=r["answer"],
                        )
                    )
                    + "\n"
                )
        return path
    if bench in ("HRBench4K", "HRBench8K"):
        recs = [dict(index=300 + i, image=base64.b64encode(png(i)).decode(), **r) for i, r in enumerate(rows)]
        return _parquet(os.path.join(d, "hr_bench_4k.parquet" if bench == "HRBench4K" else "hr_bench_8k.parquet"), recs)
    if bench == "ChartQA":
        _save_images(d, "png", [f"chart{i}.png" for i in range(3)])
        path = os.path.join(d, "test_human.json")
        with open(path, "w") as f:
            json.dump(
                [dict(imgname=f"chart{i}.png", query=r["question"], label=r["answer"]) for i, r in enumerate(rows)], f
            )
        return path
    if bench == "CharXiv":
        _save_images(d, "images", [f"{i}.jpg" for i in range(3)])
        path = os.path.join(d, "reasoning_val.json")
        with open(path, "w") as f:
            json.dump(
                {
                    str(i): dict(
                        raw_question=r["question"],
                        query=r["question"] + " (answer briefly)",
                        answer=r["answer"],
                        inst_category=int(r["inst_category"]),
                    )
                    for i, r in enumerate(rows)
                },
                f,
            )
        return path
    if bench == "MathVista":
        _save_images(d, "images", [f"{i + 1}.jpg" for i in range(3)])
        path = os.path.join(d, "testmini.json")
        out = {}
        for i, r in enumerate(rows):
            choices = json.loads(r["choices"].replace("'", '"')) if r["choices"] else None
            out[str(i + 1)] = dict(
                pid=str(i + 1),
                question=r["question"].split("Question: ")[-1],
                image=f"images/{i + 1}.jpg",
                choices=choices,
                answer=r["answer"],
                question_type=r["question_type"],
                answer_type=r["answer_type"],
                query=r["question"],
                precision=None,
                unit=None,
            )
        with open(path, "w") as f:
            json.dump(out, f)
        return path
    if bench == "MathVision":
        _save_images(d, "images", [f"{i + 1}.jpg" for i in range(3)])
        path = os.path.join(d, "test.jsonl")
        with open(path, "w") as f:
            for i, r in enumerate(rows):
                opts = json.loads(r["choices"].replace("'", '"'))
                f.write(
                    json.dumps(
                        dict(
                            id=str(i + 1),
                            question=r["question"].split(" (A)")[0],
                            options=opts,
                            image=f"images/{i + 1}.jpg",
                            answer=r["answer"],
                            subject=r["category"],
                            level=2,
                        )
                    )
                    + "\n"
                )
        return path
    if bench == "MathVerse":
        _save_images(d, "images", [f"{i}.png" for i in range(3)])
        path = os.path.join(d, "testmini.json")
        with open(path, "w") as f:
            json.dump(
                [
                    dict(
                        sample_index=str(i + 1),
                        problem_index="1",
                        problem_version=r["problem_version"],
                        question=r["question"],
                        image=f"{i}.png",
                        answer=r["answer"],
                        question_type="free-form",
                        metadata={"subfield": "Length"},
                        query_wo=r["question"] + " Answer directly.",
                        question_for_eval=r["question_for_eval"],
                    )
                    for i, r in enumerate(rows)
                ],
                f,
            )
        return path
    if bench == "WeMath":
        _save_images(d, "images", [f"w{i}.png" for i in range(3)])
        path = os.path.join(d, "testmini.json")
        with open(path, "w") as f:
            json.dump(
                [
                    dict(
                        ID=r["ID"],
                        split="testmini",
                        key=r["key"],
                        question=r["question"],
                        option=";".join(f"{k}. {r[k]}" for k in "ABC" if k in r),
                        answer=r["answer"],
                        image_path=f"images/w{i}.png",
                        **{"knowledge concept": "Angles"},
                    )
                    for i, r in enumerate(rows)
                ],
                f,
            )
        return path
    raise KeyError(bench)
