"""VLMEvalKit's rule scoring, case by case, from reading its code (`vlmeval/utils/matching_util.py`,
`vlmeval/dataset/utils/mathv.py`, `mathvista.py`, `mathverse.py`, `wemath.py`): the multiple-choice
extractor's last step ("answer is X" on the whole reply), MathVision's `is_equal` through
`latex2sympy2_extended`, WeMath's judge-free rule, and the rules that score a judge's extraction."""

import pytest

from eval import rule_score
from eval.matching import can_infer, python_equal
from eval.scoring import mathverse_post_check, mathvision_post_check, mathvista_post_check, wemath_no_judge

OPTS = {"A": "red", "B": "blue", "C": "green", "D": "white"}
MCQ = {"question": "What colour is the cup?", "answer": "B", **OPTS}


@pytest.mark.parametrize(
    "reply, want",
    [
        # Two letters: the token step gives up; the explicit declaration decides.
        ("The answer is B, not C", "B"),
        # One letter, but not in the last five tokens; a long reply, so no option-text step either.
        ("The correct answer is A, because the cup on the left looks blue in this light", "A"),
        # Before the last step existed the option text decided here ("green" -> C): VLMEvalKit says A.
        ("The correct answer is A though green is tempting", "A"),
        ("the answer is b", "B"),  # case-insensitive, upper-cased
        ("answer is **D** since the cup is pale", "D"),  # bold letters
        ("B or C", None),  # no declaration: still the judge's
        ("answer is E, surely, since the cup seems pale here", None),  # the pattern only knows A-D
        ("Failed to obtain answer via API. The answer is B", None),  # API failures are never read
        ("Z", "Z"),  # a lone Z stays VLMEvalKit's "no option" (checked before the pattern)
    ],
)
def test_mcq_last_step_reads_answer_is(reply, want):
    assert can_infer(reply, dict(OPTS)) == want


def test_mcq_last_step_in_rule_scores():
    assert rule_score("VStarBench", "The answer is B, not C", MCQ) is True
    assert rule_score("HRBench4K", "The correct answer is A though green is tempting", MCQ) is False


@pytest.mark.parametrize(
    "reply, answer, want",
    [
        ("Answer: B", "B", True),
        ("B", "B", True),
        ("<Thought process>: the cup is blue <Answer>: <<B>>", "B", True),  # the template WeMath asks for
        ("Answer: C. 5 cm", "C", True),
        ("Answer: A ... on reflection, Answer: C", "C", True),  # the last "Answer" counts
        ("(B)", "B", False),  # first character "(": no letter
        ("The answer is B", "B", False),  # "answer" in lower case is not split on: first character "T"
        ("A triangle has three sides", "A", True),  # ... and a reply starting with the word "A" is option A
        ("answer: b", "B", False),
        (None, "B", False),
    ],
)
def test_wemath_without_a_judge(reply, answer, want):
    assert wemath_no_judge(reply, answer) is want
    assert rule_score("WeMath", reply, {**MCQ, "answer": answer}) is want


def test_wemath_with_a_judge_uses_can_infer():
    assert rule_score("WeMath", "(B)", MCQ, judge=True) is True
    assert rule_score("WeMath", "The answer is B", MCQ, judge=True) is True
    assert rule_score("WeMath", "a long reply that names no option at all, only colours like cyan", MCQ,
                      judge=True) is None


@pytest.mark.parametrize(
    "pred, gold, want",
    [
        ("x+1", "1+x", True),  # sympy: the difference is 0
        ("\\sin(\\pi/6)", "0.5", True),
        ("1,000", "1000", True),  # latex2sympy reads the thousands separator
        ("50\\%", "0.5", True),
        ("e", "2.718281828", True),  # e is Euler's number to latex2sympy
        ("\\frac{1}{3}", "0.333333", True),  # within 1e-6
        ("(1,2)", "(1, 2)", False),  # intervals: the strings differ and |a - b| of intervals fails
        ("5 cm", "5", False),  # 5*c*m
        ("y=2x", "2x", False),
        ("3^2", "1", True),  # Python's eval: ^ is XOR
        ("3^2", "9", True),  # latex2sympy: a power
        ("13", "12", False),
    ],
)
def test_mathvision_is_equal_through_latex2sympy(pred, gold, want):
    assert python_equal(pred, gold) is want
    assert rule_score("MathVision", pred, {"choices": "[]", "answer": gold}) is (True if want else None)


def test_post_checks_score_a_judges_extraction():
    mc = {"question_type": "multi_choice", "answer_type": "text", "choices": "['3/11', '8/11', '6/11', '3/5']",
          "answer": "8/11", "answer_option": "B"}
    assert mathvista_post_check("B", mc) is True and mathvista_post_check("8/11", mc) is True
    assert mathvista_post_check("A", mc) is False
    assert mathvista_post_check(" 14 ", {"question_type": "free_form", "answer_type": "integer", "answer": "14"})
    # 0 is right after extraction (only the prefetch treats a falsy 0 as a miss) ...
    assert mathvista_post_check("0", {"question_type": "free_form", "answer_type": "integer", "answer": "0"})
    assert not mathvista_post_check("1.5", {"question_type": "free_form", "answer_type": "integer", "answer": "1"})
    # ... and text or list answers are never right: VLMEvalKit compares str(None) with them.
    assert not mathvista_post_check("[2007, 2008]", {"question_type": "free_form", "answer_type": "list",
                                                     "answer": "[2007, 2008]"})
    assert mathvision_post_check("\\boxed{0.5}", {"choices": "[]", "answer": "1/2"})
    # `\\boxed\{([^}]*)\}` stops at the first closing brace: "\\frac{1" is compared, and misses.
    assert not mathvision_post_check("\\boxed{\\frac{1}{2}}", {"choices": "[]", "answer": "0.5"})
    assert mathvision_post_check("(C) 3", {"choices": "['1', '2', '3']", "answer": "C"})
    assert not mathvision_post_check("nothing", {"choices": "['1', '2', '3']", "answer": "C"})
    assert mathverse_post_check(" 22.3", "22.3 ") and not mathverse_post_check("22.30", "22.3")
