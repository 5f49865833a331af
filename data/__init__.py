"""Data layer: the trajectory format, chat rendering, SFT and RL datasets, and the toy world.

SFT: `trajectory` (the JSONL format and its validation), `chat` (render + tokenize once + loss
mask), `featurize` (one trajectory -> a bucketed `Example`), `sft_tfds` (JSONL -> array_record TFDS
dataset), `sft_pipeline` (grain), `failed_build` (a failed dataset build leaves nothing behind),
`synthetic` (a handful of trajectories for the tiny preset).
RL: `rl_prompts` (prompt JSONL -> TFDS, and the step-indexed reader GRPO uses).
`toyworld/`: the generated world the demo trains and evaluates on (tasks, expert, tokenizer).
The turn protocol itself (fences, observations, answers) is `codedance_jax.protocol`.
"""
