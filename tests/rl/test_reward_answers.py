"""R_acc: extraction, rule matching, math-verify, and the judge against a local HTTP server."""

import http.server
import json
import threading

import pytest

from codedance_jax.rl.answers import (
    CascadeVerifier,
    JudgeVerifier,
    RuleVerifier,
    accuracy_reward,
    extract_answer,
    numbers_match,
    option_letter,
    parse_judgement,
)


def test_extract_final_answer_and_boxed():
    assert extract_answer("<answer>1</answer> then <answer> 2 </answer>") == "2"
    assert extract_answer(r"<answer>so \boxed{\frac{1}{2}} done</answer>") == r"\frac{1}{2}"
    assert extract_answer(r"<answer>\boxed{a{b}c}</answer>") == "a{b}c"
    assert extract_answer(r"<answer>\boxed{oops</answer>") == r"\boxed{oops"  # unbalanced: raw text
    assert extract_answer("no tags") is None
    assert extract_answer("<answer>unclosed") is None
    assert extract_answer("<answer></answer>") == ""


@pytest.mark.parametrize(
    "pred, gold, want",
    [
        ("1,234", "1234", True),
        ("$45", "45", True),
        ("12 cm", "12", True),
        ("50%", "0.5", True),
        ("50%", "50", True),
        ("0.75", "3/4", True),
        (r"\frac{3}{4}", "0.75", True),
        ("-2", "2", False),
        ("1,2", "12", None),  # not a thousands grouping: not a number
        ("3.0", "3", True),
        ("2.95", "3", False),
    ],
)
def test_numbers(pred, gold, want):
    assert numbers_match(pred, gold) is want


def test_relative_tolerance():
    assert numbers_match("104", "100", rel_tol=0.05) and not numbers_match("106", "100", rel_tol=0.05)
    assert RuleVerifier(rel_tol=0.05)("104", "100") and not RuleVerifier()("104", "100")


def test_options_yes_no_text():
    choices = {"A": "red", "B": "blue", "C": "green"}
    v = RuleVerifier()
    assert option_letter("(B) blue", choices) == "B" and option_letter("blue", choices) == "B"
    assert option_letter("Option C", choices) == "C" and option_letter("purple", choices) is None
    assert v("B", "B", choices=choices) and v("blue", "B", choices=choices)
    assert v("B. blue", "blue", choices=choices)  # gold given as option text
    assert not v("A", "B", choices=choices)
    assert v("Yes, it is.", "yes") and not v("No", "Yes") and v("true", "Yes")
    assert v("The Eiffel Tower!", "eiffel tower") and not v("Big Ben", "eiffel tower")


def test_math_verify_symbolic():
    v = RuleVerifier()
    assert v("x^2+2x+1", "(x+1)^2")
    assert v(r"\sqrt{2}/2", r"\frac{1}{\sqrt{2}}")
    assert not v("x^2", "(x+1)^2")
    assert not RuleVerifier(use_math_verify=False)(r"\sqrt{2}/2", r"\frac{1}{\sqrt{2}}")


def test_words_with_the_same_letters_are_different_answers():
    """math-verify reads a word as the product of its letters; plain words compare as text only."""
    import random

    v = RuleVerifier()
    for a, b in (("listen", "silent"), ("no", "on"), ("ab", "ba"), ("dusty red", "red dusty")):
        assert not v(a, b) and not v(b, a), (a, b)
    word = "".join(random.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(random.randint(3, 9)))
    shuffled = "".join(random.sample(word, len(word)))
    assert v(word, word.upper()) and v(shuffled, word) == (shuffled == word)
    # Symbolic answers still go to math-verify, twice with the same verdict (memoised).
    for _ in range(2):
        assert v("2x", "x*2") and v(r"\frac{1}{2}", "0.5") and not v("2x", "x*3")


def test_accuracy_reward_edge_cases():
    assert accuracy_reward("<think>…</think><answer>42</answer>", "42") == 1.0
    assert accuracy_reward("<answer></answer>", "42") == 0.0  # empty answer
    assert accuracy_reward("<answer>   </answer>", "") == 0.0  # an empty answer never matches
    assert accuracy_reward("42", "42") == 0.0  # no <answer>: nothing to score
    assert accuracy_reward("<answer>" + "4" * 1200 + "</answer>", "4" * 1200, max_answer_chars=1000) == 0.0


class _Judge(http.server.BaseHTTPRequestHandler):
    replies: list = []
    requests: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append((self.path, body, self.headers.get("Authorization")))
        reply = type(self).replies.pop(0)
        if reply is None:
            self.send_response(500)
            self.end_headers()
            return
        data = json.dumps({"choices": [{"message": {"role": "assistant", "content": reply}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def judge_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Judge.replies, _Judge.requests = [], []
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_judge_over_http(judge_server):
    judge = JudgeVerifier(judge_server, model="judge", api_key="k", timeout_s=5)
    _Judge.replies = ["Judgement: 1", "0", None, "Judgement: 1", "maybe", "maybe"]
    assert judge("tan", "The countertop is tan.", question="Is the countertop tan or blue?") is True
    path, body, auth = _Judge.requests[0]
    assert path == "/v1/chat/completions" and body["model"] == "judge" and auth == "Bearer k"
    assert "The countertop is tan." in body["messages"][0]["content"]
    assert judge("blue", "tan") is False
    assert judge("tan", "tan") is True  # a 500 is retried
    assert judge("tan", "tan") is None  # unparseable twice: abstain
    assert judge("", "tan") is False and len(_Judge.requests) == 6  # empty answers never sent


def test_cascade_consults_judge_only_when_rules_fail(judge_server):
    cascade = CascadeVerifier([RuleVerifier(), JudgeVerifier(judge_server, timeout_s=5)])
    _Judge.replies = ["Judgement: 1"]
    assert accuracy_reward("<answer>12</answer>", "12", verifier=cascade) == 1.0
    assert _Judge.requests == []  # the rules sufficed
    assert accuracy_reward("<answer>left side</answer>", "The barrier is on the left.", verifier=cascade) == 1.0
    assert len(_Judge.requests) == 1


def test_judge_unreachable_abstains():
    dead = JudgeVerifier("http://127.0.0.1:9/v1", timeout_s=0.5, retries=1)
    assert dead("a", "b") is None
    assert CascadeVerifier([RuleVerifier(), dead])("a", "b") is False


def test_parse_judgement():
    assert parse_judgement("## Equivalence Judgement\nTRUE") is True
    assert parse_judgement("Judgement: 0") is False
    assert parse_judgement("TRUE or FALSE") is None
