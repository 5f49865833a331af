"""Qwen2.5-VL sizes as data: one frozen dataclass per tower, presets, and the HF config.json bridge.

The `transformers` config *class defaults* are not the checkpoints' values (text defaults are
72B-sized, vision `tokens_per_second` defaults to 4 where checkpoints use 2), so a model built
from a checkpoint always reads its `config.json`; the presets below copy the released
checkpoints' `config.json` values, not the class defaults.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax.numpy as jnp

from codedance_jax import input_files
from codedance_jax.errors import CheckpointError, MissingPathError

SUPPORTED_ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLModel")


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    depth: int = 32
    hidden_size: int = 1280  # Dv
    intermediate_size: int = 3420  # Fv
    num_heads: int = 16  # Nv
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112  # pixels; a window holds (window_size / patch_size)^2 patches
    out_hidden_size: int = 3584  # D of the language model
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    tokens_per_second: int = 2  # videos only; kept for config round trips
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch: C * temporal_patch * patch * patch (1176 for Qwen)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size**2

    @property
    def window_merged(self) -> int:
        """Window side in merged tokens (4 for the released checkpoints)."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    @property
    def window_patches(self) -> int:
        """Patches in one full window (64 for the released checkpoints)."""
        return self.window_merged**2 * self.merge_unit


@dataclasses.dataclass(frozen=True)
class TextConfig:
    vocab_size: int = 152064  # V (embedding rows; more than the tokenizer has ids)
    hidden_size: int = 3584  # D
    intermediate_size: int = 18944  # F
    num_hidden_layers: int = 28  # L
    num_attention_heads: int = 28  # N
    num_key_value_heads: int = 4  # K
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    mrope_section: tuple[int, ...] = (16, 24, 24)  # temporal, height, width; sums to H / 2
    max_position_embeddings: int = 128000
    tie_word_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        # The reference computes head_dim as hidden // heads and ignores any `head_dim` field.
        return self.hidden_size // self.num_attention_heads


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything that fixes parameter shapes and numerics of a Qwen2.5-VL model."""

    vision: VisionConfig = VisionConfig()
    text: TextConfig = TextConfig()
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    bos_token_id: int = 151643
    eos_token_id: int = 151645
    # Numerics: parameters are stored in `param_dtype`, matmuls run in `dtype`; RMSNorm, softmax
    # and rotary tables always run in float32, as the reference does.
    dtype: str = "float32"
    param_dtype: str = "float32"
    # Rematerialization of decoder/vision blocks: "none" | "full" | "dots" (save matmul outputs).
    remat: str = "none"
    # Attention of the cache-free forward (training, log-probs): "xla" (runs anywhere), "flash" (the
    # Pallas TPU kernel, `model.flash`), "auto" (flash when the run's platform is TPU).
    attention: str = "xla"

    def replace(self, **kw) -> ModelConfig:
        return dataclasses.replace(self, **kw)

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def weight_dtype(self):
        return jnp.dtype(self.param_dtype)

    # ---------------------------------------------------------------- presets
    @classmethod
    def tiny(cls) -> ModelConfig:
        """A few-MB model for tests: every mechanism (GQA, windows, full-attention blocks) present."""
        return cls(
            vision=VisionConfig(
                depth=4, hidden_size=64, intermediate_size=96, num_heads=4, window_size=56,
                out_hidden_size=64, fullatt_block_indexes=(1, 3),
            ),
            text=TextConfig(
                vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, mrope_section=(2, 3, 3),
                max_position_embeddings=4096,
            ),
        )

    @classmethod
    def toy(cls, vocab_size: int, token_ids: dict[str, int]) -> ModelConfig:
        """The ~1.2M-parameter model of the demo's toy world (vision 2 x 64, decoder 4 x 128).

        `vocab_size`: the tokenizer's size with its added tokens (the embedding rounds it up to a
        multiple of 64). `token_ids`: the ids of Qwen's special tokens in that tokenizer
        (`<|image_pad|>`, `<|video_pad|>`, `<|vision_start|>`, `<|vision_end|>`, `<|endoftext|>`
        (bos) and `<|im_end|>` (eos), as Qwen's); `data.toyworld.toy_model_config` reads both from a
        processor directory.
        """
        need = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|endoftext|>", "<|im_end|>")
        missing = [t for t in need if token_ids.get(t) is None]
        if missing:
            raise ValueError(f"the toy preset needs the ids of {missing}")
        return cls(
            vision=VisionConfig(
                depth=2, hidden_size=64, intermediate_size=128, num_heads=4, window_size=56,
                out_hidden_size=128, fullatt_block_indexes=(1,),
            ),
            text=TextConfig(
                vocab_size=-(-vocab_size // 64) * 64, hidden_size=128, intermediate_size=384,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, mrope_section=(4, 6, 6),
                max_position_embeddings=4096,
            ),
            image_token_id=token_ids["<|image_pad|>"],
            video_token_id=token_ids["<|video_pad|>"],
            vision_start_token_id=token_ids["<|vision_start|>"],
            vision_end_token_id=token_ids["<|vision_end|>"],
            bos_token_id=token_ids["<|endoftext|>"],
            eos_token_id=token_ids["<|im_end|>"],
        )

    @classmethod
    def qwen25vl_3b(cls) -> ModelConfig:
        return cls(
            vision=VisionConfig(out_hidden_size=2048),
            text=TextConfig(
                vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True,
            ),
        )

    @classmethod
    def qwen25vl_7b(cls) -> ModelConfig:
        return cls(vision=VisionConfig(out_hidden_size=3584), text=TextConfig())

    # ------------------------------------------------------- HF config bridge
    @staticmethod
    def config_path(path: str | os.PathLike) -> str:
        """`path/config.json` for a directory, else `path`."""
        path = os.fspath(path)
        return os.path.join(path, "config.json") if os.path.isdir(path) else path

    @classmethod
    def read_hf_config(cls, path: str | os.PathLike) -> dict[str, Any]:
        """A checkpoint's `config.json` (directory or file) as a dict; a missing, unreadable or
        non-JSON file is a one-line user error naming it."""
        path = cls.config_path(path)
        if not os.path.lexists(path):
            raise MissingPathError(
                f"{path}: no config.json. A Hugging Face Qwen2.5-VL checkpoint directory holds "
                "config.json, *.safetensors and the tokenizer files."
            )
        cfg = input_files.read_json(path)
        if not isinstance(cfg, dict):
            raise CheckpointError(f"{path}: expected a JSON object, got {type(cfg).__name__}", input_files.RECOPY_FIX)
        return cfg

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any] | str | os.PathLike, **overrides) -> ModelConfig:
        """Builds the config from a checkpoint's `config.json` (path, directory or parsed dict).

        Reads both layouts seen in the wild: the released checkpoints' flat one (text fields at the
        top level, `rope_scaling`) and the nested `text_config` / `rope_parameters` one that
        `transformers` v5 writes.
        """
        where = "config dict"
        if not isinstance(cfg, dict):
            where = cls.config_path(cfg)
            cfg = cls.read_hf_config(where)
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type")
        if model_type != "qwen2_5_vl" and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise CheckpointError(
                f"{where}: unsupported architecture (model_type={model_type!r}, architectures={archs}); "
                f"this port loads Qwen2.5-VL only (model_type 'qwen2_5_vl', {SUPPORTED_ARCHITECTURES})."
            )
        text = dict(cfg)
        if isinstance(cfg.get("text_config"), dict):
            text.update(cfg["text_config"])
        vis = cfg.get("vision_config")
        if not isinstance(vis, dict):
            raise CheckpointError(f"{where}: field 'vision_config' is missing or not an object.")

        def need(d, key, scope):
            if key not in d:
                raise CheckpointError(f"{where}: field '{scope}{key}' is missing; copy it from the checkpoint's config.json.")
            return d[key]

        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        mrope = tuple(rope.get("mrope_section", (16, 24, 24)))
        theta = rope.get("rope_theta", text.get("rope_theta", 1_000_000.0))
        vis_rope = vis.get("rope_parameters") or {}
        tie = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
        v = VisionConfig(
            depth=need(vis, "depth", "vision_config."),
            hidden_size=need(vis, "hidden_size", "vision_config."),
            intermediate_size=need(vis, "intermediate_size", "vision_config."),
            num_heads=need(vis, "num_heads", "vision_config."),
            in_channels=vis.get("in_channels", vis.get("in_chans", 3)),
            patch_size=vis.get("patch_size", vis.get("spatial_patch_size", 14)),
            temporal_patch_size=vis.get("temporal_patch_size", 2),
            spatial_merge_size=vis.get("spatial_merge_size", 2),
            window_size=vis.get("window_size", 112),
            out_hidden_size=need(vis, "out_hidden_size", "vision_config."),
            fullatt_block_indexes=tuple(vis.get("fullatt_block_indexes", ())),
            tokens_per_second=vis.get("tokens_per_second", 2),
            rope_theta=vis_rope.get("rope_theta", 10000.0),
        )
        t = TextConfig(
            vocab_size=need(text, "vocab_size", ""),
            hidden_size=need(text, "hidden_size", ""),
            intermediate_size=need(text, "intermediate_size", ""),
            num_hidden_layers=need(text, "num_hidden_layers", ""),
            num_attention_heads=need(text, "num_attention_heads", ""),
            num_key_value_heads=text.get("num_key_value_heads") or text["num_attention_heads"],
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            mrope_section=mrope,
            max_position_embeddings=text.get("max_position_embeddings", 128000),
            tie_word_embeddings=tie,
        )
        if 2 * sum(t.mrope_section) != t.head_dim:
            raise CheckpointError(
                f"{where}: rope mrope_section {list(t.mrope_section)} must sum to head_dim/2 = {t.head_dim // 2}."
            )
        if v.window_merged < 1:
            raise CheckpointError(f"{where}: vision_config.window_size {v.window_size} is smaller than one merged patch.")
        if text.get("use_sliding_window"):
            raise CheckpointError(f"{where}: use_sliding_window=true is not supported (no released Qwen2.5-VL uses it).")
        ids = {k: cfg.get(k, text.get(k)) for k in (
            "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
            "bos_token_id", "eos_token_id")}
        ids = {k: val for k, val in ids.items() if isinstance(val, int)}
        return cls(vision=v, text=t, **ids).replace(**overrides)

    def to_hf_config(self) -> dict[str, Any]:
        """The flat `config.json` layout of the released checkpoints (loads in every transformers)."""
        v, t = self.vision, self.text
        return {
            "architectures": ["Qwen2_5_VLForConditionalGeneration"],
            "model_type": "qwen2_5_vl",
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "vision_start_token_id": self.vision_start_token_id,
            "vision_end_token_id": self.vision_end_token_id,
            "vision_token_id": 151654,
            "image_token_id": self.image_token_id,
            "video_token_id": self.video_token_id,
            "hidden_act": "silu",
            "hidden_size": t.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": t.intermediate_size,
            "max_position_embeddings": t.max_position_embeddings,
            "max_window_layers": t.num_hidden_layers,
            "num_attention_heads": t.num_attention_heads,
            "num_hidden_layers": t.num_hidden_layers,
            "num_key_value_heads": t.num_key_value_heads,
            "rms_norm_eps": t.rms_norm_eps,
            "rope_theta": t.rope_theta,
            "rope_scaling": {"type": "mrope", "rope_type": "default", "mrope_section": list(t.mrope_section)},
            "sliding_window": 32768,
            "use_sliding_window": False,
            "tie_word_embeddings": t.tie_word_embeddings,
            "torch_dtype": "bfloat16" if self.param_dtype == "bfloat16" else "float32",
            "use_cache": True,
            "vocab_size": t.vocab_size,
            "vision_config": {
                "depth": v.depth,
                "hidden_act": "silu",
                "hidden_size": v.hidden_size,
                "intermediate_size": v.intermediate_size,
                "num_heads": v.num_heads,
                "in_chans": v.in_channels,
                "in_channels": v.in_channels,
                "out_hidden_size": v.out_hidden_size,
                "patch_size": v.patch_size,
                "spatial_merge_size": v.spatial_merge_size,
                "spatial_patch_size": v.patch_size,
                "temporal_patch_size": v.temporal_patch_size,
                "window_size": v.window_size,
                "fullatt_block_indexes": list(v.fullatt_block_indexes),
                "tokens_per_second": v.tokens_per_second,
            },
        }
