"""Multi-turn rollouts: jit sampling over the KV cache, sandbox turns, images mid-trajectory (SPEC §2).

    from codedance_jax.rollout import RolloutEngine, RolloutConfig, SamplingConfig, rl_prompt
    engine = RolloutEngine(model, processor, RolloutConfig.train(), SamplingConfig(temperature=1.0, seed=0))
    trajectories, stats = engine.rollout([rl_prompt(processor, "q0", question, [image])], group_size=8, sandbox=pool)
    save_jsonl(trajectories, workdir)

Files: sampler.py (jit decode loop, sampling, stop table), engine.py (the turn loop and its per-call
RolloutState), rows.py (a batch row and its Phase), device_batch.py (the KV cache / logits of a
static batch of rows: row buckets, placement, growth and compaction; shared with
`codedance_jax.serve`), placement.py (a host's sampling mesh and the policy placed for it),
sandbox_turns.py (sandbox sessions, cells, observations), config.py (its
budgets and buckets, RolloutConfig; its accounting, RolloutStats), turns.py (code
extraction, observations), record.py (trajectory records, JSON lines), prompts.py (RL prompts; their text is `codedance_jax.protocol`),
buckets.py (shape buckets, compile counter).
"""

from codedance_jax.rollout.buckets import CompileCounter, vision_bucket
from codedance_jax.rollout.config import RolloutConfig, RolloutStats
from codedance_jax.rollout.engine import RolloutEngine
from codedance_jax.rollout.prompts import Prompt, rl_prompt, session_files, text_only_prompt
from codedance_jax.rollout.record import Trajectory, load_jsonl, save_jsonl
from codedance_jax.rollout.sampler import RowSampling, Sampler, SamplingConfig, StopTable, build_stop_table, sample
from codedance_jax.rollout.turns import build_observation, extract_answer, extract_code

__all__ = [
    "CompileCounter",
    "Prompt",
    "RolloutConfig",
    "RolloutEngine",
    "RolloutStats",
    "RowSampling",
    "Sampler",
    "SamplingConfig",
    "StopTable",
    "Trajectory",
    "build_observation",
    "build_stop_table",
    "extract_answer",
    "extract_code",
    "load_jsonl",
    "rl_prompt",
    "sample",
    "save_jsonl",
    "session_files",
    "text_only_prompt",
    "vision_bucket",
]
