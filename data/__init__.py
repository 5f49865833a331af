"""Data pipelines.

SFT: `trajectory` (the JSONL format and its validation), `observation` (the observation and turn
formats, shared with rollouts), `chat` (render + tokenize once + loss mask), `sft_tfds` (JSONL ->
array_record TFDS dataset), `batching` (buckets and the batch contract), `sft_pipeline` (grain).
"""
