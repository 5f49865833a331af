"""Pod preflight: compile a run's programs for a TPU topology on a CPU-only machine and read their cost.

- `topology`: chips, compile-only TPU devices and meshes, and the per-program `Report` (memory per
  chip from `memory_analysis()`, XLA's cost-model flops);
- `plan`: the programs of an SFT or GRPO config (train step, log-probs, ...) with their abstract
  arguments and shardings, compiled and extrapolated to full depth;
- `rollout`: the rollout engine's jitted functions (prefill, decode chunk, appends, vision) for one
  host's share of the rollout batch.

`python -m launch.preflight` is the entry point.
"""
