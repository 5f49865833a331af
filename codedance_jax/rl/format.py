"""R_format: is a multi-turn response well formed, for either turn format.

Two turn formats (SPEC §2/§4): the paper's `<code>```python …```</code>` blocks answered by
`<interpreter>…</interpreter>` observations, and the release's Qwen `<tool_call>{json}</tool_call>`
answered by `<tool_response>…</tool_response>`. The response is checked per assistant turn (the
observations are the environment's, never judged). Compliant means:

- `<think>`/`</think>` balanced (the release's check);
- every code block opened is closed, not nested, and holds code (a non-empty fenced block for
  `<code>`, a JSON object with a "name" for `<tool_call>`);
- every turn but the last ends with its code block (the rollout stops at the closing tag), and
  holds exactly one;
- exactly one `<answer>…</answer>`, non-empty, in the last turn, with no code block in that turn
  and nothing but whitespace / end-of-turn markers after `</answer>`.

An empty answer is malformed here (the release only requires the tags); see WORKSPACE.md.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence

from codedance_jax.protocol import CODE, IM_END, TOOL_CALL, TurnFormat, get_turn_format

# The tags come from the one protocol module; the old names stay for callers of this module.
CODE_FORMAT, TOOL_CALL_FORMAT = CODE, TOOL_CALL
_END_MARKERS = (IM_END, "<|endoftext|>")
_FENCE_RE = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class FormatResult:
    ok: bool
    problems: tuple[str, ...]


def split_turns(response: str, fmt: TurnFormat) -> list[str]:
    """Assistant turns of a decoded multi-turn response: the text between observation blocks
    (an observation with its chat-template wrapping removed)."""
    obs = re.compile(
        r"(?:<\|im_end\|>\s*<\|im_start\|>user\s*)?"
        + re.escape(fmt.obs_open)
        + ".*?"
        + re.escape(fmt.obs_close)
        + r"(?:.*?<\|im_end\|>\s*<\|im_start\|>assistant\s*)?",
        re.DOTALL,
    )
    return obs.split(response)


def _call_body_problem(body: str, fmt: TurnFormat) -> str | None:
    if fmt.name == "code":
        m = _FENCE_RE.search(body)
        if m is None or not m.group(1).strip():
            return "code block without a fenced, non-empty ```python block"
        return None
    try:
        call = json.loads(body.strip())
    except ValueError:
        return "tool call is not valid JSON"
    if not isinstance(call, dict) or "name" not in call or not isinstance(call.get("arguments", {}), dict):
        return 'tool call JSON lacks "name" or has non-object "arguments"'
    return None


def check_format(response: str | Sequence[str], fmt: TurnFormat | str = CODE_FORMAT) -> FormatResult:
    """Check a response (a decoded string with observations, or the list of assistant turns)."""
    fmt = get_turn_format(fmt)
    turns = split_turns(response, fmt) if isinstance(response, str) else list(response)
    problems: list[str] = []
    full = "".join(turns)
    if full.count("<think>") != full.count("</think>"):
        problems.append("unbalanced <think> tags")

    n_answers = full.count("<answer>")
    if n_answers != 1 or full.count("</answer>") != 1:
        problems.append(f"expected exactly one <answer>…</answer>, found {n_answers} opening tag(s)")

    for m, turn in enumerate(turns):
        last = m == len(turns) - 1
        opens = [x.start() for x in re.finditer(re.escape(fmt.call_open), turn)]
        closes = [x.start() for x in re.finditer(re.escape(fmt.call_close), turn)]
        if (
            len(opens) != len(closes)
            or any(c < o for o, c in zip(opens, closes, strict=False))
            or any(n < c for c, n in zip(closes, opens[1:], strict=False))
        ):
            problems.append(f"turn {m}: unclosed or nested {fmt.call_open} block")
            continue
        for o in opens:
            body = turn[o + len(fmt.call_open) : turn.index(fmt.call_close, o)]
            problem = _call_body_problem(body, fmt)
            if problem:
                problems.append(f"turn {m}: {problem}")
        if not last:
            if len(opens) != 1:
                problems.append(
                    f"turn {m}: a turn before the last must hold exactly one code block, found {len(opens)}"
                )
            elif turn[closes[-1] + len(fmt.call_close) :].strip():
                problems.append(f"turn {m}: text after the code block (the turn should end at {fmt.call_close})")
            if "<answer>" in turn:
                problems.append(f"turn {m}: answer before the last turn")
        else:
            if opens:
                problems.append(f"turn {m}: code block in the answer turn is never executed")
            if "</answer>" in turn:
                tail = turn[turn.rindex("</answer>") + len("</answer>") :]
                for marker in _END_MARKERS:
                    tail = tail.replace(marker, "")
                if tail.strip():
                    problems.append("text after </answer>")
                ans = re.findall(r"<answer>(.*?)</answer>", turn, re.DOTALL)
                if ans and not ans[-1].strip():
                    problems.append("empty answer")
            elif n_answers == 1:
                problems.append("the answer is not in the last turn")
    return FormatResult(ok=not problems, problems=tuple(problems))


def format_ok(response: str | Sequence[str], fmt: TurnFormat | str = CODE_FORMAT) -> bool:
    """R_format's indicator: True when `check_format` finds no problem."""
    return check_format(response, fmt).ok
