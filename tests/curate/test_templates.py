"""The prompt templates of Tables 5-9 are data: placeholders fill, the paper's key sentences are there."""

import string

from runs.curate import templates


def fields(t):
    return {f for _, f, _, _ in string.Formatter().parse(t) if f}


def test_placeholders():
    assert fields(templates.INFORMATIVENESS) == set()
    assert fields(templates.BBOX) == {"question"}
    assert fields(templates.QA_VALIDATION) == {"question", "correct_answer"}
    assert fields(templates.STEP_BY_STEP) == {"question"}
    assert fields(templates.REVISE_WITH_CODE) == {"question", "original_response"}
    assert fields(templates.MULTI_TURN) == {"question"}
    assert fields(templates.CROSS_VALIDATION) == {"question", "correct_answer", "trajectory"}


def test_paper_wording():
    assert 'respond with "True" or "False"' in templates.INFORMATIVENESS
    assert "bbox_2d" in templates.BBOX
    assert 'Respond with "GOOD"' in templates.QA_VALIDATION
    assert "<answer> </answer>" in templates.STEP_BY_STEP
    q = templates.REVISE_WITH_CODE.format(question="Q?", original_response="I think 4.")
    assert "<original_thinking_process> I think 4. </original_thinking_process>" in q and "User Question: Q?" in q
    assert "<interpreter> execution results</interpreter>" in q
