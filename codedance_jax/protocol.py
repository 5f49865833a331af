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

Reading a turn (the second half of this module) is also here and nowhere else: the stop strings
that end a turn (`stop_strings`, `find_stop`), the code inside a call block (`extract_code`: a
fenced block tagged `python`, `py`, `python3` or untagged; a tool-call JSON object) and the final
answer (`extract_answer`). The rollout engine executes exactly the blocks `extract_code` accepts,
the format reward (`rl/format.py`) rejects exactly the ones it refuses, and scoring reads the answer
the engine recorded, so what ran, what was judged well formed and what was scored cannot disagree.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
ENDOFTEXT = "<|endoftext|>"
ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"
END_MARKERS = (IM_END, ENDOFTEXT)  # what may follow `</answer>` in a well-formed last turn

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


# ------------------------------------------------------------------------------ reading a turn
FENCE_LANGS = ("python3", "python", "py")  # the tags a fenced block may carry; untagged is Python too
FENCE_RE = re.compile(r"```[ \t]*(?:" + "|".join(FENCE_LANGS) + r")?[ \t]*\n(.*?)```", re.DOTALL)
ANSWER_RE = re.compile(re.escape(ANSWER_OPEN) + "(.*?)" + re.escape(ANSWER_CLOSE), re.DOTALL)


def stop_strings(fmt: str | TurnFormat) -> tuple[str, ...]:
    """The strings that end an assistant turn: a closed call block, a closed answer, end of message."""
    return (get_turn_format(fmt).call_close, ANSWER_CLOSE, IM_END, ENDOFTEXT)


def find_stop(text: str, fmt: str | TurnFormat) -> tuple[int, str] | None:
    """(end offset, stop string) of the earliest stop string in `text`, or None."""
    best = None
    for s in stop_strings(fmt):
        i = text.find(s)
        if i >= 0 and (best is None or i + len(s) < best[0]):
            best = (i + len(s), s)
    return best


@dataclasses.dataclass(frozen=True)
class CodeBlock:
    code: str | None  # what runs in the sandbox; None when the block is malformed
    error: str | None  # why it is malformed (reported to the model as an error observation)


def call_body(body: str, fmt: str | TurnFormat) -> CodeBlock:
    """The code inside one call block's body (the text between `call_open` and `call_close`).

    code format: the first fenced block (```` ```python ````, ```` ```py ````, ```` ```python3 ```` or
    untagged) holding non-blank code. tool_call format: a JSON object with a string "name" and
    "arguments" (an object, or a JSON string of one); the code is `arguments["code"]`, or the only
    string argument when there is no "code" key.
    """
    if get_turn_format(fmt).name == "code":
        m = FENCE_RE.search(body)
        if m is None or not m.group(1).strip():
            return CodeBlock(None, "no ```python fenced block with code inside the code block")
        return CodeBlock(m.group(1), None)
    try:
        call = json.loads(body.strip())
        args = call.get("arguments", {}) if isinstance(call, dict) else None
        if isinstance(args, str):
            args = json.loads(args)
    except (ValueError, RecursionError) as e:
        return CodeBlock(None, f"the tool call is not valid JSON ({type(e).__name__})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return CodeBlock(None, 'the tool call needs a JSON object with a string "name"')
    if not isinstance(args, dict):
        return CodeBlock(None, 'the tool call\'s "arguments" must be a JSON object')
    code = args.get("code")
    if code is None:
        strings = [v for v in args.values() if isinstance(v, str)]
        code = strings[0] if len(strings) == 1 else None
    if not isinstance(code, str) or not code.strip():
        return CodeBlock(None, 'the tool call arguments hold no "code" string')
    return CodeBlock(code, None)


def extract_code(turn_text: str, fmt: str | TurnFormat) -> CodeBlock:
    """The code of the turn's call block, which ends the turn (`...</code>` / `...</tool_call>`).

    A turn holds exactly one block, as the format reward requires of every turn before the last.
    """
    fmt = get_turn_format(fmt)
    end = turn_text.rfind(fmt.call_close)
    if end < 0:
        return CodeBlock(None, f"the turn does not end with {fmt.call_close}")
    start = turn_text.rfind(fmt.call_open, 0, end)
    if start < 0:
        return CodeBlock(None, f"{fmt.call_close} without a matching {fmt.call_open}")
    if turn_text.count(fmt.call_open) > 1 or turn_text.count(fmt.call_close) > 1:
        return CodeBlock(None, f"a turn holds one {fmt.call_open} block (found an unclosed, nested or second one)")
    return call_body(turn_text[start + len(fmt.call_open) : end], fmt)


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), with nested braces balanced."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None  # unbalanced: treat as no boxed answer


def extract_answer(text: str) -> str | None:
    """The final answer of a turn or response: the content of the last `<answer>...</answer>`,
    stripped, or the last `\\boxed{}` inside it if it holds one; None without an answer."""
    found = ANSWER_RE.findall(text)
    if not found:
        return None
    ans = found[-1].strip()
    boxed = extract_boxed(ans)
    return boxed.strip() if boxed is not None else ans
