"""The toy tokenizer: exact round trips, Qwen's added tokens after the BPE ids, a working Processor,
a toy model that runs on a processed prompt, and SFT prompts identical to rollout prompts."""

import json
import os

import numpy as np

from codedance_jax.processing import Processor
from codedance_jax.rollout.prompts import rl_prompt
from data.chat import render
from data.toyworld import toy_model_config, train_tokenizer, write_toy_processor_files
from data.toyworld.tokenizer import qwen_added_tokens, slot_words
from data.trajectory import read_jsonl

CORPUS = [
    "<|im_start|>user\nQuestion: How many red circles?<|im_end|>\n<|im_start|>assistant\n<think>I count.</think>",
    "import numpy as np\nprint('count:', 7)\n<answer>7</answer>",
] * 20


def _random_texts(rng, n=200):
    pools = [
        "abc xyz\n\t  ()[]{}<>:;'\"`~!@#$%^&*-_=+|\\/?.,0123456789",
        "éüßñçøåæœ—–“”‘’…€£¥",
        "漢字かなカナ한국어العربيةעבריתΕλληνικάКириллица",
        "😀🚀🎉👍🏽🇺🇳\u200b\u200d\ufeff\x00\x01\x7f",
    ]
    chars = "".join(pools)
    out = []
    for _ in range(n):
        k = int(rng.integers(0, 80))
        out.append("".join(chars[i] for i in rng.integers(0, len(chars), k)))
    return out


def test_roundtrip_and_specials(tmp_path):
    ids = write_toy_processor_files(tmp_path, CORPUS, vocab_size=300, max_pixels=168 * 168)
    tok = Processor.from_pretrained(tmp_path).tokenizer
    added = qwen_added_tokens()
    assert len(tok) == 300 + len(added) + len(slot_words()) and len(added) == 22
    assert [ids[c] for c, _ in added] == list(range(300, 322))  # after the BPE ids, in Qwen's order
    # then the slot words, one id each
    assert [tok.token_to_id(w) for w in slot_words()] == list(range(322, 322 + len(slot_words())))
    for c, _ in added:
        assert tok.encode(c) == [ids[c]] and tok.encode(f"a{c}b")[1:-1] == [ids[c]]
    rng = np.random.default_rng(0)
    for text in _random_texts(rng) + CORPUS + ["".join(c for c, _ in added) + "\n\n x"]:
        assert tok.decode(tok.encode(text)) == text
    # Frequent template lines become few tokens; digits are single tokens.
    assert len(tok.encode(CORPUS[1])) < len(CORPUS[1]) / 2
    assert [tok.decode([i]) for i in tok.encode("1234")] == ["1", "2", "3", "4"]


def test_deterministic():
    a = train_tokenizer(CORPUS, 320).to_str()
    b = train_tokenizer(list(reversed(CORPUS)), 320).to_str()
    assert a == b
    assert train_tokenizer(CORPUS[:2] + ["other text other text"] * 5, 320).to_str() != a


def test_processor_files(toy_processor, world):
    d = os.path.join(world[0], "processor")
    assert set(os.listdir(d)) >= {
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.json",
        "preprocessor_config.json",
    }
    with open(os.path.join(d, "preprocessor_config.json")) as f:
        pre = json.load(f)
    assert pre["min_pixels"] == 3136 and pre["max_pixels"] == 168 * 168
    assert len(toy_processor.tokenizer) == world[1]["vocab_size"] == 400 + 22 + len(slot_words())
    assert toy_processor.eos_id == world[1]["special_ids"]["<|im_end|>"]
    assert toy_processor.pad_id == world[1]["special_ids"]["<|endoftext|>"]
    assert toy_processor.image_token_id == 400 + 12


def test_sft_prompt_equals_rollout_prompt(toy_processor, world):
    """The SFT text starts with exactly the rollout prompt's text, and its tokens with the prompt's
    tokens, image placeholders expanded (so SFT trains on what GRPO and evaluation will feed)."""
    d, _ = world
    trajs = list(read_jsonl([os.path.join(d, "sft", "sft.jsonl")], on_error="stop"))
    assert len(trajs) == 12
    with open(os.path.join(d, "sft", "sft.jsonl")) as f:
        metas = [json.loads(line)["meta"] for line in f]
    import io

    from PIL import Image

    for t, meta in zip(trajs, metas, strict=True):
        images = [Image.open(io.BytesIO(b)).convert("RGB") for b in t.images]
        prompt = rl_prompt(toy_processor, t.id, meta["question"], images[:1])
        assert render(t.messages).text.startswith(prompt.text)
        _, grid = toy_processor.encode_images(images)
        counts = [int(n) for n in toy_processor.num_image_tokens(grid)]
        sft_ids = toy_processor.tokenizer.encode(render(t.messages, counts).text)
        p_ids = toy_processor(text=[prompt.text], images=images[:1])["input_ids"][0].tolist()
        assert sft_ids[: len(p_ids)] == p_ids and len(sft_ids) > len(p_ids)
        header = [toy_processor.im_start_id] + toy_processor.tokenizer.encode("assistant\n")
        assert p_ids[-len(header) :] == header


def test_toy_model_forward(toy_processor, world):
    from flax import nnx

    from codedance_jax.model.qwen25vl import Qwen25VL, num_params

    cfg = toy_model_config(os.path.join(world[0], "processor"))
    assert cfg.text.vocab_size % 64 == 0 and cfg.text.vocab_size >= len(toy_processor.tokenizer)
    assert cfg.image_token_id == toy_processor.image_token_id and cfg.eos_token_id == toy_processor.eos_id
    assert sum(cfg.text.mrope_section) * 2 == cfg.text.head_dim
    n = num_params(cfg)["total"]
    assert 0.7e6 < n < 1.6e6, n
    from data.toyworld import load_prompts

    row = load_prompts(os.path.join(world[0], "eval", "prompts.jsonl"))[0]
    prompt = rl_prompt(toy_processor, row["id"], row["question"], row["images"])
    batch = toy_processor(text=[prompt.text], images=row["images"])
    model = Qwen25VL(cfg, rngs=nnx.Rngs(0))
    logits = np.asarray(
        model(batch["input_ids"], batch["attention_mask"], batch["pixel_values"], batch["image_grid_thw"])
    )
    assert logits.shape == (1, batch["input_ids"].shape[1], cfg.text.vocab_size)
    assert np.isfinite(logits).all() and logits.std() > 0


def test_slot_words_have_one_spelling(toy_processor, world):
    """Every colour and kind has exactly one token spelling in every text of a generated world (SFT
    trajectories as rendered for training, RL and eval prompts): question, code, observation, think
    text and answer all use the word's single id."""
    tok = toy_processor.tokenizer
    word_ids = {w: tok.token_to_id(w) for w in slot_words()}
    assert all(isinstance(i, int) and tok.decode([i]) == w for w, i in word_ids.items())
    records = read_jsonl([os.path.join(world[0], "sft", "sft.jsonl")], on_error="stop", load_images=False)
    texts = [render(t.messages).text for t in records]
    from data.toyworld import load_prompts

    texts += [row["question"] for split in ("rl", "eval")
              for row in load_prompts(os.path.join(world[0], split, "prompts.jsonl"))]
    seen = set()
    for text in texts:
        enc = tok.backend.encode(text, add_special_tokens=False)
        for i, (a, b) in zip(enc.ids, enc.offsets, strict=True):
            piece = text[a:b]
            for w in slot_words():
                if w in piece:  # a token that holds a slot word is that word's token, and nothing more
                    assert i == word_ids[w], (w, piece, text[max(0, a - 20) : b + 20])
                    seen.add(w)
    assert {"red", "green", "blue", "yellow", "circle", "square", "triangle"} <= seen, seen
