"""Each rule filter's reason on a constructed trajectory."""

import pytest

from configs.curate import get_config
from runs.curate import filters

CFG = get_config("endpoints").filters


def row(final="<answer>4</answer>", first="<think>t</think>", status=("ok",), answer="4"):
    msgs = [{"role": "user", "content": "<image>Q"}, {"role": "assistant", "content": first},
            {"role": "observation", "content": "out", "num_images": 0}, {"role": "assistant", "content": final}]
    return {"question": "How many?", "answer": answer, "messages": msgs, "cell_status": list(status)}


@pytest.mark.parametrize("r, reason", [
    (row(), None),
    (row(final="I think 4"), "no_answer"),
    (row(final="<answer>5</answer>"), "answer_mismatch"),
    (row(first="the box is [10, 10, 900, 20]"), "bad_box"),  # outside a 100 x 100 image
    (row(first="the box is [10, 10, 11, 11]"), "bad_box"),  # 1e-4 of the area: implausibly small
    (row(first="bbox_2d: [0, 0, 100, 100]"), "bad_box"),  # the whole image: implausibly large
    (row(first="the box is [10, 10, 40, 40]"), None),
    (row(status=("error",)), "unrecovered_error"),
    (row(status=("ok", "error")), "unrecovered_error"),
    (row(status=("error", "ok")), None),
    (row(first="x" * (CFG.max_turn_chars + 1)), "too_long"),
    (row(status=("ok",) * (CFG.max_cells + 1)), "too_long"),
])
def test_rule_reason(r, reason):
    assert filters.rule_reason(r, CFG, (100, 100)) == reason
