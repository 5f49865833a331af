"""`eval.judge.Judge` through the `openai` client against a real `launch.serve` process: the judge's
verdict is the benchmark's rule applied to what the served model extracts (VLMEvalKit's procedure),
unusable replies are asked again at rising temperature, an unreachable judge abstains."""

import socket
import time

from eval import judge_prompts
from eval.judge import Judge
from eval.scoring import mathvista_post_check

MV_INT = {"question": "Hint: Please answer the question requiring an integer answer.\nQuestion: How many bars?",
          "question_type": "free_form", "answer_type": "integer", "answer": "4"}


def test_mathvista_judge_scores_the_served_extraction(server, client):
    judge = Judge(server.base_url, "codedance", benchmark="MathVista", max_tokens=12, timeout_s=300)
    pred = "I count the bars one by one and there are 4 of them."
    verdict = judge(MV_INT["question"], "4", pred, MV_INT)
    # The same prompt, greedy (the judge's first attempt is at temperature 0), straight from the server.
    prompt = judge_prompts.extraction_prompt("MathVista", MV_INT["question"], pred)
    reply = client.chat.completions.create(model="codedance", messages=[{"role": "user", "content": prompt}],
                                           temperature=0, max_tokens=12).choices[0].message.content
    assert verdict is mathvista_post_check(reply.strip(), MV_INT)
    assert judge.calls == 1  # a non-empty extraction is used as it is


def test_mcq_judge_retries_unusable_replies(server):
    row = {"question": "Which colour?", "answer": "B", "A": "red", "B": "blue", "C": "green", "D": "white"}
    judge = Judge(server.base_url, "codedance", benchmark="WeMath", max_tokens=6, attempts=3, timeout_s=300)
    verdict = judge(row["question"], "B", "a bluish one", row)
    if verdict is None:  # the random model named no option: every attempt was made, then it abstained
        assert judge.calls == 3 and judge.failures == 1
    else:
        assert judge.calls <= 3 and isinstance(verdict, bool)


def test_unreachable_judge_abstains_quickly(monkeypatch):
    monkeypatch.setenv("CODEDANCE_TEST_JUDGE_KEY", "sk-from-env")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    judge = Judge(f"http://127.0.0.1:{port}/v1", "m", benchmark="MathVista", api_key_env="CODEDANCE_TEST_JUDGE_KEY",
                  retries=0, attempts=2, timeout_s=5)
    assert judge.client.api_key == "sk-from-env"
    t0 = time.time()
    assert judge(MV_INT["question"], "4", "4 bars", MV_INT) is None
    assert judge.calls == 2 and judge.failures == 1 and time.time() - t0 < 30

