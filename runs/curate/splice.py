"""Real interpreter output in place of what a teacher imagined.

A teacher writes `<code>```python ...```</code>` blocks and, in a single-turn answer, follows each
with an `<interpreter>...</interpreter>` it made up. `splice(text, session)` runs every block in
order in ONE sandbox session (so variables and files carry over, as in a rollout), drops the
imagined output, and returns trajectory messages in the SFT format (`data.trajectory`): each
assistant segment ends at its `</code>`, then an `observation` holding the real output
(`protocol.observation_text`: stdout, stderr, `[status: error]` when it failed) and the images it
showed or saved (at most `max_images` per cell), then the text after it.

`execute_turn` is the multi-turn form: one teacher turn with (at most) one block; whatever the
teacher wrote after `</code>` is discarded because the real output comes next.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from codedance_jax.protocol import observation_text

CODE_RE = re.compile(r"<code>\s*```(?:python|py)?[ \t]*\n(.*?)```\s*</code>", re.S)
IMAGINED_RE = re.compile(r"\s*<interpreter>.*?</interpreter>", re.S)
MAX_IMAGES = 4


@dataclasses.dataclass
class Cell:
    code: str
    status: str
    text: str
    images: list[bytes]


def run_cell(session, code: str, max_images: int = MAX_IMAGES) -> Cell:
    r = session.execute(code)
    return Cell(code, r.status, observation_text(r.stdout, r.stderr, r.status), list(r.images[:max_images]))


def observation(cell: Cell) -> dict[str, Any]:
    return {"role": "observation", "content": cell.text, "num_images": len(cell.images)}


def splice(text: str, session, max_images: int = MAX_IMAGES) -> tuple[list[dict[str, Any]], list[Cell], int]:
    """(messages, cells, number of imagined outputs replaced); see the module docstring."""
    messages: list[dict[str, Any]] = []
    cells: list[Cell] = []
    replaced = pos = 0
    for m in CODE_RE.finditer(text):
        if m.start() < pos:  # inside an imagined output we already skipped
            continue
        messages.append({"role": "assistant", "content": text[pos:m.end()].strip()})
        cell = run_cell(session, m.group(1), max_images)
        cells.append(cell)
        messages.append(observation(cell))
        pos = m.end()
        im = IMAGINED_RE.match(text, pos)
        if im:
            replaced += 1
            pos = im.end()
    tail = text[pos:].strip()
    if tail:
        messages.append({"role": "assistant", "content": tail})
    return messages, cells, replaced


def code_of_turn(reply: str) -> tuple[str, str | None]:
    """(the turn's text up to its first `</code>`, the code) or (reply, None) for a turn without code."""
    if "<code>" in reply and "</code>" not in reply[reply.rindex("<code>"):]:
        reply += "</code>"  # OpenAI servers strip the stop string
    m = CODE_RE.search(reply)
    if not m:
        return reply.strip(), None
    return reply[: m.end()].strip(), m.group(1)
