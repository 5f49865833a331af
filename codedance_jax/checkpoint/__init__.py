"""Checkpoint formats: Hugging Face safetensors (streamed) and orbax, and the model loader."""
