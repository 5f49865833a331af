"""Sizes and knobs of the tiny world the toyworld tests share (conftest builds it, test_world checks counts)."""

TINY = dict(n_sft=12, n_rl=8, n_eval=6, n_val=6, seed=3)
# Hard count items ask both question kinds, so the one-spelling test sees kinds and colours.
KNOBS = dict(hard_frac=0.5, error_rate=0.3, easy_code_rate=0.5, vocab_size=400,
             count_questions=("count_color", "count_target"))
