"""One turn protocol: a code block runs in the sandbox if and only if the format reward accepts it,
and the answer scored is the answer the rollout engine recorded.

Turns are generated from pieces (fences with and without a language tag, `py`, `python3`, stray
whitespace, several blocks, unterminated fences, empty code, tool-call JSON of every shape, answers
with nested tags and `\\boxed{}`), then read two ways: pure (the engine's `extract_code` against
`rl.format.check_format` on the same turn) and end to end (the tiny model's rollout engine, forced by
a script to write each turn, with the scripted sandbox; then `rl.scoring.score`).

The pure half names only `codedance_jax.rollout.turns.extract_code` / `extract_answer` and
`codedance_jax.rl.format` / `codedance_jax.rl.answers`, which exist before and after the protocol
moved into `codedance_jax.protocol`: run on the old code it fails (a ```` ```python3 ```` block was
executed and scored malformed; a tool call without "name" was executed and scored malformed).
"""

import itertools

import pytest
from fakes import FakePool
from rollout_helpers import random_image, small_config

from codedance_jax.protocol import get_turn_format
from codedance_jax.rl import answers, scoring
from codedance_jax.rl.format import check_format
from codedance_jax.rollout import RolloutEngine, SamplingConfig, rl_prompt
from codedance_jax.rollout import turns as turn_lib

FINAL = "<think>done</think>\n<answer>7</answer>"

_OPEN = ["```python\n", "```py\n", "```python3\n", "```\n", "``` python \n", "```\t\n", "```Python\n", "```bash\n",
         "```python", "``python\n"]
_CODE = ['print("a")\n', "   \n", "", 'x = 1\nprint("b")\n']
_CLOSE = ["```", "", "``"]
_AROUND = [("\n", "\n"), ("", ""), ("  \n\n", "\n  ")]


def code_turns() -> list[str]:
    """Turns of the `code` format that end at `</code>` (where the engine stops), every mix of parts."""
    out = []
    for (o, c, e), (pre, post) in itertools.product(itertools.product(_OPEN, _CODE, _CLOSE), _AROUND):
        out.append(f"<think>t</think>\n<code>{pre}{o}{c}{e}{post}</code>")
    # several blocks in one call, a block before the call, text outside
    out += [
        '<code>\n```python\nprint("1")\n```\n```python\nprint("2")\n```\n</code>',
        '```python\nprint("outside")\n```\n<code>\n```python\nprint("in")\n```\n</code>',
        '<code>\n```python\nprint("in")\n```\n<code>\n```python\nprint("nested")\n```\n</code>',
        '<code>\nprint("no fence")\n</code>',
        "</code>",
    ]
    return out


def tool_call_turns() -> list[str]:
    bodies = [
        '{"name": "code_interpreter", "arguments": {"code": "print(1)"}}',
        '{"name": "code_interpreter", "arguments": "{\\"code\\": \\"print(1)\\"}"}',
        '{"arguments": {"code": "print(1)"}}',  # no name
        '{"name": 3, "arguments": {"code": "print(1)"}}',
        '{"name": "code_interpreter", "arguments": {"src": "print(1)"}}',  # the only string argument
        '{"name": "code_interpreter", "arguments": {"a": "x", "b": "y"}}',
        '{"name": "code_interpreter", "arguments": {"code": "  "}}',
        '{"name": "code_interpreter", "arguments": ["print(1)"]}',
        '{"name": "code_interpreter"}',
        '["code_interpreter"]',
        "{not json}",
        "",
        '{"name": "code_interpreter", "arguments": "not json"}',
    ]
    return [f"<tool_call>\n{b}\n</tool_call>" for b in bodies]


CASES = [("code", t) for t in code_turns()] + [("tool_call", t) for t in tool_call_turns()]


@pytest.mark.parametrize("fmt,turn", CASES)
def test_a_block_runs_iff_the_format_check_accepts_it(fmt, turn):
    runs = turn_lib.extract_code(turn, get_turn_format(fmt)).code is not None
    accepted = check_format([turn, FINAL], fmt)
    assert runs == accepted.ok, (runs, accepted.problems)


ANSWERS = [
    "<answer>7</answer>",
    "<answer> 7 </answer>",
    "<answer>\\boxed{7}</answer>",
    "<answer>it is \\boxed{\\frac{1}{2}}</answer>",
    "<answer><answer>7</answer>",
    "<answer>a</answer> <answer>b</answer>",
    "<answer></answer>",
    "<answer>\\boxed{7</answer>",
    "<answer>x<b>7</b></answer>",
]


@pytest.mark.parametrize("text", ANSWERS)
def test_rollout_and_reward_read_one_answer(text):
    assert turn_lib.extract_answer(text) == answers.extract_answer(text)


# --------------------------------------------------------------------------- end to end, on the engine
@pytest.fixture(scope="module")
def engines(model, processor):
    return {fmt: RolloutEngine(model, processor, small_config(max_turns=2, max_turn_tokens=200, max_new_tokens=400,
                                                              turn_format=fmt), SamplingConfig(greedy=True))
            for fmt in ("code", "tool_call")}


def _run(engine, processor, fmt, turns, finals):
    prompts = [rl_prompt(processor, f"p{i}", "How many?", [random_image(i)], fmt) for i in range(len(turns))]
    script = {}
    for i, t in enumerate(turns):
        script[(i, 0)] = t
        script[(i, 1)] = finals[i]
    trajs, _ = engine.rollout(prompts, 1, FakePool(), script=lambda r, m: script.get((r, m)))
    return trajs


# Samples of the generated turns (the engine is slow next to the pure check; every fence variant and
# every tool-call shape is in the pure test above).
E2E = {
    "code": [t for k, t in enumerate(code_turns()) if k % 9 == 0] + code_turns()[-5:],
    "tool_call": tool_call_turns(),
}


@pytest.mark.parametrize("fmt", ["code", "tool_call"])
def test_engine_executes_what_the_format_reward_accepts(engines, processor, fmt):
    turns = E2E[fmt]
    finals = [f"<think>so</think>\n{ANSWERS[k % len(ANSWERS)]}" for k in range(len(turns))]
    trajs = _run(engines[fmt], processor, fmt, turns, finals)
    golds = ["7"] * len(trajs)
    scored = scoring.score(trajs, golds, processor, max_turns=2, turn_format=fmt)
    for k, t in enumerate(trajs):
        executed = t.turns[0]["code"] is not None  # the engine submits exactly the turns with code
        assert t.num_executions == int(executed)
        texts = scoring.assistant_turns(t, processor)
        # the call turn as the engine recorded it, judged beside a well-formed final turn (the final
        # turns here include malformed answers, which the format reward rejects on their own)
        call_ok = check_format([texts[0], FINAL], fmt)
        assert executed == call_ok.ok, (turns[k], call_ok.problems)
        assert bool(scored.fmt_ok[k]) == check_format(texts, fmt).ok
        # the answer scored is the answer the engine recorded, read from the final turn's text
        assert t.answer == turn_lib.extract_answer(texts[-1]), (t.answer, texts[-1])
        assert scored.acc[k] == answers.answer_reward(t.answer, "7")


def test_scoring_reads_the_recorded_turns_not_the_tokens(engines, processor):
    """Each turn is decoded once per step: scoring takes the engine's texts (a record without them,
    as from an older JSONL file, is decoded from its tokens and gives the same result)."""
    trajs = _run(engines["code"], processor, "code", [code_turns()[0]], [FINAL])
    t = trajs[0]
    texts = scoring.assistant_turns(t, processor)
    assert texts == [m["text"] for m in t.turns]

    class NoDecode:
        def decode(self, ids):
            raise AssertionError("scoring decoded a turn the engine had recorded")

    scoring.score(trajs, ["7"], NoDecode(), max_turns=2)  # would raise if it decoded
    for m in t.turns:
        del m["text"]
    assert scoring.assistant_turns(t, processor) == texts
