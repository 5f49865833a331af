"""The turn/observation protocol: turn formats, observation rendering and the RL prompt's text.

The one place that knows how a tool call is written, how tool output is rendered back, and what the
RL instruction says. SFT data (`data/chat.py`), rollouts (`rollout/`), scoring (`rl/format.py`) and
the toy world's expert all read it, so the three can never disagree on a tag or a newline.

SPEC section 2 [decided]: after a code turn the assistant message is closed and the observation is
a user turn in Qwen chat format,

    <|im_end|>\\n<|im_start|>user\\n<interpreter>\\n{text}\\n</interpreter>{images}<|im_end|>\\n<|im_start|>assistant\\n

with `{images}` one `<|vision_start|><|image_pad|>...<|vision_end|>` block per captured image.
`render_observation` returns exactly that string (the rollout engine appends it after a closed
code block); `observation_content` is its user-turn body, which the SFT renderer places between
`<|im_start|>user\\n` and `<|im_end|>\\n` — the same characters, so SFT and rollouts see identical
observation tokens. `observation_text` assembles `{text}` from an execution result.

Two turn formats (SPEC section 4, presets): `code` (paper, default) — the assistant writes
`<code>```python ...```</code>` and observations are wrapped in `<interpreter>`; `tool_call`
(the authors' release) — the assistant writes Qwen `<tool_call>` JSON and observations are wrapped
in `<tool_response>`, as Qwen's chat template renders tool messages. Only the wrapper tags differ.

The RL prompt (paper Table 10, SPEC section 2): the user message is the image(s), then
`rl_question(question, fmt)` = `Question: {question}\n` + the format's `RL_INSTRUCTION`.
`TEXT_ONLY_INSTRUCTION` replaces it when evaluation runs without code (max_turns 0).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"

DEFAULT_MAX_CHARS = 2000  # SPEC: observation text is truncated to a configurable limit
TRUNCATION_MARKER = "\n[... {n} characters truncated ...]\n"


@dataclasses.dataclass(frozen=True)
class TurnFormat:
    """How a tool call is written by the assistant and how its observation is wrapped."""

    name: str
    call_open: str  # what the assistant writes to start a tool call
    call_close: str  # the stop string that ends an assistant tool turn
    obs_open: str
    obs_close: str


CODE = TurnFormat("code", "<code>", "</code>", "<interpreter>", "</interpreter>")
TOOL_CALL = TurnFormat("tool_call", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
TURN_FORMATS = {f.name: f for f in (CODE, TOOL_CALL)}


RL_INSTRUCTION = {
    "code": (
        "Think step-by-step within <think></think>. You now have the ability to selectively write executable "
        "Python code to enhance your reasoning process. The Python code should be complete scripts, including "
        "necessary imports.\nEach code snippet is wrapped with\n<code>\n```python\ncode snippet\n```\n</code>\n"
        "You must provide your final answer in\n<answer> </answer>."
    ),
    # The release's format: the code travels as the argument of a Qwen tool call.
    "tool_call": (
        "Think step-by-step within <think></think>. You now have the ability to selectively write executable "
        "Python code to enhance your reasoning process. The Python code should be complete scripts, including "
        "necessary imports.\nEach code snippet is sent as a tool call\n<tool_call>\n"
        '{"name": "code_interpreter", "arguments": {"code": "code snippet"}}\n</tool_call>\n'
        "You must provide your final answer in\n<answer> </answer>."
    ),
}
TEXT_ONLY_INSTRUCTION = (
    "Think step-by-step within <think></think>. You must provide your final answer in\n<answer> </answer>."
)


def get_turn_format(fmt: str | TurnFormat) -> TurnFormat:
    if isinstance(fmt, TurnFormat):
        return fmt
    if fmt not in TURN_FORMATS:
        raise ValueError(f"unknown turn format {fmt!r}; expected one of {sorted(TURN_FORMATS)}")
    return TURN_FORMATS[fmt]


def rl_question(question: str, fmt: str | TurnFormat = CODE) -> str:
    """The text of the RL prompt's user turn after its images: the question, then the instruction."""
    return f"Question: {question}\n{RL_INSTRUCTION[get_turn_format(fmt).name]}"


def text_only_question(question: str) -> str:
    """The user text when no code can run: the question and the answer-only instruction."""
    return f"Question: {question}\n{TEXT_ONLY_INSTRUCTION}"


def image_block(num_tokens: int = 1) -> str:
    """One image in the text: `<|vision_start|>` + `num_tokens` x `<|image_pad|>` + `<|vision_end|>`.

    With `num_tokens=1` this is the unexpanded placeholder that `Processor` expands from the
    image's grid; the SFT renderer passes the expanded count so it can tokenize once.
    """
    if num_tokens < 1:
        raise ValueError(f"an image needs at least one placeholder token, got {num_tokens}")
    return VISION_START + IMAGE_PAD * num_tokens + VISION_END


def _image_blocks(images: int | Sequence[int]) -> str:
    """`images`: a count of unexpanded images, or the placeholder-token count of each image."""
    counts = [1] * images if isinstance(images, int) else list(images)
    return "".join(image_block(n) for n in counts)


def observation_content(text: str, images: int | Sequence[int] = 0, fmt: str | TurnFormat = CODE) -> str:
    """The body of the observation's user turn: `<interpreter>\\n{text}\\n</interpreter>{images}`."""
    f = get_turn_format(fmt)
    return f"{f.obs_open}\n{text}\n{f.obs_close}{_image_blocks(images)}"


def render_observation(text: str, images: int | Sequence[int] = 0, fmt: str | TurnFormat = CODE) -> str:
    """The SPEC's observation string, from the `<|im_end|>` closing the code turn to the next
    assistant header. `images`: number of images (unexpanded) or per-image placeholder counts."""
    return f"{IM_END}\n{IM_START}user\n{observation_content(text, images, fmt)}{IM_END}\n{IM_START}assistant\n"


def truncate(text: str, max_chars: int = DEFAULT_MAX_CHARS) -> str:
    """Keep the first `max_chars` characters and say how many were cut (visible to the model)."""
    if max_chars < 0 or len(text) <= max_chars:
        return text
    return text[:max_chars] + TRUNCATION_MARKER.format(n=len(text) - max_chars)


def observation_text(stdout: str, stderr: str = "", status: str = "ok", max_chars: int = DEFAULT_MAX_CHARS) -> str:
    """`{text}` of an observation: stdout, then stderr, truncated together to `max_chars`, then a
    status line `[status: error|timeout|crashed]` when the execution did not end `ok`.

    The status line is appended after truncation so it is never cut; its words include
    `timeout`, which the release preset's failure test looks for.
    """
    body = "\n".join(s for s in (stdout.rstrip("\n"), stderr.rstrip("\n")) if s)
    body = truncate(body, max_chars)
    if status != "ok":
        body = f"{body}\n[status: {status}]" if body else f"[status: {status}]"
    return body
