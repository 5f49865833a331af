"""The paper's benchmarks (SPEC section 7): where their files are published, the paper's numbers,
and the question text each item is asked with.

Question text: what VLMEvalKit's `build_prompt` puts after the image, minus its leading
`Question: ` (the RL template of SPEC section 2 adds that): multiple choice gets
`Options:\\nA. ...` and "Please select the correct answer from the options above." (ImageMCQDataset),
ChartQA gets "Answer the question using a single word or phrase." (ImageVQADataset), MathVista's
question is its `query` (hint and choices included). CountBench's "answer with a number directly"
suffix is left out: it contradicts the think-then-answer template the paper evaluates with.
"""

from __future__ import annotations

import dataclasses

from eval.matching import build_choices

HF = "https://huggingface.co/datasets"
OPENCOMPASS = "https://opencompass.openxlab.space/utils/VLMEval"


@dataclasses.dataclass(frozen=True)
class Benchmark:
    name: str  # VLMEvalKit's dataset name (what `rule_score` takes)
    kind: str  # count | mcq | vqa | math
    tsv: str  # VLMEvalKit's TSV file name
    tsv_url: str
    released: tuple[str, ...]  # file names of the benchmark's own release this harness reads
    released_url: str
    paper: tuple[float | None, float | None]  # (CodeDance-7B, Qwen2.5-VL-7B), SPEC section 7
    paper_name: str


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in [
        Benchmark(
            "CountBenchQA",
            "count",
            "CountBenchQA.tsv",
            f"{OPENCOMPASS}/CountBenchQA.tsv",
            ("countbench.parquet", "countbench.jsonl", "countbench.json", "train.parquet"),
            f"{HF}/nielsr/countbench",
            (91.2, 76.5),
            "CountBench",
        ),
        Benchmark(
            "PixmoCount",
            "count",
            "PixmoCount.tsv",
            "VLMEvalKit registers PixmoCount without a URL: build the TSV from allenai/pixmo-count",
            ("pixmo_count.parquet", "pixmo_count.jsonl", "test.parquet"),
            f"{HF}/allenai/pixmo-count (images from image_url, saved as <image_sha256>.jpg beside the file)",
            (77.1, 50.4),
            "PixmoCount",
        ),
        Benchmark(
            "VStarBench",
            "mcq",
            "VStarBench.tsv",
            f"{HF}/xjtupanda/VStar_Bench/resolve/main/VStarBench.tsv",
            ("test_questions.jsonl",),
            f"{HF}/craigwu/vstar_bench",
            (84.8, 76.4),
            "V* Bench",
        ),
        Benchmark(
            "HRBench4K",
            "mcq",
            "hr_bench_4k.tsv",
            f"{HF}/DreamMr/HR-Bench/resolve/main/hr_bench_4k.tsv",
            ("hr_bench_4k.parquet",),
            f"{HF}/DreamMr/HR-Bench",
            (75.2, 69.0),
            "HR-Bench 4K",
        ),
        Benchmark(
            "HRBench8K",
            "mcq",
            "hr_bench_8k.tsv",
            f"{HF}/DreamMr/HR-Bench/resolve/main/hr_bench_8k.tsv",
            ("hr_bench_8k.parquet",),
            f"{HF}/DreamMr/HR-Bench",
            (72.3, 66.0),
            "HR-Bench 8K",
        ),
        Benchmark(
            "ChartQA",
            "vqa",
            "ChartQA_TEST.tsv",
            f"{OPENCOMPASS}/ChartQA_TEST.tsv",
            ("test_human.json", "test_augmented.json"),
            "https://github.com/vis-nlp/ChartQA (ChartQA Dataset/test: test_*.json + png/)",
            (87.5, 86.3),
            "ChartQA",
        ),
        Benchmark(
            "CharXiv",
            "vqa",
            "CharXiv_reasoning_val.tsv",
            f"{OPENCOMPASS}/CharXiv_reasoning_val.tsv",
            ("reasoning_val.json", "descriptive_val.json"),
            "https://github.com/princeton-nlp/CharXiv (data/*.json + images/)",
            (44.1, 42.1),
            "CharXiv",
        ),
        Benchmark(
            "MathVista",
            "math",
            "MathVista_MINI.tsv",
            f"{OPENCOMPASS}/MathVista_MINI.tsv",
            ("testmini.json", "testmini.parquet", "annot_testmini.json"),
            f"{HF}/AI4Math/MathVista",
            (70.3, 68.1),
            "MathVista",
        ),
        Benchmark(
            "MathVision",
            "math",
            "MathVision.tsv",
            f"{OPENCOMPASS}/MathVision.tsv",
            ("test.jsonl", "testmini.jsonl", "test.parquet", "testmini.parquet"),
            f"{HF}/MathLLMs/MathVision",
            (29.6, 25.0),
            "MathVision",
        ),
        Benchmark(
            "MathVerse",
            "math",
            "MathVerse_MINI.tsv",
            f"{OPENCOMPASS}/MathVerse_MINI.tsv",
            ("testmini.json",),
            f"{HF}/AI4Math/MathVerse",
            (46.8, 45.1),
            "MathVerse",
        ),
        Benchmark(
            "WeMath",
            "mcq",
            "WeMath.tsv",
            f"{OPENCOMPASS}/WeMath.tsv",
            ("testmini.json",),
            f"{HF}/We-Math/We-Math",
            (39.6, 35.4),
            "WeMath",
        ),
    ]
}


def get_benchmark(name: str) -> Benchmark:
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; expected one of {', '.join(BENCHMARKS)}")
    return BENCHMARKS[name]


def question_text(bench: Benchmark, row: dict) -> str:
    """The text asked after the image(s) (see the module docstring)."""
    q = str(row.get("question", "")).strip()
    if bench.kind == "mcq" and not row.get("_options_in_question"):
        options = build_choices(row)
        hint = row.get("hint")
        parts = [f"Hint: {hint}"] if hint not in (None, "") and hint == hint else []
        parts.append(q)
        if options:
            parts.append("Options:\n" + "\n".join(f"{k}. {v}" for k, v in options.items()))
            parts.append("Please select the correct answer from the options above.")
        return "\n".join(parts)
    if bench.name == "ChartQA":
        return f"{q}\nAnswer the question using a single word or phrase."
    return q
