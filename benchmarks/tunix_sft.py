"""Tunix's PeftTrainer (full fine-tune, no LoRA) at the sizes of `sft_step.py --case tunix`, for the side-by-side.

    /tmp/tunix-venv/bin/python benchmarks/tunix_sft.py --steps 20 --json '{"vocab": 1024, ...}'

Runs under the separate venv of benchmarks/requirements-bench.txt (Tunix is never a dependency of
the product or its tests); `sft_step.py` starts it as a subprocess and reads the last stdout line
(JSON). Model: Tunix's own Qwen2 (`tunix.models.qwen2`) at hidden 128, 2 layers, vocab 1024, fp32;
batches of `batch` x `seq` random ids, every token trained, AdamW, its default loss (full logits,
one-hot cross-entropy). Timed: the wall time between consecutive batches the trainer pulls (its
loop keeps up to 2 steps in flight, so this is its throughput); the first `warmup` steps (the
compilation) are left out of the median, and the whole run is bounded by `jax.effects_barrier`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np
import optax
from flax import nnx


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    s = json.loads(args.json)

    from tunix.models.qwen2 import model as qwen2
    from tunix.sft import peft_trainer, utils

    cfg = qwen2.ModelConfig(num_layers=s["layers"], vocab_size=s["vocab"], embed_dim=s["hidden"], hidden_dim=s["mlp"],
                            num_heads=s["heads"], head_dim=s["head_dim"], num_kv_heads=s["kv_heads"], rope_theta=1_000_000,
                            norm_eps=1e-6)
    auto = jax.sharding.AxisType.Auto  # Tunix's Qwen2 embeds with plain gathers (explicit axes would reject them)
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), devices=jax.devices()[:1], axis_types=(auto, auto))
    rng = np.random.default_rng(0)
    stamps = []

    def data():
        for _ in range(args.steps):
            stamps.append(time.perf_counter())
            ids = rng.integers(3, s["vocab"], (s["batch"], s["seq"])).astype(np.int32)
            yield peft_trainer.TrainingInput(input_tokens=ids, input_mask=np.ones_like(ids, bool))
        stamps.append(time.perf_counter())

    def gen_input(x: peft_trainer.TrainingInput):
        mask = x.input_mask
        return {"input_tokens": x.input_tokens, "input_mask": mask,
                "positions": utils.build_positions_from_mask(mask), "attention_mask": utils.make_causal_attn_mask(mask)}

    with jax.set_mesh(mesh):
        model = qwen2.Qwen2(cfg, rngs=nnx.Rngs(0))
        config = peft_trainer.TrainingConfig(eval_every_n_steps=10**6, max_steps=args.steps, pbar_description=None)
        trainer = peft_trainer.PeftTrainer(model, optax.adamw(1e-4), config).with_gen_model_input_fn(gen_input)
        t0 = time.perf_counter()
        trainer.train(data())
        jax.effects_barrier()
        total = time.perf_counter() - t0
    d = np.diff(stamps)
    step_s = float(statistics.median(d[args.warmup:])) if len(d) > args.warmup else total / max(args.steps, 1)
    print(json.dumps(dict(step_s=step_s, tokens_per_s=s["batch"] * s["seq"] / step_s, train_total_s=total,
                          steps=args.steps, step_times=d.tolist())))


if __name__ == "__main__":
    main()
