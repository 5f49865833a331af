"""Qwen2.5-VL image preprocessing in numpy + PIL, equal to transformers' PIL image processor.

Mirrors `transformers.models.qwen2_vl.image_processing_pil_qwen2_vl.Qwen2VLImageProcessorPil`
(transformers v5; the "slow" processor of v4): RGB conversion, `smart_resize` to multiples of
`patch_size * merge_size`, PIL bicubic resize, rescale by 1/255, normalize with the checkpoint's
mean/std, and patch flattening to `(grid_t*grid_h*grid_w, C*temporal_patch*patch*patch)` with the
2x2 merge groups contiguous. `pixel_values` are bit-equal to the reference (same float32/float64
operation order, same PIL calls).

Deviations from transformers (all on inputs transformers rejects or crashes on):
- a 2-D numpy array (H, W) is taken as a grayscale image (transformers raises "Could not make a
  flat list of images");
- an image with a zero-sized side raises a ValueError naming the size (transformers divides by
  zero inside `smart_resize`).
Images smaller than one 28x28 merge patch are *not* an error, exactly as in transformers:
`smart_resize` scales them up to at least `min_pixels` (a 1x1 image becomes 56x56).

Videos are not supported (CodeDance works on images only); `grid_t` is always 1.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image

from codedance_jax import input_files
from codedance_jax.errors import CheckpointError, MissingPathError

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
PREPROCESSOR_CONFIG = "preprocessor_config.json"
# Image processor types whose preprocessing this module reproduces.
_KNOWN_TYPES = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil")


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = 56 * 56,
    max_pixels: int = 14 * 14 * 4 * 1280,
) -> tuple[int, int]:
    """Target (height, width): multiples of `factor`, area within [min_pixels, max_pixels].

    Same arithmetic as transformers (Python's round-half-even `round`, then floor/ceil after
    rescaling by sqrt of the area ratio), including its ValueError for aspect ratios above 200.
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"image has a zero-sized side: height={height}, width={width}")
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclasses.dataclass(frozen=True)
class ImageConfig:
    """The fields of `preprocessor_config.json` that change the output.

    Defaults are transformers' `Qwen2VLImageProcessor` class defaults (used when a field is
    absent), which are *not* the released checkpoints' values: Qwen2.5-VL ships
    min_pixels=3136, max_pixels=12845056 (the class default max is 1003520).
    """

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = int(Image.Resampling.BICUBIC)
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch: C * temporal_patch * patch * patch (1176 for Qwen2.5-VL)."""
        return len(self.image_mean) * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = PREPROCESSOR_CONFIG) -> ImageConfig:
        """Parse a preprocessor config dict; `source` names the file in error messages."""

        def err(field: str, msg: str) -> ValueError:
            return CheckpointError(f"{source}: field '{field}' {msg}")

        kind = d.get("image_processor_type")
        if kind is not None and kind not in _KNOWN_TYPES:
            raise err("image_processor_type", f"is {kind!r}; expected one of {_KNOWN_TYPES}")
        defaults = cls()
        # transformers v5 stores {"shortest_edge": min_pixels, "longest_edge": max_pixels} under
        # `size`; v4 checkpoints (Qwen2.5-VL as released) store top-level min_pixels/max_pixels,
        # which take precedence when both are present (as in transformers' __init__).
        size = d.get("size")
        min_pixels, max_pixels = defaults.min_pixels, defaults.max_pixels
        if size is not None:
            if not isinstance(size, dict):
                raise err("size", f"must be a dict with 'shortest_edge' and 'longest_edge', got {size!r}")
            lo = size.get("shortest_edge", size.get("min_pixels"))
            hi = size.get("longest_edge", size.get("max_pixels"))
            if lo is None or hi is None:
                raise err(
                    "size",
                    f"must contain 'shortest_edge' and 'longest_edge' (min/max pixels), got {size!r}",
                )
            min_pixels, max_pixels = lo, hi
        if d.get("min_pixels") is not None:
            min_pixels = d["min_pixels"]
        if d.get("max_pixels") is not None:
            max_pixels = d["max_pixels"]

        def get_int(field: str, value: Any) -> int:
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise err(field, f"must be a positive integer, got {value!r}")
            return value

        def get(field: str) -> Any:
            v = d.get(field)
            return getattr(defaults, field) if v is None else v

        def get_floats(field: str) -> tuple[float, ...]:
            v = get(field)
            if isinstance(v, (int, float)):
                v = [float(v)] * 3
            if not isinstance(v, (list, tuple)) or len(v) != 3:
                raise err(field, f"must be a list of 3 floats (one per RGB channel), got {v!r}")
            return tuple(float(x) for x in v)

        cfg = cls(
            min_pixels=get_int("min_pixels", min_pixels),
            max_pixels=get_int("max_pixels", max_pixels),
            patch_size=get_int("patch_size", get("patch_size")),
            merge_size=get_int("merge_size", get("merge_size")),
            temporal_patch_size=get_int("temporal_patch_size", get("temporal_patch_size")),
            image_mean=get_floats("image_mean"),
            image_std=get_floats("image_std"),
            rescale_factor=float(get("rescale_factor")),
            resample=int(get("resample")),
            do_resize=bool(get("do_resize")),
            do_rescale=bool(get("do_rescale")),
            do_normalize=bool(get("do_normalize")),
            do_convert_rgb=bool(get("do_convert_rgb")),
        )
        if cfg.min_pixels > cfg.max_pixels:
            raise err("min_pixels", f"({cfg.min_pixels}) is larger than max_pixels ({cfg.max_pixels})")
        return cfg

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> ImageConfig:
        """Read `<path>/preprocessor_config.json` (or `path` itself if it is the file)."""
        file = os.fspath(path)
        if os.path.isdir(file):
            file = os.path.join(file, PREPROCESSOR_CONFIG)
        if not os.path.lexists(file):
            raise MissingPathError(
                f"{file} not found: a Qwen2.5-VL checkpoint directory needs {PREPROCESSOR_CONFIG} "
                "(min_pixels, max_pixels, patch_size, merge_size, temporal_patch_size, image_mean, image_std)"
            )
        return cls.from_dict(input_files.read_json(file), source=file)

    def to_dict(self) -> dict[str, Any]:
        """The preprocessor_config.json that transformers v4 and v5 both load to this config."""
        return {
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen2_5_VLProcessor",
            "do_resize": self.do_resize,
            "do_rescale": self.do_rescale,
            "do_normalize": self.do_normalize,
            "do_convert_rgb": self.do_convert_rgb,
            "resample": self.resample,
            "rescale_factor": self.rescale_factor,
            "min_pixels": self.min_pixels,
            "max_pixels": self.max_pixels,
            "size": {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
            "patch_size": self.patch_size,
            "merge_size": self.merge_size,
            "temporal_patch_size": self.temporal_patch_size,
            "image_mean": list(self.image_mean),
            "image_std": list(self.image_std),
        }


def _channel_axis(image: np.ndarray) -> int:
    """Channels-first or -last, as transformers infers it (first wins when ambiguous)."""
    if image.ndim != 3:
        raise ValueError(f"expected an image array of shape (H, W), (H, W, C) or (C, H, W); got {image.shape}")
    if image.shape[0] in (1, 3, 4):
        return 0
    if image.shape[2] in (1, 3, 4):
        return 2
    raise ValueError(f"cannot tell the channel axis of an image array of shape {image.shape} (1, 3 or 4 channels)")


def to_rgb_chw(image: Image.Image | np.ndarray, convert_rgb: bool = True) -> np.ndarray:
    """An image as a channels-first array, converted to RGB the way transformers does.

    PIL: any image with an alpha band or a `transparency` entry (RGBA, LA, palette with a
    transparent index) is composited onto white; every other mode goes through
    `Image.convert("RGB")` (L, P, CMYK, I;16, ...). Arrays: 1 channel is repeated, 4 channels are
    alpha-blended onto white (rounded for integer dtypes); dtype is kept.
    """
    if isinstance(image, Image.Image):
        if convert_rgb:
            has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
            if has_alpha:
                rgba = image.convert("RGBA")
                white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
                image = Image.alpha_composite(white, rgba).convert("RGB")
            else:
                image = image.convert("RGB")
        arr = np.array(image)
        return arr[None] if arr.ndim == 2 else np.moveaxis(arr, -1, 0)
    if not isinstance(image, np.ndarray):
        raise TypeError(f"images must be PIL images or numpy arrays, got {type(image).__name__}")
    arr = image[..., None] if image.ndim == 2 else image  # deviation: (H, W) accepted as grayscale
    axis = _channel_axis(arr)
    if convert_rgb:
        hwc = np.moveaxis(arr, axis, -1)
        if hwc.shape[-1] == 1:
            hwc = np.repeat(hwc, 3, axis=-1)
        elif hwc.shape[-1] == 4:
            if np.issubdtype(hwc.dtype, np.floating) and (hwc.min() < 0.0 or hwc.max() > 1.0):
                raise ValueError(
                    f"The image to be converted to RGB contains values outside the range [0, 1], "
                    f"got [{hwc.min()}, {hwc.max()}]."
                )
            white = 255 if np.issubdtype(hwc.dtype, np.integer) else 1.0
            alpha = hwc[..., 3:4] / white
            blended = alpha * hwc[..., :3] + (1 - alpha) * white
            hwc = np.round(blended).astype(hwc.dtype) if white == 255 else blended.astype(hwc.dtype)
        arr = np.moveaxis(hwc, -1, axis)
    return arr if axis == 0 else np.moveaxis(arr, -1, 0)


def _rescale(image: np.ndarray, scale: float) -> np.ndarray:
    # transformers upcasts to float64 before scaling and casts to float32 after; keep that order.
    return (image.astype(np.float64) * scale).astype(np.float32)


def resize_chw(image: np.ndarray, height: int, width: int, resample: int) -> np.ndarray:
    """PIL resize of a CHW array, with transformers' uint8 round trip for float inputs."""
    do_rescale = False
    if image.dtype != np.uint8:
        if np.allclose(image, image.astype(int)):
            if not (np.all(image >= 0) and np.all(image <= 255)):
                raise ValueError(
                    "The image to be converted to a PIL image contains values outside the range [0, 255], "
                    f"got [{image.min()}, {image.max()}] which cannot be converted to uint8."
                )
        elif np.all(image >= 0) and np.all(image <= 1):
            do_rescale = True
        else:
            raise ValueError(
                "The image to be converted to a PIL image contains values outside the range [0, 1], "
                f"got [{image.min()}, {image.max()}] which cannot be converted to uint8."
            )
    hwc = np.moveaxis(image, 0, -1)
    if hwc.shape[-1] == 1:
        hwc = hwc[..., 0]
    if do_rescale:
        hwc = _rescale(hwc, 255)
    pil = Image.fromarray(hwc.astype(np.uint8))
    out = np.array(pil.resize((width, height), resample=resample, reducing_gap=None))
    out = out[None] if out.ndim == 2 else np.moveaxis(out, -1, 0)
    return _rescale(out, 1 / 255) if do_rescale else out


def patchify(image: np.ndarray, cfg: ImageConfig) -> tuple[np.ndarray, int, int]:
    """(C, H, W) -> (grid_h*grid_w, C*T*p*p) with each merge_size x merge_size group contiguous.

    Row order: (h_block, w_block, h_in_block, w_in_block); column order: (C, T, p_row, p_col).
    The single frame is repeated `temporal_patch_size` times along T, as transformers does.
    """
    image = np.asarray(image, dtype=np.float32)
    c, h, w = image.shape
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    gh, gw = h // p, w // p
    x = image.reshape(c, gh // m, m, p, gw // m, m, p)
    x = x.transpose(1, 4, 2, 5, 0, 3, 6)  # (gh/m, gw/m, m, m, C, p, p)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))
    return x.reshape(gh * gw, c * t * p * p), gh, gw


def preprocess_image(image: Image.Image | np.ndarray, cfg: ImageConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One image -> (patches (grid_h*grid_w, patch_dim) float32, (grid_t, grid_h, grid_w))."""
    x = to_rgb_chw(image, cfg.do_convert_rgb)
    if cfg.do_resize:
        h, w = smart_resize(x.shape[1], x.shape[2], cfg.factor, cfg.min_pixels, cfg.max_pixels)
        x = resize_chw(x, h, w, cfg.resample)
    elif x.shape[1] % cfg.factor or x.shape[2] % cfg.factor:
        raise ValueError(
            f"do_resize is off but the image size {x.shape[1:]} is not a multiple of patch_size*merge_size={cfg.factor}"
        )
    if cfg.do_rescale:
        x = _rescale(x, cfg.rescale_factor)
    if cfg.do_normalize:
        if not np.issubdtype(x.dtype, np.floating):
            x = x.astype(np.float32)
        mean = np.asarray(cfg.image_mean, dtype=x.dtype)[:, None, None]
        std = np.asarray(cfg.image_std, dtype=x.dtype)[:, None, None]
        x = (x - mean) / std
    patches, gh, gw = patchify(x, cfg)
    return patches, (1, gh, gw)


def flatten_images(images: Any) -> list[Image.Image | np.ndarray]:
    """A flat list of images from one image, a list, or a per-sample list of lists."""
    if images is None:
        return []
    if isinstance(images, (Image.Image, np.ndarray)):
        return [images]
    if not isinstance(images, Sequence):
        raise TypeError(f"images must be an image, a list of images or a list of lists; got {type(images).__name__}")
    flat = []
    for item in images:
        if isinstance(item, (list, tuple)):
            flat.extend(item)
        else:
            flat.append(item)
    for i, im in enumerate(flat):
        if not isinstance(im, (Image.Image, np.ndarray)):
            raise TypeError(f"image {i} is a {type(im).__name__}; expected a PIL image or a numpy array")
    return flat


def encode_images(images: Any, cfg: ImageConfig) -> tuple[np.ndarray, np.ndarray]:
    """Images -> (pixel_values (P, patch_dim) float32, image_grid_thw (n_images, 3) int64).

    `P = sum(grid_t*grid_h*grid_w)`; rows of consecutive images are concatenated in order.
    """
    flat = flatten_images(images)
    if not flat:
        return np.zeros((0, cfg.patch_dim), np.float32), np.zeros((0, 3), np.int64)
    out = [preprocess_image(im, cfg) for im in flat]
    pixel_values = np.concatenate([p for p, _ in out], axis=0)  # (P, patch_dim)
    grid_thw = np.array([g for _, g in out], dtype=np.int64)  # (n_images, 3)
    return pixel_values, grid_thw
