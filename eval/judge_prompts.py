"""The judge's prompts, one procedure per benchmark, shaped as VLMEvalKit's (read from its code, not copied).

VLMEvalKit does not ask its judge "is this right?". It asks it to *extract* an answer from the
reply, with in-context examples, and then scores the extraction with the same rules it applies
to a prefetched answer. We reproduce that procedure; the wording and the examples below are ours,
written to the same structure (task description, worked examples, then the item):

| benchmark | judge step (VLMEvalKit) | then |
|---|---|---|
| MathVista, MathVision | extract the answer (hint / question / response / "Extracted answer:" examples) | the prefetch rule on the extraction (`scoring.mathvista_post_check`, `mathvision_post_check`) |
| MathVerse | extract the answer (six numbered examples); if it equals the answer string: correct; else a second call judges consistency (0/1) | the judgement |
| WeMath (and the MCQ benchmarks) | match the reply to an option letter (or Z for none) | `can_infer` on the judge's reply == answer |
| CharXiv | grade the reply against the ground truth, JSON `{"extracted_answer", "score"}` | the score |

Where VLMEvalKit falls back to a random option after failed matching, we abstain (None).
"""

from __future__ import annotations

EXTRACT_TASK = (
    "Read the examples below. Each shows a question, a model's response, and the answer extracted from that "
    "response. Then extract the answer from the last model response in the same way and write it after "
    "'Extracted answer:'.\n"
)

# (hint, question, choices or None, response, extraction): the answer kinds the benchmarks ask for.
_MATH_EXAMPLES = (
    ("an integer answer, e.g. 1, 2, 3", "How many circles are left after two are removed?", None,
     "Seven circles were drawn and two are gone, so 5 remain.", "5"),
    ("a floating-point number with one decimal place, e.g. 1.2, 1.3", "What share of the bars are red?", None,
     "Three of the ten bars are red, a share of 0.3 of all bars.", "0.3"),
    ("a floating-point number with two decimal places, e.g. 1.23, 1.34", "What do a pen and a ruler cost together? (Unit: $)",
     None, "The pen costs $1.20 and the ruler $0.75, so together they cost $1.95.", "1.95"),
    ("a Python list, e.g. [1, 2, 3]", "In which two months was rainfall highest?", None,
     "Rainfall peaks in July and August.", "[7, 8]"),
    ("the correct option letter, e.g. A, B, C, D", "Which angle is largest?", "(A) 30° (B) 45° (C) 120° (D) 60°",
     "The obtuse angle, (C) 120°, is the largest.", "C"),
)


def _math_examples(hint_style: str) -> str:
    out = []
    for hint, q, choices, resp, ext in _MATH_EXAMPLES:
        h = f"Please answer the question requiring {hint}, and give the final value at the end." if hint_style == "typed" \
            else "Please answer the question and give the final answer at the end."
        if "option letter" in hint:
            h = "Please answer the question and give the correct option letter, e.g. A, B, C, D, at the end."
        block = f"Hint: {h}\nQuestion: {q}\n"
        if choices:
            block += f"Choices: {choices}\n"
        out.append(block + f"Model response: {resp}\nExtracted answer: {ext}\n")
    return "\n".join(out)


def extraction_prompt(benchmark: str, question: str, prediction: str) -> str:
    """MathVista / MathVision: examples, then the item's full question (hint and choices included)."""
    style = "typed" if benchmark == "MathVista" else "plain"
    return f"{EXTRACT_TASK}\n{_math_examples(style)}\n{question}\nModel response: {prediction}\nExtracted answer:"


_MATHVERSE_EXTRACT = (
    ("The vertex of the parabola is therefore at\n\n(3, -2)", "(3, -2)"),
    ("Comparing the graphs, the option that describes where they meet is:\n\nB. The solutions of f(x) = g(x).", "B"),
    ("Final values:\nDomain: [-2, 4)\nRange: (0, 5]", "Domain: [-2, 4)\nRange: (0, 5]"),
    ("The figure does not give enough information to find the angle, so I cannot choose an option.", "null"),
    ("With AB = 12 m and the angle at 30°, the height is 12·tan(30°), about 6.9 m.", "6.9"),
    ("So the line through both points is y = 2x - 3.", "y = 2x - 3"),
)


def mathverse_extract_prompt(prediction: str) -> str:
    head = ("You are given the response of a model to a math problem ('Model response'). Extract the model's final "
            "answer from it ('Extracted answer'). Output only the extracted answer, without explanation.\n\n")
    body = "".join(f"{k}.\nModel response: '{r}'\nExtracted answer: {e}\n\n" for k, (r, e) in
                   enumerate(_MATHVERSE_EXTRACT, 1))
    return f"{head}{body}{len(_MATHVERSE_EXTRACT) + 1}.\nModel response: '{prediction}'\nExtracted answer: "


_MATHVERSE_SCORE = (
    ("Give the solution set of the inequality shown on the number line.", "[1, 5)", "(1, 5)", 0),
    ("In the circle, angle AOB = 80°; find angle ACB.\nChoices:\nA:40°\nB:80°\nC:100°\nD:160°", "A", "B:80°", 0),
    ("What is the slope of the line?", "-1/2", "-0.5", 1),
    ("In the circle, angle AOB = 80°; find angle ACB.\nChoices:\nA:40°\nB:80°\nC:100°\nD:160°", "A", "null", 0),
)


def mathverse_score_prompt(question: str, answer: str, extraction: str) -> str:
    head = ("Two answers to a math question follow: [Standard Answer] is the reference and [Model_answer] was "
            "extracted from a model's output. Decide whether they are consistent. For multiple choice they are "
            "consistent only when the model's answer is exactly the reference option; otherwise they are consistent "
            "when they state the same value, even in other units or notation (0.5 m and 50 cm). Answer with 1 if "
            "consistent, 0 if not.\n\n")
    body = "".join(f"[Question]: {q}\n[Standard Answer]: {a}\n[Model_answer] : {m}\nJudgement: {j}\n\n"
                   for q, a, m, j in _MATHVERSE_SCORE)
    return f"{head}{body}[Question]: {question}\n[Standard Answer]: {answer}\n[Model_answer] : {extraction}\nJudgement:"


def option_match_prompt(question: str, options: dict, prediction: str) -> str:
    """Map a free reply onto an option letter (VLMEvalKit's MCQ matcher, WeMath's variant included)."""
    letters = ", ".join(options)
    opts = " ".join(f"{k}. {v}" for k, v in options.items())
    return (
        "You match a model's answer to the options of a single-choice question. Given the question, the options and "
        "the answer, output the letter of the option closest in meaning to the answer, or Z when no option is "
        f"close. Output one uppercase character among {letters} and Z.\n"
        "Example 1:\nQuestion: Which animal is shown?\nOptions: A. horse B. zebra C. donkey D. cow\n"
        "Answer: a striped zebra grazing\nYour output: B\n"
        "Example 2:\nQuestion: Which animal is shown?\nOptions: A. horse B. zebra C. donkey D. cow\n"
        "Answer: a parrot\nYour output: Z\n"
        f"Example 3:\nQuestion: {question}\nOptions: {opts}\nAnswer: {prediction}\nYour output: "
    )


def charxiv_prompt(question: str, answer: str, prediction: str) -> str:
    return (
        "You grade a model's reply to a question about a scientific chart. First extract the model's final answer "
        "from the reply, then compare it with the ground truth: score 1 if it is the same answer (numbers may "
        "differ only by formatting or the precision the question asks for; lists must hold the same items), else 0. "
        'Reply with JSON only: {"extracted_answer": "...", "score": 0 or 1}.\n\n'
        f"Question: {question}\nGround truth: {answer}\nModel reply: {prediction}\n"
    )
