"""Qwen2.5-VL processor (numpy + PIL + tokenizers + jinja2; no torch): outputs equal transformers'."""

from codedance_jax.processing.image import ImageConfig, encode_images, preprocess_image, smart_resize
from codedance_jax.processing.processor import Processor
from codedance_jax.processing.reference_files import write_qwen25vl_processor_files
from codedance_jax.processing.tokenizer import Tokenizer

__all__ = [
    "ImageConfig",
    "Processor",
    "Tokenizer",
    "encode_images",
    "preprocess_image",
    "smart_resize",
    "write_qwen25vl_processor_files",
]
