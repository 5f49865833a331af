"""The end-to-end toy-world demo: world generation, SFT, GRPO with R_BAT, evaluation and the report."""
