"""Tunix's GRPOLearner (vanilla rollout) at the sizes of `grpo_step.py --case tunix`, for the side-by-side.

    /tmp/tunix-venv/bin/python benchmarks/tunix_grpo.py --steps 5 --json '{"vocab": 1024, ...}'

Runs under the separate venv of benchmarks/requirements-bench.txt (Tunix is never a dependency of
the product or its tests); `grpo_step.py` starts it as a subprocess and reads the last stdout line
(JSON). Model: Tunix's own Qwen2 (`tunix.models.qwen2`) at hidden 128, 2 layers, vocab 1024, fp32;
prompts of `prompt` random ids, `gen` new tokens, `group` generations per prompt, no KL (beta 0),
one iteration per batch, a constant reward (timing only). Timed: `RLCluster.generate` alone (the
rollout) and whole `GRPOLearner.train` steps (rollout, log-probs, advantages, update); the first
step compiles and is left out of the medians.
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


class IdTokenizer:
    """Whitespace-separated integer ids <-> text (the prompts are random ids); pad 0, bos 1, eos 2."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def encode(self, text, **_):
        if isinstance(text, np.ndarray):  # GRPOLearner repeats prompts with numpy
            if text.size != 1:
                raise ValueError(f"expected one prompt, got an array of shape {text.shape}")
            text = text.reshape(-1)[0]
        return [int(x) for x in str(text).split()]

    def decode(self, ids, **_):
        return " ".join(str(int(i)) for i in ids)

    def pad_id(self):
        return 0

    def bos_id(self):
        return 1

    def eos_id(self):
        return 2

    def GetPieceSize(self):  # noqa: N802 - sentencepiece's name
        return self.vocab

    def EncodeAsIds(self, text, **_):  # noqa: N802
        return self.encode(text)

    def DecodeIds(self, ids):  # noqa: N802
        return self.decode(ids)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    s = json.loads(args.json)

    from tunix.models.qwen2 import model as qwen2
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo.grpo_learner import GRPOConfig, GRPOLearner
    from tunix.rl.rollout import base_rollout

    cfg = qwen2.ModelConfig(num_layers=s["layers"], vocab_size=s["vocab"], embed_dim=s["hidden"], hidden_dim=s["mlp"],
                            num_heads=s["heads"], head_dim=s["head_dim"], num_kv_heads=s["kv_heads"], rope_theta=1_000_000,
                            norm_eps=1e-6)
    auto = jax.sharding.AxisType.Auto  # Tunix's Qwen2 embeds with plain gathers (explicit axes would reject them)
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), devices=jax.devices()[:1], axis_types=(auto, auto))
    with jax.set_mesh(mesh):
        actor = qwen2.Qwen2(cfg, rngs=nnx.Rngs(0))
        ref = qwen2.Qwen2(cfg, rngs=nnx.Rngs(0))
    tok = IdTokenizer(s["vocab"])
    rollout_cfg = base_rollout.RolloutConfig(max_tokens_to_generate=s["gen"], max_prompt_length=s["prompt"],
                                             kv_cache_size=2 * (s["prompt"] + s["gen"]), temperature=1.0, top_p=1.0,
                                             eos_tokens=[2])
    training = rl_cluster_lib.RLTrainingConfig(actor_optimizer=optax.adamw(1e-5), eval_every_n_steps=10**6,
                                               max_steps=args.steps)
    roles = rl_cluster_lib.Role
    cluster_cfg = rl_cluster_lib.ClusterConfig(role_to_mesh={roles.ACTOR: mesh, roles.REFERENCE: mesh, roles.ROLLOUT: mesh},
                                               rollout_engine="vanilla", offload_to_cpu=False,
                                               training_config=training, rollout_config=rollout_cfg)
    cluster = rl_cluster_lib.RLCluster(actor=actor, reference=ref, tokenizer=tok, cluster_config=cluster_cfg)
    rng = np.random.default_rng(0)

    def prompts(n):
        # prompt - 1 ids: the sampler adds bos (a longer prompt would be bucketed to twice the length)
        return [" ".join(str(x) for x in rng.integers(10, s["vocab"] - 10, s["prompt"] - 1)) for _ in range(n)]

    # The rollout alone: prompts x group rows, as GRPOLearner sends them.
    n_rows = s["prompts"] * s["group"]
    gen = []
    for _ in range(args.steps):
        p = prompts(s["prompts"])
        rows = [x for x in p for _ in range(s["group"])]
        t0 = time.perf_counter()
        out = cluster.generate(prompts=rows)
        jax.block_until_ready(out.tokens) if hasattr(out, "tokens") else None
        gen.append(time.perf_counter() - t0)
    rollout_s = statistics.median(gen[1:] or gen)

    def reward(prompts, completions, **_):
        return [0.0] * len(completions)

    algo = GRPOConfig(num_generations=s["group"], num_iterations=1, beta=0.0, epsilon=0.2)
    learner = GRPOLearner(rl_cluster=cluster, algo_config=algo, reward_fns=[reward])
    step_times = []

    def data():
        for _ in range(args.steps):
            step_times.append(time.perf_counter())
            yield {"prompts": np.array(prompts(s["prompts"]))}  # a batch as Tunix's grain pipelines give it
        step_times.append(time.perf_counter())

    t0 = time.perf_counter()
    learner.train(data())
    jax.effects_barrier()
    total = time.perf_counter() - t0
    d = np.diff(step_times)
    step_s = float(np.median(d[1:])) if len(d) > 1 else total
    res = dict(rollout_s=rollout_s, rollout_tok_per_s=n_rows * s["gen"] / rollout_s, step_s=step_s,
               update_s=max(step_s - rollout_s, 0.0), train_total_s=total, steps=args.steps, rollouts=gen,
               step_times=d.tolist(), note="update_s = step_s - rollout_s (GRPOLearner does not time stages)")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
