"""The Qwen2 BPE tokenizer and chat template, read from a checkpoint's tokenizer files.

Ids come from `tokenizer.json` through the `tokenizers` library (the same Rust BPE transformers
uses); special tokens, pad token and padding side from `tokenizer_config.json`; the chat template
from `chat_template.jinja`, `chat_template.json` or `tokenizer_config.json` (in that order, as the
transformers processor resolves it). Templates are rendered with jinja2 in the same sandboxed
environment transformers builds (`trim_blocks`, `lstrip_blocks`, `loopcontrols`, its `tojson`,
`raise_exception`, `strftime_now`), with the named special tokens as template variables.

Deviations from transformers: no truncation, no `{% generation %}` assistant masks, no
`continue_final_message`; the rollout code builds its token streams itself. Padding side defaults
to "right" when the config does not set it (transformers' default; Qwen2.5-VL's released
tokenizer_config.json does not set it). Generation should pass `padding_side="left"`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shutil
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tokenizers

from codedance_jax import input_files
from codedance_jax.errors import CheckpointError, MissingPathError
from codedance_jax.processing import content_format

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_JINJA = "chat_template.jinja"
CHAT_TEMPLATE_JSON = "chat_template.json"
# Named special tokens transformers exposes to chat templates (`special_tokens_map`).
_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Qwen2Tokenizer's constructor defaults, used when tokenizer_config.json omits the key.
_QWEN2_DEFAULTS = {"unk_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}


def _token_str(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and "content" in value:  # serialized AddedToken
        return value["content"]
    raise ValueError(f"special token must be a string or an AddedToken dict, got {value!r}")


def _plain(value: Any) -> Any:
    """What the template may see: JSON types only; anything else (images, arrays) becomes "<Type>".

    Same as transformers' `_plain_template_data`: templates only test whether keys like 'image'
    are present, and rich objects must not reach the sandbox.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    return f"<{type(value).__name__}>"


_TEMPLATE_CACHE: dict[str, Any] = {}


def _compile(template: str):
    if template in _TEMPLATE_CACHE:
        return _TEMPLATE_CACHE[template]
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers overrides jinja's tojson, which would HTML-escape.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Namespace(jinja2.utils.Namespace):
        def __setitem__(self, name, value):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} may not start with '_'")
            super().__setitem__(name, value)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    env.globals["namespace"] = Namespace
    compiled = env.from_string(template)
    _TEMPLATE_CACHE[template] = compiled
    return compiled


@dataclasses.dataclass
class Tokenizer:
    """Qwen2 tokenizer: encode/decode, padding and chat template.

    `padding_side` and `chat_template` may be changed after loading.
    """

    backend: tokenizers.Tokenizer
    config: dict[str, Any]
    chat_template: str | dict[str, str] | None = None
    padding_side: str = "right"
    # Files copied verbatim by save_pretrained (vocab.json, merges.txt, ...), name -> path.
    extra_files: dict[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        self.backend.no_truncation()
        self.backend.no_padding()
        if self.padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {self.padding_side!r}")
        cfg = self.config
        self.special_tokens: dict[str, str] = {}
        for name in _NAMED_SPECIAL:
            value = _token_str(cfg[name]) if name in cfg else _QWEN2_DEFAULTS.get(name)
            if value is not None:
                self.special_tokens[name] = value
        for name, tok in self.special_tokens.items():
            if self.backend.token_to_id(tok) is None:
                raise CheckpointError(
                    f"{TOKENIZER_CONFIG}: field '{name}' is {tok!r}, which is not in {TOKENIZER_FILE}'s vocabulary"
                )

    # ---- loading / saving -------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, padding_side: str | None = None) -> Tokenizer:
        """Load from a checkpoint directory holding tokenizer.json + tokenizer_config.json."""
        path = os.fspath(path)
        tok_file = os.path.join(path, TOKENIZER_FILE)
        cfg_file = os.path.join(path, TOKENIZER_CONFIG)
        for f in (tok_file, cfg_file):
            if not os.path.lexists(f):
                raise MissingPathError(
                    f"{f} not found: the tokenizer needs {TOKENIZER_FILE} (the BPE model) and "
                    f"{TOKENIZER_CONFIG} (special tokens, pad token, chat template) in {path}"
                )
        with input_files.open_binary(tok_file) as f:
            if input_files.is_lfs_pointer(f.read(len(input_files.LFS_POINTER))):
                raise input_files.lfs_pointer_error(tok_file)
        try:
            backend = tokenizers.Tokenizer.from_file(tok_file)
        except Exception as e:
            raise CheckpointError(f"{tok_file} could not be read by the tokenizers library: {e}",
                                  input_files.RECOPY_FIX) from e
        config = input_files.read_json(cfg_file)
        if not isinstance(config, dict):
            raise CheckpointError(f"{cfg_file}: expected a JSON object, got {type(config).__name__}",
                                  input_files.RECOPY_FIX)
        cls._add_config_tokens(backend, config, cfg_file)
        side = padding_side or config.get("padding_side") or "right"
        if side not in ("left", "right"):
            raise CheckpointError(f"{cfg_file}: field 'padding_side' must be 'left' or 'right', got {side!r}")
        extra = {
            n: os.path.join(path, n) for n in ("vocab.json", "merges.txt") if os.path.isfile(os.path.join(path, n))
        }
        return cls(backend, config, _load_chat_template(path, config), side, extra)

    @staticmethod
    def _add_config_tokens(backend: tokenizers.Tokenizer, config: dict, source: str) -> None:
        """Add tokens that tokenizer_config.json declares but tokenizer.json lacks; check the rest."""
        decoder = config.get("added_tokens_decoder") or {}
        for idx, spec in decoder.items():
            content = _token_str(spec)
            have = backend.token_to_id(content)
            if have is None:
                if int(idx) != backend.get_vocab_size(with_added_tokens=True):
                    raise CheckpointError(
                        f"{source}: added_tokens_decoder[{idx}] {content!r} is missing from {TOKENIZER_FILE} "
                        "and cannot be appended at that id"
                    )
                flags = {k: spec[k] for k in ("single_word", "lstrip", "rstrip", "normalized") if k in spec}
                token = tokenizers.AddedToken(content, special=bool(spec.get("special", False)), **flags)
                backend.add_tokens([token])
            elif have != int(idx):
                raise CheckpointError(
                    f"{source}: added_tokens_decoder maps {content!r} to {idx}, but {TOKENIZER_FILE} has it at {have}"
                )

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write tokenizer.json, tokenizer_config.json and chat_template.jinja (transformers v5 layout;
        the template is also kept in tokenizer_config.json for v4 loaders)."""
        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)
        self.backend.save(os.path.join(path, TOKENIZER_FILE))
        config = dict(self.config)
        config["padding_side"] = self.padding_side
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
            if isinstance(self.chat_template, str):
                with open(os.path.join(path, CHAT_TEMPLATE_JINJA), "w") as f:
                    f.write(self.chat_template)
        with open(os.path.join(path, TOKENIZER_CONFIG), "w") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)
        for name, src in self.extra_files.items():
            dst = os.path.join(path, name)
            if os.path.abspath(src) != os.path.abspath(dst):
                shutil.copyfile(src, dst)

    # ---- ids -------------------------------------------------------------------------------

    def token_to_id(self, token: str) -> int:
        idx = self.backend.token_to_id(token)
        if idx is None:
            raise KeyError(f"token {token!r} is not in the tokenizer's vocabulary")
        return idx

    @property
    def pad_id(self) -> int:
        if "pad_token" not in self.special_tokens:
            raise ValueError(f"{TOKENIZER_CONFIG} sets no pad_token; padding needs one")
        return self.token_to_id(self.special_tokens["pad_token"])

    @property
    def eos_id(self) -> int:
        return self.token_to_id(self.special_tokens["eos_token"])

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Ids of one string (no special tokens are added: Qwen has no BOS)."""
        return self.backend.encode(text, add_special_tokens=True).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=True)]

    def decode(self, ids: Sequence[int] | np.ndarray, skip_special_tokens: bool = False) -> str:
        ids = np.asarray(ids).reshape(-1).tolist()
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, ids: Sequence[Sequence[int]] | np.ndarray, skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(row, skip_special_tokens) for row in ids]

    def pad(
        self,
        ids: Sequence[Sequence[int]],
        padding: bool | str = True,
        max_length: int | None = None,
        pad_to_multiple_of: int | None = None,
        padding_side: str | None = None,
    ) -> dict[str, np.ndarray]:
        """Rows of ids -> `input_ids`, `attention_mask` int64 arrays [B, T], as the transformers tokenizer
        pads with padding=True/"longest"/"max_length"/False (False needs equal lengths)."""
        side = padding_side or self.padding_side
        if side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {side!r}")
        lengths = [len(r) for r in ids]
        longest = max(lengths, default=0)
        if padding is True or padding == "longest":
            target = longest
        elif padding == "max_length":
            if max_length is None:
                raise ValueError("padding='max_length' needs max_length")
            if longest > max_length:
                raise ValueError(f"a sequence has {longest} tokens, more than max_length={max_length} (no truncation)")
            target = max_length
        elif padding is False or padding == "do_not_pad":
            if len(set(lengths)) > 1:
                raise ValueError(f"sequences have different lengths {lengths}; pass padding=True to return one array")
            target = longest
        else:
            raise ValueError(f"padding must be True, False, 'longest' or 'max_length', got {padding!r}")
        if pad_to_multiple_of and padding is not False and target % pad_to_multiple_of:
            target = (target // pad_to_multiple_of + 1) * pad_to_multiple_of
        needs_pad = any(n < target for n in lengths)
        input_ids = np.full((len(ids), target), self.pad_id if needs_pad else 0, np.int64)
        mask = np.zeros((len(ids), target), np.int64)
        for i, row in enumerate(ids):
            n = len(row)
            sl = slice(target - n, target) if side == "left" else slice(0, n)
            input_ids[i, sl] = row
            mask[i, sl] = 1
        return {"input_ids": input_ids, "attention_mask": mask}

    # ---- chat template ---------------------------------------------------------------------

    def resolve_chat_template(self, name: str | None = None) -> str:
        tpl = self.chat_template
        if tpl is None:
            raise ValueError(
                "no chat template: the checkpoint has no chat_template.jinja, chat_template.json, "
                f"or 'chat_template' field in {TOKENIZER_CONFIG}"
            )
        if isinstance(tpl, dict):
            key = name or "default"
            if key not in tpl:
                raise ValueError(f"no chat template named {key!r}; available: {sorted(tpl)}")
            return tpl[key]
        return tpl if name is None else name

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render one conversation to text, as transformers' `apply_chat_template(..., tokenize=False)`.

        Messages are dicts with `role` and `content` (a string or a list of `{"type": "text",
        "text": ...}` / `{"type": "image", ...}` items); keys whose value is None are dropped
        first, as transformers does. A template that expects string content (the text-only Qwen
        templates) gets each list of parts joined into one string, images as their vision block
        (`codedance_jax.processing.content_format`); transformers would fail there.
        """
        if isinstance(messages, (list, tuple)) and not messages:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        chat = []
        for m in messages:
            if not isinstance(m, Mapping):
                raise TypeError(f"chat messages must be dicts, got {m!r}")
            chat.append(_plain({k: v for k, v in m.items() if v is not None}))
        source = self.resolve_chat_template(chat_template)
        template = _compile(source)
        if content_format.detect(source) == "string":  # a text-only template: parts joined into strings
            chat = content_format.to_string_content(chat)
        variables = _plain({**self.special_tokens, **kwargs})
        return template.render(
            messages=chat, tools=None, documents=None, add_generation_prompt=add_generation_prompt, **variables
        )


def _load_chat_template(path: str, config: dict) -> str | dict[str, str] | None:
    jinja_file = os.path.join(path, CHAT_TEMPLATE_JINJA)
    json_file = os.path.join(path, CHAT_TEMPLATE_JSON)
    if os.path.lexists(jinja_file):
        with input_files.open_binary(jinja_file) as f:
            raw = f.read()
        if input_files.is_lfs_pointer(raw):
            raise input_files.lfs_pointer_error(jinja_file)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{jinja_file}: not UTF-8 text ({e})", input_files.RECOPY_FIX) from e
    if os.path.lexists(json_file):
        obj = input_files.read_json(json_file)
        tpl = obj.get("chat_template") if isinstance(obj, dict) else None
        if not isinstance(tpl, str):
            raise CheckpointError(f"{json_file}: expected a JSON object with a 'chat_template' string")
        return tpl
    tpl = config.get("chat_template")
    if isinstance(tpl, list):  # [{"name": ..., "template": ...}, ...]
        return {t["name"]: t["template"] for t in tpl}
    if tpl is not None and not isinstance(tpl, str):
        raise CheckpointError(f"{TOKENIZER_CONFIG}: field 'chat_template' must be a string or a list of named templates")
    return tpl
