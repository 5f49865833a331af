"""R_format on hand-written responses in both turn formats."""

import pytest

from codedance_jax.rl.format import CODE_FORMAT, TOOL_CALL_FORMAT, check_format, format_ok, split_turns

CODE = "<code>\n```python\nprint(1)\n```\n</code>"
CALL = '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(1)"}}\n</tool_call>'
OBS_CODE = "<|im_end|>\n<|im_start|>user\n<interpreter>\n1\n</interpreter><|im_end|>\n<|im_start|>assistant\n"
OBS_CALL = "<|im_end|>\n<|im_start|>user\n<tool_response>\n1\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_good_multi_turn_code_format():
    text = f"<think>crop it</think>{CODE}{OBS_CODE}<think>ok</think><answer>1</answer><|im_end|>"
    assert split_turns(text, CODE_FORMAT)[1].startswith("<think>ok")
    r = check_format(text, "code")
    assert r.ok, r.problems


def test_good_tool_call_format_and_no_tool_answer():
    text = f"<think>x</think>{CALL}{OBS_CALL}<answer>B</answer>"
    assert format_ok(text, TOOL_CALL_FORMAT)
    assert format_ok("<think>easy</think><answer>4</answer>\n", CODE_FORMAT)  # no tool calls at all


@pytest.mark.parametrize(
    "text, problem",
    [
        ("<answer>1</answer><answer>2</answer>", "exactly one"),
        ("no answer here", "exactly one"),
        ("<answer>1</answer> and more text", "text after </answer>"),
        ("<answer>  </answer>", "empty answer"),
        ("<think>a<answer>1</answer>", "think"),
        ("<code>\n```python\nprint(1)\n```\n<answer>1</answer>", "unclosed"),
        (f"{CODE}<answer>1</answer>", "never executed"),  # code with no observation: never ran
        ("<code>print(1)</code>" + OBS_CODE + "<answer>1</answer>", "fenced"),
        (f"{CODE} trailing words{OBS_CODE}<answer>1</answer>", "text after the code block"),
        (f"<answer>1</answer>{CODE}{OBS_CODE}done", "answer before the last turn"),
    ],
)
def test_malformed_code_format(text, problem):
    r = check_format(text, CODE_FORMAT)
    assert not r.ok
    assert any(problem in p for p in r.problems), r.problems


def test_malformed_tool_call_json_and_segments_input():
    bad = "<tool_call>{name: oops}</tool_call>"
    r = check_format([bad, "<answer>1</answer>"], TOOL_CALL_FORMAT)
    assert not r.ok and any("JSON" in p for p in r.problems)
    # The paper's tags are plain text under the release format: not a call, but the answer is fine.
    assert check_format(["<answer>1</answer>"], TOOL_CALL_FORMAT).ok
    with pytest.raises(ValueError, match="turn format"):
        check_format("x", "xml")
