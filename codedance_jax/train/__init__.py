"""The training core shared by SFT and GRPO: mesh, train state, optimizer, steps, checkpoints, loop."""
