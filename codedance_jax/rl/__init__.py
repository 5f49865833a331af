"""Rewards, the R_BAT advantage kernel and the GRPO policy loss (SPEC §4).

Importing the package registers the algorithms by name: advantage "rbat", loss "grpo"
(`codedance_jax.rl.registry.get_advantage` / `get_loss`).
"""

from codedance_jax.rl.grpo_loss import GRPOLossConfig, grpo_loss, token_advantages, token_logprobs
from codedance_jax.rl.rbat import RBATConfig, rbat_advantages, rbat_rewards, turn_arrays, turn_failed_from_execution

__all__ = [
    "GRPOLossConfig",
    "RBATConfig",
    "grpo_loss",
    "rbat_advantages",
    "rbat_rewards",
    "token_advantages",
    "token_logprobs",
    "turn_arrays",
    "turn_failed_from_execution",
]
