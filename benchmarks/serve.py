"""Serving throughput: `launch.serve` under 1, 8 and 32 concurrent `openai` clients vs the engine called directly.

    .venv/bin/python benchmarks/serve.py [--requests 32] [--max-tokens 32] [--concurrency 1,8,32]

The tiny random checkpoint (numpy weights, real Qwen tokenizer files) is served by a real
`python -m launch.serve` process on 127.0.0.1 (`--max_batch` = the largest concurrency). For each
concurrency C, C client threads share `--requests` greedy chat requests (short random questions,
`max_tokens` tokens, stopped early only by EOS); requests/s and completion tokens/s are measured
over the whole set after a warm-up round at that concurrency; XLA compilations inside the measured
run are counted (the server's `/health` reports its process's count). The baseline is the same model in
this process: `RolloutEngine.rollout` (one turn, no sandbox) on batches of C prompts, one batch
after the other; it has no HTTP, JSON, tokenization-on-request or scheduling cost, and it cannot
take a new prompt until its whole batch ends. Prints a table, writes benchmarks/results/serve.json.
Figures from a shared machine are only comparable within one run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "serve"))


def questions(n: int, offset: int = 0) -> list[str]:
    return [f"Describe item {offset + k} in a few words." for k in range(n)]


def compiles(base_url: str) -> int:
    import urllib.request

    with urllib.request.urlopen(base_url.rsplit("/v1", 1)[0] + "/health", timeout=60) as r:
        return json.loads(r.read())["stats"]["compiles"]


def bench_server(client, qs: list[str], conc: int, max_tokens: int) -> dict:
    def one(q):
        r = client.chat.completions.create(model="codedance", messages=[{"role": "user", "content": q}],
                                           temperature=0, max_tokens=max_tokens)
        return r.usage.completion_tokens

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(conc) as ex:
        toks = list(ex.map(one, qs))
    wall = time.perf_counter() - t0
    return {"requests": len(qs), "wall_s": wall, "completion_tokens": sum(toks),
            "requests_per_s": len(qs) / wall, "tokens_per_s": sum(toks) / wall}


def bench_engine(model, processor, qs: list[str], conc: int, max_tokens: int) -> dict:
    from codedance_jax.rollout import Prompt, RolloutConfig, RolloutEngine, SamplingConfig

    cfg = RolloutConfig(max_turns=1, max_turn_tokens=max_tokens, max_new_tokens=max_tokens, max_total_tokens=512,
                        decode_chunk=16, prompt_buckets=(64, 128, 256), batch_multiple=conc)
    eng = RolloutEngine(model, processor, cfg, SamplingConfig(greedy=True))

    def prompts(batch):
        return [Prompt(f"p{k}", processor.apply_chat_template([{"role": "user", "content": q}],
                                                              add_generation_prompt=True), []) for k, q in enumerate(batch)]

    from codedance_jax.rollout import CompileCounter

    eng.rollout(prompts(qs[:conc]))  # compile this batch size
    counter = CompileCounter().__enter__()
    t0 = time.perf_counter()
    toks = 0
    for i in range(0, len(qs), conc):
        _, st = eng.rollout(prompts(qs[i : i + conc]))
        toks += st.generated_tokens
    wall = time.perf_counter() - t0
    return {"requests": len(qs), "wall_s": wall, "completion_tokens": toks, "requests_per_s": len(qs) / wall,
            "tokens_per_s": toks / wall, "compiles": counter.so_far}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "serve.json"))
    args = ap.parse_args()
    concs = [int(c) for c in args.concurrency.split(",")]

    import openai
    from serve_helpers import ServerProcess, write_tiny_checkpoint

    import codedance_jax

    ckpt = write_tiny_checkpoint(tempfile.mkdtemp(prefix="serve_bench_"))
    server = ServerProcess(ckpt, f"--max_batch={max(concs)}", "--decode_chunk=16", "--max_context=512", "--noagent")
    rows = []
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=600, max_retries=0)
        for c in concs:
            bench_server(client, questions(2 * c, 10_000), c, args.max_tokens)  # warm-up at this concurrency
            before = compiles(server.base_url)
            row = bench_server(client, questions(args.requests), c, args.max_tokens)
            rows.append({"concurrency": c, "path": "server", **row, "compiles": compiles(server.base_url) - before})
    finally:
        server.close()
    model, processor = codedance_jax.from_pretrained(ckpt)
    for c in concs:
        rows.append({"concurrency": c, "path": "engine", **bench_engine(model, processor, questions(args.requests), c,
                                                                        args.max_tokens)})

    print(f"{'clients':>7} {'path':>7} {'req/s':>8} {'tok/s':>8} {'wall s':>8} {'tokens':>7} {'compiles':>8}")
    for r in rows:
        print(f"{r['concurrency']:>7} {r['path']:>7} {r['requests_per_s']:>8.2f} {r['tokens_per_s']:>8.1f} "
              f"{r['wall_s']:>8.2f} {r['completion_tokens']:>7} {r['compiles']:>8}")
    ratios = {}
    for c in concs:
        s = next(r for r in rows if r["concurrency"] == c and r["path"] == "server")
        e = next(r for r in rows if r["concurrency"] == c and r["path"] == "engine")
        ratios[str(c)] = round(s["tokens_per_s"] / e["tokens_per_s"], 3)
    print("server tokens/s as a fraction of the engine's:", ratios)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "server_over_engine_tokens_per_s": ratios, "requests": args.requests,
                   "max_tokens": args.max_tokens, "machine": platform.platform(), "cpus": os.cpu_count(),
                   "note": "tiny random model on CPU; the machine was shared with other jobs"}, f, indent=2)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
