"""The README's first command until the end-to-end demo lands: the checkpoint pipeline, shown.

It builds a small *random* Qwen2.5-VL (no weights can be downloaded here), writes it as a Hugging
Face checkpoint with the real Qwen tokenizer, converts it to orbax with `launch.convert`'s code,
loads it back with `from_pretrained`, and answers a question about a generated image with the
KV-cache decode loop. The answer is noise (the weights are random); what the run shows is every
stage working on real files. When torch is installed it also checks the logits against
`transformers` loading the same Hugging Face directory, and the orbax -> HF export bit for bit.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
from flax import nnx
from PIL import Image, ImageDraw

from codedance_jax.checkpoint import hf
from codedance_jax.checkpoint.convert import convert
from codedance_jax.model.config import ModelConfig
from codedance_jax.model.generate import extend_host, greedy_decode
from codedance_jax.model.qwen25vl import Qwen25VL


def make_random_checkpoint(out_dir: str, cfg: ModelConfig, seed: int = 0) -> None:
    from codedance_jax.processing.reference_files import write_qwen25vl_processor_files

    model = Qwen25VL(cfg, rngs=nnx.Rngs(seed))
    hf.export_hf(model, out_dir)
    write_qwen25vl_processor_files(out_dir, max_pixels=448 * 448)


def shapes_image(seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    img = Image.new("RGB", (320, 240), "white")
    d = ImageDraw.Draw(img)
    for _ in range(5):
        x, y = rng.integers(10, 280), rng.integers(10, 200)
        r = int(rng.integers(8, 30))
        color = tuple(int(c) for c in rng.integers(0, 200, 3))
        (d.ellipse if rng.random() < 0.5 else d.rectangle)([x, y, x + r, y + r], fill=color)
    return img


def answer(model, processor, image: Image.Image, question: str, max_new_tokens: int = 24):
    """Greedy single-turn answer. Returns (text, token ids, prompt inputs)."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=[prompt], images=[image])
    cache = model.init_cache(batch=1, max_len=inputs["input_ids"].shape[1] + max_new_tokens + 1)
    last, cache = extend_host(model, cache, inputs["input_ids"], inputs["attention_mask"],
                              inputs["pixel_values"], inputs["image_grid_thw"], last_only=True)
    toks, _, _ = greedy_decode(model, cache, last, max_new_tokens)
    ids = [int(t) for t in np.asarray(toks)[0]]
    if processor.eos_id in ids:
        ids = ids[: ids.index(processor.eos_id)]
    return processor.decode(ids, skip_special_tokens=True), ids, inputs


def _reference_check(hf_dir: str, model, inputs) -> float | None:
    try:
        import torch
        from transformers import Qwen2_5_VLForConditionalGeneration
    except ImportError:
        return None
    ref = Qwen2_5_VLForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()
    t = {k: torch.tensor(v) for k, v in inputs.items()}
    with torch.no_grad():
        want = ref(**t).logits.numpy()
    got = np.asarray(model(inputs["input_ids"], inputs["attention_mask"], inputs["pixel_values"], inputs["image_grid_thw"]))
    return float(np.abs(got - want).max() / np.abs(want).max())


def run(workdir: str, question: str = "How many shapes are in this image?", log=print) -> dict:
    import codedance_jax

    os.makedirs(workdir, exist_ok=True)
    cfg = ModelConfig.tiny()
    hf_dir, orbax_dir, back_dir = (os.path.join(workdir, n) for n in ("hf_random", "orbax", "hf_exported"))
    t0 = time.time()
    make_random_checkpoint(hf_dir, cfg)
    log(f"[1/5] random Qwen2.5-VL (tiny preset) written as a Hugging Face checkpoint: {hf_dir}")
    convert(hf_dir, orbax_dir, log=lambda s: log("      " + s))
    log(f"[2/5] converted to orbax: {orbax_dir}")
    model, processor = codedance_jax.from_pretrained(orbax_dir)
    log("[3/5] loaded with codedance_jax.from_pretrained")
    image = shapes_image()
    image.save(os.path.join(workdir, "image.png"))
    t1 = time.time()
    text, ids, inputs = answer(model, processor, image, question)
    log(f"[4/5] Q: {question}\n      A (random weights, so noise): {text!r}  [{len(ids)} tokens, {time.time() - t1:.1f}s]")
    convert(orbax_dir, back_dir, log=lambda s: log("      " + s))
    from safetensors.numpy import load_file

    a, b = load_file(os.path.join(hf_dir, "model.safetensors")), load_file(os.path.join(back_dir, "model.safetensors"))
    identical = set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)
    log(f"[5/5] exported back to Hugging Face: {back_dir}; tensors bit-identical to the original: {identical}")
    err = _reference_check(hf_dir, model, inputs)
    if err is None:
        log("      (torch not installed: skipping the transformers logits check; tests cover it)")
    else:
        log(f"      logits vs transformers on the same checkpoint: max relative error {err:.2e}")
    summary = {"question": question, "answer": text, "answer_token_ids": ids, "roundtrip_bit_identical": identical,
               "logits_rel_err_vs_transformers": err, "seconds": round(time.time() - t0, 1)}
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    log(f"summary: {os.path.join(workdir, 'summary.json')}")
    return summary
