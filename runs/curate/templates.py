"""The prompt templates of the paper's SFT data synthesis (appendix 7.2, Tables 5-9), as data.

Written from the paper's text (`../shared/paper/`, section 7.2); `{question}`, `{correct_answer}`
and `{original_response}` are filled with `str.format`. Where the paper's table is cut short
(Table 9 ends after "Details: 1."), the rest of the instruction is ours and marked below.

- `INFORMATIVENESS` (Table 5): is the image rich enough for fine-grained questions? "True"/"False".
- `BBOX` (Table 6): the box of the object that best matches the question, as JSON `bbox_2d`: the
  start of a grounding (crop) trajectory (`grounding.py`, `config.synthesize.grounding`).
- `QA_VALIDATION` (Table 7): is the gold answer correct and the question non-trivial? "GOOD"/"BAD".
- `STEP_BY_STEP` (Table 8): solve step by step, answer in `<answer>` tags (weak-model pass@k and
  the text-only thinking a medium item's code trajectory revises).
- `REVISE_WITH_CODE` (Table 9): rewrite a thinking process with `<code>` snippets whose results come
  back in `<interpreter>` (medium items: single turn, every snippet's output imagined by the teacher
  and replaced by the sandbox's real output).
- `MULTI_TURN` (ours, built from Table 9's wording): hard items, one snippet per turn, the real
  interpreter output is sent back before the teacher goes on.
- `GROUNDING_FEEDBACK` (ours): hard grounding items (`grounding.py`): after the teacher's Table 6
  box, the real crop is sent back with this and the teacher answers having seen it.
- `CROSS_VALIDATION` (ours, modelled on Table 7): the strong verifier's GOOD/BAD on a finished
  trajectory (the paper says each trajectory is cross-validated by a stronger MLLM, without a table).
"""

from __future__ import annotations

INFORMATIVENESS = """You are an expert vision-language analyst.
Task
1. Observe the entire image.
2. Decide whether the picture meets all Four conditions below:
A. Diversity - Contains >= 4 different object categories or >= 6 individual objects.
B. Distinguishability - Includes at least one object that is mostly un-occluded, covers < 30% of the image area, \
and is not repeated by many visually identical copies.
C. Zoom-in Benefit - For that object (or another), some informative fine-grained detail (e.g., printed text, small \
logo, numerical value, subtle texture, or facial expression) would become noticeably clearer if the region were \
enlarged. In other words, a close-up view would materially help a downstream model answer a question about that \
object.
D. Is it suitable to come up with some VQA questions that require fine-grained understanding?
3. If all A, B, C, D are satisfied, Please respond with "True" or "False"."""

BBOX = """Please detect the entire object that most matches the question in the image.
Question: {question}
If the target is part of an object, you need to give the bbox of the entire object.
For each object, return:
- 'label': the object name
- 'bbox_2d': the object's bounding box coordinates as [x1, y1, x2, y2].
Respond in a JSON array, where each entry is a dictionary with 'label' and 'bbox_2d'."""

QA_VALIDATION = """You are a quality control assistant. Your task is to evaluate a visual question based on the \
provided image, question, and correct answer.
Image: [Image is attached]
Question: {question}
Provided Correct Answer: {correct_answer}
Evaluation Criteria:
1. Correctness: Is the provided "Correct Answer" truly the correct answer based on the image?
2. Difficulty: Is the question non-trivial? It should require careful observation of details and not be something \
overly simple or obvious (e.g., "What color is the sky?").
Your Response:
Respond with "GOOD" if the question meets BOTH criteria.
Respond with "BAD" if the question fails one or both criteria. Do not provide any other explanation or text."""

STEP_BY_STEP = """Solve the following problem step by step and then provide the final answer.
The final answer MUST BE enclosed within <answer> </answer> tags.
Question: {question}"""

_CODE_INTRO = """You are a helpful AI assistant. Initially, when solving a question, you would need to think step \
by step, without the ability to use code for calculation. Now, you have the capability to write code to use the \
code interpreter for calculation. The code will be executed by a sandbox, and the result can be returned to enhance \
your reasoning process. You can now leverage code to enhance your calculation while still maintaining the reasoning \
process.
The thinking process can have multiple code snippets. Each code snippet is wrapped with
<code>
```python
code snippet
```
</code>
The returned result is wrapped with
<interpreter> execution results</interpreter>"""

REVISE_WITH_CODE = _CODE_INTRO + """
Goal: Modify the original thinking process to make it more accurate by replacing manual calculation steps that can \
benefit from code execution with the corresponding code snippets and their interpreter's execution results. The core \
reasoning logic from the original thinking process, including any unsuccessful attempts, should remain unchanged. \
You should only replace the necessary manual calculation steps with code and interpreter's execution results, \
without altering the rest tokens of the thinking process.
User Question: {question}
Original Thinking Process (without code interpreter's support):
<original_thinking_process> {original_response} </original_thinking_process>
Details:
1. Identify sections where code execution could speed up the reasoning process or make the calculation more \
accurate. For simple calculations, you should keep the original text-based reasoning process without executing any \
code.
2. The image of the question is the file 'image.png' in the working directory; images you show or save are returned.
3. End with the final answer enclosed within <answer> </answer> tags."""
# Details 2-3 are ours: the paper's Table 9 is cut after item 1.

MULTI_TURN = _CODE_INTRO + """
Solve the question below. Write at most one code snippet per turn and stop after </code>: the snippet is run and \
its real result (text, and the images it shows or saves) is sent back to you inside <interpreter></interpreter>. \
If the code fails, read the error and fix it. The image of the question is the file 'image.png' in the working \
directory. End with the final answer enclosed within <answer> </answer> tags.
User Question: {question}"""

GROUNDING_FEEDBACK = """<interpreter>
{observation}
</interpreter>
Above is the real result of cropping the image to the box you gave, enlarged (the image after this text). Look at \
the crop and solve the question step by step. If the crop does not show the object, say so and use the full image.
The final answer MUST BE enclosed within <answer> </answer> tags.
Question: {question}"""

CROSS_VALIDATION = """You are a quality control assistant. Your task is to evaluate a reasoning trajectory that \
answers a visual question, including the code it ran and the interpreter's real results.
Image: [Image is attached]
Question: {question}
Provided Correct Answer: {correct_answer}
Trajectory:
{trajectory}
Evaluation Criteria:
1. Correctness: Does the trajectory reach the provided correct answer through reasoning that is consistent with the \
image and with the interpreter's results?
2. Usefulness: Does every code snippet serve the reasoning (no pointless or spammed tool calls)?
Respond with "GOOD" if the trajectory meets BOTH criteria.
Respond with "BAD" if it fails one or both criteria. Do not provide any other explanation or text."""

TEMPLATES = {
    "informativeness": INFORMATIVENESS,  # Table 5
    "bbox": BBOX,  # Table 6
    "qa_validation": QA_VALIDATION,  # Table 7
    "step_by_step": STEP_BY_STEP,  # Table 8
    "revise_with_code": REVISE_WITH_CODE,  # Table 9
    "multi_turn": MULTI_TURN,  # ours, from Table 9
    "grounding_feedback": GROUNDING_FEEDBACK,  # ours: hard grounding items, after the Table 6 box
    "cross_validation": CROSS_VALIDATION,  # ours, from Table 7
}
