"""A small byte-level BPE for the toy world, with Qwen2.5-VL's added tokens, and the toy model preset.

The BPE is trained on the world's own texts (prompts, expert turns, observations) with the
`tokenizers` library. Pre-tokenization splits only after each newline (then ByteLevel without the
GPT-2 regex), so a whole template line such as `import numpy as np\\n` or the fixed instruction's
lines can become one token, while no token crosses a line end. The line split matters for
train/inference agreement: the rollout prompt ends with `<|im_start|>assistant\\n`, tokenized alone;
in an SFT text the same header is followed by the assistant's content, and a token spanning
`assistant\\n<think>` would make the SFT prompt tokens differ from the rollout's. With the split,
`assistant\\n` is always its own pre-token. Digits are single tokens (as in Qwen's tokenizer), so a
number printed by the code and the same number in `<answer>` are the same token sequence, which a
tiny model copies far more easily. No normalizer, ByteLevel decoder: `decode(encode(t)) == t`
for every string (all 256 bytes are in the alphabet).

Qwen2.5-VL's 22 added tokens (`<|endoftext|>` ... `<|file_sep|>`, in Qwen's order and with its
special flags) get the ids right after the BPE vocabulary; `tokenizer_config.json` has the shape of
the released one (`qwen25vl_tokenizer_config`) with those ids, so `Processor.from_pretrained` and
the chat template work unchanged. Training is deterministic for a given list of texts.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from codedance_jax.model.config import ModelConfig
from codedance_jax.processing.reference_files import (
    QWEN25VL_CHAT_TEMPLATE,
    QWEN25VL_PREPROCESSOR,
    qwen25vl_tokenizer_config,
)
from data.toyworld.tasks import KINDS, PALETTE

DEFAULT_VOCAB = 1024  # BPE ids (bytes + merges); the added tokens come after
DEFAULT_MAX_PIXELS = 168 * 168  # the largest toy image, never resized
MIN_PIXELS = 3136


def qwen_added_tokens() -> list[tuple[str, bool]]:
    """(content, special) of Qwen2.5-VL's added tokens, in id order."""
    dec = qwen25vl_tokenizer_config(chat_template=False)["added_tokens_decoder"]
    return [(v["content"], v["special"]) for _, v in sorted(dec.items(), key=lambda kv: int(kv[0]))]


_SPECIAL_RE = re.compile("|".join(re.escape(c) for c, _ in qwen_added_tokens()))


def split_special(texts: Iterable[str]) -> list[str]:
    """The pieces of `texts` between added tokens (what the BPE model sees at encode time)."""
    return [p for t in texts for p in _SPECIAL_RE.split(t) if p]


def slot_words() -> tuple[str, ...]:
    """The words a toy-world answer is made of and that code and observations copy (the palette's
    colour names, the shape kinds): each is one token wherever it appears (`train_tokenizer`)."""
    return tuple(PALETTE) + tuple(KINDS)


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB,
                    isolate: tuple[str, ...] | None = None) -> Tokenizer:
    """Byte-level BPE over `texts` (added tokens are cut out first), Qwen's added tokens appended.

    Digits are pre-tokens of their own (one token each), and the `isolate` words (default:
    `slot_words()`) are tokens of their own, added after Qwen's: "red" is the same single token in
    a question, in `getrgb('red')`, in a printed observation and in `<answer>red</answer>`, and a
    plural is the word plus "s" (a word that contains one, "hundred", is cut around it). Without
    this the byte-level BPE merged across spaces and gave "blue" 17 spellings in the demo's SFT
    texts, so copying a colour into an answer was a different token sequence in every context.
    """
    if vocab_size < 257:
        raise ValueError(f"vocab_size must exceed the 256 byte symbols, got {vocab_size}")
    isolate = slot_words() if isolate is None else tuple(isolate)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex("[0-9]"), behavior="isolated"),
            pre_tokenizers.Split(Regex("\n"), behavior="merged_with_previous"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(sorted(split_special(texts)), trainer)
    base = tok.get_vocab_size(with_added_tokens=False)
    for k, (content, special) in enumerate(qwen_added_tokens()):
        token = AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False, single_word=False)
        (tok.add_special_tokens if special else tok.add_tokens)([token])
        if tok.token_to_id(content) != base + k:
            raise AssertionError(f"{content} got id {tok.token_to_id(content)}, expected {base + k}")
    # The slot words come after Qwen's tokens, as added (not special) tokens: matched before
    # pre-tokenization, so each is one id wherever it appears, and decoded as itself.
    tok.add_tokens([AddedToken(w, special=False, normalized=False, lstrip=False, rstrip=False, single_word=False)
                    for w in isolate])
    return tok


def toy_tokenizer_config(tok: Tokenizer) -> dict:
    """`qwen25vl_tokenizer_config()` with the added tokens renumbered to this tokenizer's ids."""
    cfg = qwen25vl_tokenizer_config(chat_template=True)
    cfg["added_tokens_decoder"] = {
        str(tok.token_to_id(v["content"])): v
        for _, v in sorted(cfg["added_tokens_decoder"].items(), key=lambda kv: int(kv[0]))
    }
    cfg["model_max_length"] = 4096
    return cfg


def write_toy_processor_files(
    directory: str | os.PathLike,
    texts: Iterable[str],
    *,
    vocab_size: int = DEFAULT_VOCAB,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> dict[str, int]:
    """Train the toy BPE on `texts` and write tokenizer.json, tokenizer_config.json,
    chat_template.json and preprocessor_config.json to `directory` (a `Processor.from_pretrained`
    directory). Returns the added tokens' ids by content."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    tok = train_tokenizer(texts, vocab_size)
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(toy_tokenizer_config(tok), f, indent=2)
    with open(os.path.join(directory, "chat_template.json"), "w") as f:
        json.dump({"chat_template": QWEN25VL_CHAT_TEMPLATE}, f, indent=2)
    pre = dict(QWEN25VL_PREPROCESSOR, min_pixels=MIN_PIXELS, max_pixels=int(max_pixels))
    with open(os.path.join(directory, "preprocessor_config.json"), "w") as f:
        json.dump(pre, f, indent=2)
    return {c: tok.token_to_id(c) for c, _ in qwen_added_tokens()}


def toy_model_config(processor_dir: str | os.PathLike) -> ModelConfig:
    """`ModelConfig.toy` sized by the toy tokenizer in `processor_dir` (its size and special-token ids)."""
    tok = Tokenizer.from_file(os.path.join(os.fspath(processor_dir), "tokenizer.json"))
    ids = {c: tok.token_to_id(c) for c, _ in qwen_added_tokens()}
    try:
        return ModelConfig.toy(tok.get_vocab_size(with_added_tokens=True), ids)
    except ValueError as e:
        raise ValueError(f"{processor_dir}/tokenizer.json: {e}; write it with write_toy_processor_files") from None
