"""Qwen2.5-VL in Flax NNX: config, rope, vision tower, decoder, the HF parameter table."""

from codedance_jax.model.config import ModelConfig, TextConfig, VisionConfig
from codedance_jax.model.qwen25vl import KVCache, Qwen25VL, VisionInputs, num_params

__all__ = ["ModelConfig", "TextConfig", "VisionConfig", "Qwen25VL", "KVCache", "VisionInputs", "num_params"]
