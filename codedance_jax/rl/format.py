"""R_format: is a multi-turn response well formed, for either turn format.

Two turn formats (SPEC §2/§4): the paper's `<code>```python …```</code>` blocks answered by
`<interpreter>…</interpreter>` observations, and the release's Qwen `<tool_call>{json}</tool_call>`
answered by `<tool_response>…</tool_response>`. The response is checked per assistant turn (the
observations are the environment's, never judged). Compliant means:

- `<think>`/`</think>` balanced (the release's check);
- every code block opened is closed, not nested, and holds code the rollout engine would run
  (`protocol.call_body`: a non-empty fenced block tagged python/py/python3 or untagged for `<code>`,
  a JSON object with a "name" and code in its "arguments" for `<tool_call>`);
- every turn but the last ends with its code block (the rollout stops at the closing tag), and
  holds exactly one;
- exactly one `<answer>…</answer>`, non-empty, in the last turn, with no code block in that turn
  and nothing but whitespace / end-of-turn markers after `</answer>`.

An empty answer is malformed here (the release only requires the tags); see WORKSPACE.md.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from codedance_jax.protocol import (
    ANSWER_CLOSE,
    ANSWER_OPEN,
    ANSWER_RE,
    CODE,
    END_MARKERS,
    TOOL_CALL,
    TurnFormat,
    call_body,
    get_turn_format,
)

# The tags and the call-body rule come from the one protocol module; the old names stay for callers.
CODE_FORMAT, TOOL_CALL_FORMAT = CODE, TOOL_CALL


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


def check_format(response: str | Sequence[str], fmt: TurnFormat | str = CODE_FORMAT) -> FormatResult:
    """Check a response (a decoded string with observations, or the list of assistant turns)."""
    fmt = get_turn_format(fmt)
    turns = split_turns(response, fmt) if isinstance(response, str) else list(response)
    problems: list[str] = []
    full = "".join(turns)
    if full.count("<think>") != full.count("</think>"):
        problems.append("unbalanced <think> tags")

    n_answers = full.count(ANSWER_OPEN)
    if n_answers != 1 or full.count(ANSWER_CLOSE) != 1:
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
            problem = call_body(body, fmt).error  # the engine runs exactly the blocks this accepts
            if problem:
                problems.append(f"turn {m}: {problem}")
        if not last:
            if len(opens) != 1:
                problems.append(
                    f"turn {m}: a turn before the last must hold exactly one code block, found {len(opens)}"
                )
            elif turn[closes[-1] + len(fmt.call_close) :].strip():
                problems.append(f"turn {m}: text after the code block (the turn should end at {fmt.call_close})")
            if ANSWER_OPEN in turn:
                problems.append(f"turn {m}: answer before the last turn")
        else:
            if opens:
                problems.append(f"turn {m}: code block in the answer turn is never executed")
            if ANSWER_CLOSE in turn:
                tail = turn[turn.rindex(ANSWER_CLOSE) + len(ANSWER_CLOSE) :]
                for marker in END_MARKERS:
                    tail = tail.replace(marker, "")
                if tail.strip():
                    problems.append("text after </answer>")
                ans = ANSWER_RE.findall(turn)
                if ans and not ans[-1].strip():
                    problems.append("empty answer")
            elif n_answers == 1:
                problems.append("the answer is not in the last turn")
    return FormatResult(ok=not problems, problems=tuple(problems))


def format_ok(response: str | Sequence[str], fmt: TurnFormat | str = CODE_FORMAT) -> bool:
    """R_format's indicator: True when `check_format` finds no problem."""
    return check_format(response, fmt).ok
