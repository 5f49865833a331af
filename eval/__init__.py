"""Evaluation harness for the paper's benchmarks (SPEC section 7).

    from eval import rule_score                      # VLMEvalKit's rule-based verdict (the contract)
    rule_score("ChartQA", "45", {"answer": "45"})    # -> True | False | None (None: VLMEvalKit asks its judge)

    from eval import load_benchmark, run_eval, write_report, RolloutPolicy
    items = load_benchmark("HRBench4K", "/data/hr_bench_4k.tsv")
    summary = run_eval("HRBench4K", items, RolloutPolicy(model, processor, sandbox=pool), workdir)
    write_report(workdir)

Files: matching.py (VLMEvalKit's matching rules), scoring.py (per-benchmark `rule_score`, our
`strict_score`; which benchmarks match VLMEvalKit exactly), benchmarks.py (files, paper numbers,
question text), loaders.py (TSV and released formats), rollouts.py (`evaluate(engine, prompts,
pool)`: the one evaluation rollout, also used by GRPO and the demo), policy.py (the policy
interface and the rollout-engine adapter), runner.py (resumable loop, predictions, trajectories),
summary.py (Table-3 columns beside the paper's), report.py (static HTML), trajectory_html.py (the
trajectory renderer both HTML reports use), judge.py (optional OpenAI-compatible judge),
evaluate.py (`evaluate(config, workdir)`, what `python -m launch.eval` calls).
"""

from eval.benchmarks import BENCHMARKS, Benchmark, get_benchmark
from eval.loaders import Item, load_benchmark
from eval.scoring import rule_score, strict_score

__all__ = [
    "BENCHMARKS",
    "Benchmark",
    "Item",
    "RolloutPolicy",
    "get_benchmark",
    "load_benchmark",
    "rule_score",
    "run_eval",
    "strict_score",
    "write_report",
]


def __getattr__(name):  # the heavy parts (JAX, the rollout engine) load on first use
    if name == "run_eval":
        from eval.runner import run_eval

        return run_eval
    if name == "write_report":
        from eval.report import write_report

        return write_report
    if name == "RolloutPolicy":
        from eval.policy import RolloutPolicy

        return RolloutPolicy
    raise AttributeError(name)
