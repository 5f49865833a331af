"""Sizes of the tiny world the toyworld tests share (conftest builds it, test_world checks counts)."""

TINY = dict(n_sft=12, n_rl=8, n_eval=6, seed=3)
