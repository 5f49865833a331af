"""Processor parity with transformers (v5): pixel values, grids, ids, masks, chat template, errors.

The reference is transformers' own `Qwen2_5_VLProcessor.__call__` over its PIL image processor and
Qwen2 tokenizer. Without torchvision its constructor's class check on the (unused) video processor
fails, so that one check is bypassed for the reference only.
"""

from __future__ import annotations

import json
import os
import zlib

import numpy as np
import pytest
from PIL import Image

from codedance_jax.processing import ImageConfig, Processor, smart_resize, write_qwen25vl_processor_files
from codedance_jax.processing.reference_files import QWEN25VL_CHAT_TEMPLATE

transformers = pytest.importorskip("transformers")
from transformers import AutoTokenizer  # noqa: E402
from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor  # noqa: E402
from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as hf_image  # noqa: E402
from transformers.processing_utils import ProcessorMixin  # noqa: E402

SMALL_MAX_PIXELS = 200_000  # keeps "larger than max_pixels" images fast


def _reference(path: str):
    tok = AutoTokenizer.from_pretrained(path)
    ip = hf_image.Qwen2VLImageProcessorPil.from_pretrained(path)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None)
        return Qwen2_5_VLProcessor(
            image_processor=ip, tokenizer=tok, video_processor=None, chat_template=tok.chat_template
        )


@pytest.fixture(scope="module")
def ckpt_dirs(tmp_path_factory):
    right = write_qwen25vl_processor_files(tmp_path_factory.mktemp("right"), max_pixels=SMALL_MAX_PIXELS)
    left = write_qwen25vl_processor_files(
        tmp_path_factory.mktemp("left"), max_pixels=SMALL_MAX_PIXELS, padding_side="left"
    )
    return {"right": right, "left": left}


@pytest.fixture(scope="module")
def pair(ckpt_dirs):
    """(ours, transformers') for the default (right-padding) directory."""
    return Processor.from_pretrained(ckpt_dirs["right"]), _reference(ckpt_dirs["right"])


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def rand_image(rng, h, w, mode="RGB"):
    channels = {"RGB": 3, "RGBA": 4, "L": 1, "LA": 2, "CMYK": 4}[mode]
    arr = rng.integers(1, 256, (h, w, channels), dtype=np.uint8)
    return Image.fromarray(arr[..., 0] if channels == 1 else arr, mode=mode)


def assert_images_equal(ours: Processor, ref, images):
    pv, grid = ours.encode_images(images)
    want = ref.image_processor(images, return_tensors="np")
    np.testing.assert_array_equal(grid, want["image_grid_thw"])
    assert pv.dtype == np.float32 and pv.shape == want["pixel_values"].shape
    np.testing.assert_allclose(pv, want["pixel_values"], rtol=0, atol=1e-6)
    return pv, grid


# ---- smart_resize --------------------------------------------------------------------------


def test_smart_resize_matches_transformers():
    rng = np.random.default_rng(0)
    sizes = [(1, 1), (1, 150), (27, 27), (28, 28), (41, 42), (14, 14), (56, 56), (3000, 4000), (20, 3999)]
    sizes += [tuple(int(x) for x in rng.integers(1, 5000, 2)) for _ in range(300)]
    for h, w in sizes:
        if max(h, w) / min(h, w) > 200:
            continue
        for lo, hi in [(3136, 12845056), (3136, SMALL_MAX_PIXELS), (256 * 28 * 28, 1280 * 28 * 28)]:
            assert smart_resize(h, w, 28, lo, hi) == hf_image.smart_resize(h, w, 28, lo, hi), (h, w, lo, hi)


def test_smart_resize_tiny_images_scale_up_like_transformers():
    # Smaller than one 28x28 patch: transformers upsamples to >= min_pixels rather than failing.
    assert smart_resize(1, 1, 28, 3136, 12845056) == (56, 56)
    assert smart_resize(5, 7, 28, 3136, 12845056) == hf_image.smart_resize(5, 7, 28, 3136, 12845056) == (56, 84)


def test_smart_resize_aspect_ratio_error_like_transformers():
    with pytest.raises(ValueError, match="aspect ratio must be smaller than 200"):
        hf_image.smart_resize(1, 201)
    with pytest.raises(ValueError, match="aspect ratio must be smaller than 200"):
        smart_resize(1, 201)
    with pytest.raises(ValueError, match="zero-sized"):
        smart_resize(0, 10)


# ---- pixel values --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "size",
    [(28, 28), (56, 84), (100, 37), (37, 100), (1, 1), (5, 7), (13, 27), (27, 400), (281, 300), (640, 480), (2, 398)],
)
def test_pixel_values_equal_for_sizes(pair, rng, size):
    ours, ref = pair
    pv, grid = assert_images_equal(ours, ref, [rand_image(rng, *size)])
    t, gh, gw = grid[0]
    assert t == 1 and gh % 2 == 0 and gw % 2 == 0
    assert pv.shape == (gh * gw, 3 * 2 * 14 * 14)


def test_pixel_values_equal_above_max_pixels(pair, rng):
    ours, ref = pair
    img = rand_image(rng, 700, 900)  # 630k pixels > SMALL_MAX_PIXELS
    _, grid = assert_images_equal(ours, ref, [img])
    assert grid[0, 1] * grid[0, 2] * 14 * 14 <= SMALL_MAX_PIXELS


@pytest.mark.parametrize("mode", ["L", "LA", "RGBA", "CMYK", "P", "P_transparent", "1", "I;16"])
def test_pixel_values_equal_for_image_modes(pair, rng, mode):
    ours, ref = pair
    base = rand_image(rng, 45, 61)
    if mode == "P":
        img = base.convert("P", palette=Image.Palette.ADAPTIVE, colors=64)
    elif mode == "P_transparent":
        img = base.convert("P", palette=Image.Palette.ADAPTIVE, colors=64)
        img.info["transparency"] = int(np.asarray(img)[0, 0])
    elif mode in ("1",):
        img = base.convert("1")
    elif mode == "I;16":
        img = Image.fromarray(rng.integers(1, 60000, (45, 61), dtype=np.uint16))
    else:
        img = rand_image(rng, 45, 61, mode)
    assert_images_equal(ours, ref, [img])


def test_transparency_is_composited_onto_white(pair):
    ours, _ = pair
    clear = Image.fromarray(np.zeros((28, 28, 4), np.uint8), "RGBA")  # fully transparent black
    white = Image.fromarray(np.full((28, 28, 3), 255, np.uint8), "RGB")
    np.testing.assert_array_equal(ours.encode_images([clear])[0], ours.encode_images([white])[0])


@pytest.mark.parametrize("kind", ["hwc_uint8", "chw_uint8", "hwc_float01", "rgba_uint8", "gray_hw1", "rgba_float01"])
def test_pixel_values_equal_for_numpy_inputs(pair, rng, kind):
    ours, ref = pair
    h, w = 50, 75
    arr = {
        "hwc_uint8": lambda: rng.integers(1, 256, (h, w, 3), dtype=np.uint8),
        "chw_uint8": lambda: rng.integers(1, 256, (3, h, w), dtype=np.uint8),
        "hwc_float01": lambda: rng.random((h, w, 3), dtype=np.float32),
        "rgba_uint8": lambda: rng.integers(1, 256, (h, w, 4), dtype=np.uint8),
        "gray_hw1": lambda: rng.integers(1, 256, (h, w, 1), dtype=np.uint8),
        "rgba_float01": lambda: rng.random((h, w, 4), dtype=np.float32),
    }[kind]()
    assert_images_equal(ours, ref, [arr])


def test_numpy_2d_array_is_grayscale(pair, rng):
    ours, ref = pair
    arr = rng.integers(1, 256, (40, 60), dtype=np.uint8)
    np.testing.assert_array_equal(ours.encode_images([arr])[0], ours.encode_images([arr[..., None]])[0])


def test_patch_layout_groups_merge_blocks(pair, rng):
    """Row r of pixel_values is patch (bh*2+i, bw*2+j) for r = ((bh*gw/2 + bw)*2 + i)*2 + j."""
    ours, _ = pair
    cfg = ours.image_config
    img = rand_image(rng, 56, 84)
    pv, grid = ours.encode_images([img])
    x = (np.asarray(img, np.float64) / 255 - np.array(cfg.image_mean)) / np.array(cfg.image_std)  # (H, W, C)
    gh, gw = grid[0, 1:]
    patches = pv.reshape(gh // 2, gw // 2, 2, 2, 3, 2, 14, 14)
    for bh, bw, i, j in [(0, 0, 0, 0), (0, 1, 1, 0), (1, 2, 1, 1), (1, 0, 0, 1)]:
        r0, c0 = (bh * 2 + i) * 14, (bw * 2 + j) * 14
        want = x[r0 : r0 + 14, c0 : c0 + 14].transpose(2, 0, 1)  # (C, p, p)
        for t in range(2):  # the single frame is repeated over temporal_patch_size
            np.testing.assert_allclose(patches[bh, bw, i, j, :, t], want, atol=1e-5)


def test_multiple_images_concatenate_in_order(pair, rng):
    ours, ref = pair
    imgs = [rand_image(rng, *s) for s in [(30, 90), (200, 150), (9, 9)]]
    pv, grid = assert_images_equal(ours, ref, imgs)
    assert pv.shape[0] == int(grid.prod(axis=1).sum())
    first = ours.encode_images(imgs[1:2])[0]
    start = int(grid[0].prod())
    np.testing.assert_array_equal(pv[start : start + len(first)], first)


# ---- full processor ------------------------------------------------------------------------

PH = "<|vision_start|><|image_pad|><|vision_end|>"


def _batch(rng):
    texts = [
        f"<|im_start|>user\n{PH}{PH}Compare these two.<|im_end|>\n<|im_start|>assistant\n",
        "Just text, no image — naïve café 表格 \n\n  spaces",
        f"{PH}What is it?{PH} and this {PH}<tool_call>",
    ]
    sizes = [(60, 90), (300, 200), (17, 33), (700, 900), (28, 28)]
    return texts, [rand_image(rng, *s) for s in sizes]


@pytest.mark.parametrize("side", ["right", "left"])
def test_processor_outputs_equal(ckpt_dirs, rng, side):
    ours = Processor.from_pretrained(ckpt_dirs[side])
    ref = _reference(ckpt_dirs[side])
    assert ours.padding_side == ref.tokenizer.padding_side == side
    texts, images = _batch(rng)
    got = ours(text=texts, images=images, padding=True)
    want = ref(text=list(texts), images=images, padding=True, return_tensors="np")
    assert set(got) == set(want)
    for key in ("input_ids", "attention_mask", "mm_token_type_ids", "image_grid_thw"):
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
        assert got[key].dtype == np.int64
    np.testing.assert_allclose(got["pixel_values"], want["pixel_values"], rtol=0, atol=1e-6)
    # the pad side is really the one asked for
    mask = got["attention_mask"]
    assert mask[1].sum() < mask.shape[1]
    assert (mask[1, 0] == 0) == (side == "left")
    # placeholders expand to t*h*w/4 per image
    n_img = (got["input_ids"] == ours.image_token_id).sum()
    assert n_img == int(ours.num_image_tokens(got["image_grid_thw"]).sum())


def test_processor_nested_images_and_padding_override(pair, rng):
    ours, ref = pair
    texts, images = _batch(rng)
    nested = [images[:2], [], images[2:]]
    got = ours(text=texts, images=nested, padding_side="left")
    ref.tokenizer.padding_side = "left"
    try:
        want = ref(text=list(texts), images=nested, padding=True, return_tensors="np")
    finally:
        ref.tokenizer.padding_side = "right"
    for key in ("input_ids", "attention_mask", "image_grid_thw", "pixel_values"):
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_processor_text_only_and_max_length(pair):
    ours, ref = pair
    texts = ["hello world", "a much longer prompt with several more words in it"]
    got = ours(text=texts, padding="max_length", max_length=20)
    want = ref(text=texts, padding="max_length", max_length=20, return_tensors="np")
    np.testing.assert_array_equal(got["input_ids"], want["input_ids"])
    np.testing.assert_array_equal(got["attention_mask"], want["attention_mask"])
    assert "pixel_values" not in got


def test_special_token_ids(pair):
    ours, ref = pair
    assert ours.image_token_id == 151655 == ref.image_token_id
    assert (ours.vision_start_id, ours.vision_end_id, ours.im_end_id, ours.pad_id) == (151652, 151653, 151645, 151643)
    assert ours.eos_id == ref.tokenizer.eos_token_id == 151645
    assert len(ours.tokenizer) == len(ref.tokenizer) == 151665


def test_encode_decode_equal(pair):
    ours, ref = pair
    texts = [
        "Hello, world!  Two  spaces\tand tab\n\nnewlines",
        "数学题：求 x^2 + 2x + 1 = 0 的解。",
        '<|im_start|>assistant\n<tool_call>\n{"name": "crop"}\n</tool_call><|im_end|><|endoftext|>',
        "emoji 🤖🧠 and accents: déjà vu, Ångström, combining e\u0301",
        "```python\nimport numpy as np\nprint(np.zeros(3))\n```",
    ]
    for t in texts:
        ids = ours.tokenizer.encode(t)
        assert ids == ref.tokenizer(t)["input_ids"], t
        assert ours.decode(ids) == ref.tokenizer.decode(ids), t
        assert ours.decode(ids, skip_special_tokens=True) == ref.tokenizer.decode(ids, skip_special_tokens=True), t


# ---- chat template -------------------------------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are CodeDance."},
        {
            "role": "user",
            "content": [
                {"type": "image", "image": "file:///a.png"},
                {"type": "text", "text": "Crop the red box."},
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "<code>crop(img, 1, 2, 3, 4)</code>"}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Observation:"},
                {"type": "image"},
                {"type": "image", "image": None},
                {"type": "text", "text": "Continue."},
            ],
        },
        {"role": "assistant", "content": "The answer is 4."},
    ],
    [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": "hello", "extra": None},
        {"role": "user", "content": [{"image": "y"}, {"text": "again"}]},
    ],
]


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("gen", [False, True])
def test_chat_template_equal(pair, rng, conv, gen):
    ours, ref = pair
    messages = CONVERSATIONS[conv]
    got = ours.apply_chat_template(messages, add_generation_prompt=gen)
    assert got == ref.tokenizer.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
    assert got == ref.apply_chat_template(messages, add_generation_prompt=gen)
    assert got.endswith("<|im_start|>assistant\n") == gen
    with_ids = ours.apply_chat_template(messages, add_generation_prompt=gen, add_vision_id=True)
    assert with_ids == ref.apply_chat_template(messages, add_generation_prompt=gen, add_vision_id=True)


def test_chat_template_with_pil_images_and_processor(pair, rng):
    ours, ref = pair
    imgs = [rand_image(rng, 64, 48), rand_image(rng, 33, 120)]
    messages = [
        {"role": "user", "content": [{"type": "image", "image": imgs[0]}, {"type": "text", "text": "look"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "image", "image": imgs[1]}, {"type": "text", "text": "and?"}]},
    ]
    prompt = ours.apply_chat_template(messages, add_generation_prompt=True)
    assert prompt == ref.apply_chat_template(messages, add_generation_prompt=True)
    got = ours(text=[prompt], images=imgs)
    want = ref(text=[prompt], images=imgs, return_tensors="np")
    np.testing.assert_array_equal(got["input_ids"], want["input_ids"])


def test_chat_template_variables_and_filters(ckpt_dirs, tmp_path):
    d = write_qwen25vl_processor_files(tmp_path / "custom", max_pixels=SMALL_MAX_PIXELS)
    # Multi-line with indented block tags: checks trim_blocks/lstrip_blocks, tojson (no HTML escaping),
    # namespaces, loop controls and which special tokens are template variables.
    template = (
        "{% set ns = namespace(n=0) %}\n"
        "{% for m in messages %}\n"
        "    {% if m['role'] == 'user' %}\n"
        "{{ m['role'] | upper }}={{ m['content'] | tojson }}{{ eos_token }}\n"
        "    {% else %}\n"
        "  A: {{ m['content'] }}\n"
        "    {% endif %}\n"
        "    {% set ns.n = ns.n + 1 %}{% if loop.index >= 2 %}{% break %}{% endif %}\n"
        "{% endfor %}\n"
        "{{ ns.n }}{{ pad_token }}{% if bos_token is defined %}BOS{% endif %}{% if add_generation_prompt %}GEN{% endif %}"
    )
    (tmp_path / "custom" / "chat_template.jinja").write_text(template)
    os.remove(os.path.join(d, "chat_template.json"))
    ours, ref = Processor.from_pretrained(d), _reference(d)
    msgs = [
        {"role": "user", "content": '<b>é</b> "quoted"'},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "never rendered"},
    ]
    assert ours.tokenizer.chat_template == template
    for gen in (False, True):
        got = ours.apply_chat_template(msgs, add_generation_prompt=gen)
        assert got == ref.tokenizer.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
    assert got == 'USER="<b>é</b> \\"quoted\\""<|im_end|>\n  A: x\n2<|endoftext|>GEN'



# A text-only Qwen template (Qwen2.5-Instruct's shape): content is used as a string (`+`,
# `.startswith`), never iterated as parts.
TEXT_ONLY_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' and message.content.startswith('<tool_response>') %}"
    "{{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' }}"
    "{%- elif message.role == 'user' or (message.role == 'system' and not loop.first) or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)


def test_string_and_list_content_templates_both_render(pair):
    """A checkpoint whose template expects string content got list content from the server and
    failed (issue 38: "'list object' has no attribute 'startswith'"). The template's content
    format is detected (as vLLM does); a string template gets the parts joined, images as their
    vision block, so both kinds of template put the same content in the same place."""
    ours, ref = pair
    as_parts = [
        {"role": "system", "content": [{"type": "text", "text": "You are CodeDance."}]},
        {"role": "user", "content": [{"type": "image", "image": "file:///a.png"}, {"type": "text", "text": "Crop it."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "<code>crop()</code>"}]},
        {"role": "user", "content": [{"type": "text", "text": "<tool_response>"}, {"type": "image_url", "image_url": {}},
                                     {"type": "text", "text": "done"}]},
    ]
    vision = "<|vision_start|><|image_pad|><|vision_end|>"
    as_text = [{"role": "system", "content": "You are CodeDance."}, {"role": "user", "content": vision + "Crop it."},
               {"role": "assistant", "content": "<code>crop()</code>"},
               {"role": "user", "content": f"<tool_response>{vision}done"}]
    for gen in (False, True):
        want = ref.tokenizer.apply_chat_template(as_text, chat_template=TEXT_ONLY_TEMPLATE, add_generation_prompt=gen,
                                                 tokenize=False)
        for messages in (as_parts, as_text):
            assert ours.apply_chat_template(messages, chat_template=TEXT_ONLY_TEMPLATE, add_generation_prompt=gen) == want
        # the list template renders the parts itself, unchanged, into the same text
        listed = ours.apply_chat_template(as_parts, add_generation_prompt=gen)
        assert listed == ref.apply_chat_template(as_parts, add_generation_prompt=gen)
        assert listed == want
    from codedance_jax.processing import content_format

    assert content_format.detect(TEXT_ONLY_TEMPLATE) == "string"
    assert content_format.detect(QWEN25VL_CHAT_TEMPLATE) == "list"


# ---- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "texts,n_images",
    [(["<|image_pad|> a", "b"], 2), (["<|image_pad|><|image_pad|>", "<|image_pad|>"], 2), (["no image"], 1)],
)
def test_placeholder_image_mismatch_raises_like_transformers(pair, rng, texts, n_images):
    ours, ref = pair
    images = [rand_image(rng, 30, 30) for _ in range(n_images)]
    with pytest.raises(ValueError, match="number of <\\|image_pad\\|> tokens"):
        ref(text=list(texts), images=images)
    with pytest.raises(ValueError, match="number of <\\|image_pad\\|> tokens"):
        ours(text=texts, images=images)


def test_placeholders_without_images_raise(pair):
    ours, ref = pair
    with pytest.raises(ValueError, match="no images were passed"):
        ref(text=["<|image_pad|>"])
    with pytest.raises(ValueError, match="no images were passed"):
        ours(text=["<|image_pad|>"])
    with pytest.raises(ValueError, match="videos are not supported"):
        ours(text=["<|video_pad|>"])


def test_extreme_aspect_ratio_raises(pair, rng):
    ours, ref = pair
    img = rand_image(rng, 2, 500)
    with pytest.raises(ValueError, match="aspect ratio"):
        ref.image_processor([img])
    with pytest.raises(ValueError, match="aspect ratio"):
        ours.encode_images([img])


def test_bad_image_inputs(pair, rng):
    ours, _ = pair
    with pytest.raises(TypeError, match="PIL image or a numpy array"):
        ours.encode_images(["not an image"])
    with pytest.raises(ValueError, match="channel axis"):
        ours.encode_images([rng.integers(1, 256, (20, 20, 7), dtype=np.uint8)])
    with pytest.raises(ValueError, match=r"range \[0, 1\]"):
        ours.encode_images([rng.random((20, 20, 3)) * 3.5])


def test_config_errors_name_file_and_field(tmp_path):
    d = write_qwen25vl_processor_files(tmp_path / "ck")
    pre = os.path.join(d, "preprocessor_config.json")
    os.remove(pre)
    with pytest.raises(FileNotFoundError, match="preprocessor_config.json"):
        Processor.from_pretrained(d)
    for field, value in [("patch_size", 0), ("image_mean", [0.5, 0.5]), ("max_pixels", "big"), ("size", {"x": 1})]:
        with open(pre, "w") as f:
            json.dump({"min_pixels": 3136, field: value}, f)
        with pytest.raises(ValueError, match=f"preprocessor_config.json: field '{field}'"):
            ImageConfig.from_pretrained(d)
    with open(pre, "w") as f:
        json.dump({"min_pixels": 3136, "max_pixels": 100}, f)
    with pytest.raises(ValueError, match="larger than max_pixels"):
        ImageConfig.from_pretrained(d)
    os.remove(os.path.join(d, "tokenizer.json"))
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Processor.from_pretrained(d)


def test_bad_padding_side(tmp_path):
    d = write_qwen25vl_processor_files(tmp_path / "ck", padding_side="middle")
    with pytest.raises(ValueError, match="tokenizer_config.json: field 'padding_side'"):
        Processor.from_pretrained(d)


# ---- config formats and export -------------------------------------------------------------


def test_v5_size_field_and_defaults(tmp_path, rng):
    d = write_qwen25vl_processor_files(tmp_path / "v5")
    with open(os.path.join(d, "preprocessor_config.json"), "w") as f:
        json.dump(
            {"size": {"shortest_edge": 2000, "longest_edge": 150_000}, "image_processor_type": "Qwen2VLImageProcessor"},
            f,
        )
    ours = Processor.from_pretrained(d)
    assert (ours.image_config.min_pixels, ours.image_config.max_pixels) == (2000, 150_000)
    ref = hf_image.Qwen2VLImageProcessorPil.from_pretrained(d)
    img = rand_image(rng, 400, 500)
    pv, grid = ours.encode_images([img])
    want = ref([img], return_tensors="np")
    np.testing.assert_array_equal(grid, want["image_grid_thw"])
    np.testing.assert_array_equal(pv, want["pixel_values"])


def test_save_pretrained_loads_in_transformers(pair, tmp_path, rng):
    ours, ref = pair
    out = tmp_path / "export"
    ours.save_pretrained(out)
    reloaded = Processor.from_pretrained(out)
    theirs = _reference(str(out))
    assert theirs.image_processor.size["longest_edge"] == SMALL_MAX_PIXELS
    assert theirs.tokenizer.chat_template == QWEN25VL_CHAT_TEMPLATE
    texts, images = _batch(rng)
    a = reloaded(text=texts, images=images)
    b = theirs(text=list(texts), images=images, padding=True, return_tensors="np")
    c = ours(text=texts, images=images)
    for key in ("input_ids", "attention_mask", "image_grid_thw", "pixel_values"):
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
        np.testing.assert_array_equal(a[key], c[key], err_msg=key)
