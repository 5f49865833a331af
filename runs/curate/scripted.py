"""A scripted OpenAI-compatible endpoint for the toy world: a STAND-IN for a real teacher, judge
and verifier (a 72B model cannot run on this machine). It is a real HTTP server on 127.0.0.1
(`/v1/models`, `/v1/chat/completions`, the `stop` parameter honoured), so the pipeline talks to it
exactly as it would to vLLM, an API, or `launch.serve`.

It knows the toy items it was given (looked up by the SHA-256 of the first image's PNG bytes, i.e.
it "sees" the image) and answers by the template it recognises in the prompt, like a strong model
would, with deliberate faults at fixed per-item rates so that every filter has something to drop
(each fault is decided by a hash of the item id and the fault's name, so runs are reproducible):

- Table 5 informativeness: "True" ("False" at `uninformative_rate`);
- Table 7 QA validation: "GOOD" iff the provided answer is the item's true answer;
- Table 8 step by step: a short thinking text and the true answer (model `*-weak`: the weak
  persona of the tests: easy items always right, hard `find` items right on odd samples, others wrong);
- Table 9 revise with code: the toy expert's code (`data.toyworld.expert_code`) followed by a
  deliberately WRONG imagined `<interpreter>` output (`count: 999`, ...) that the splice must replace,
  then the answer (wrong at `wrong_rate`; a box outside the image at `bad_box_rate` for `find`);
- multi-turn: first a buggy cell at `bug_rate` (a NameError), then the correct cell after the error
  comes back, then the answer; at `unrecovered_rate` it answers right after the error instead;
- Table 6 bbox (grounding items): the item's marked box as a JSON `bbox_2d` (outside the image at
  `bad_box_rate`; `[]` for items without a box), then, once the real crop comes back as an image,
  the answer (wrong at `wrong_rate`; no answer when the feedback holds no image);
- cross-validation: "GOOD" iff the trajectory's last `<answer>` is true ("BAD" at `verifier_bad_rate`).
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import hashlib
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from data.toyworld.expert import buggy_code, expert_code, png_bytes
from data.toyworld.tasks import PALETTE

IMAGINED = {"count": "count: 999", "bars": "tallest: purple 999", "find": "box: 0 0 999 999"}


@dataclasses.dataclass
class Faults:
    uninformative_rate: float = 0.0
    wrong_rate: float = 0.0
    bad_box_rate: float = 0.0
    bug_rate: float = 0.0
    unrecovered_rate: float = 0.0
    verifier_bad_rate: float = 0.0


def chance(item_id: str, what: str) -> float:
    return int(hashlib.sha256(f"{item_id}/{what}".encode()).hexdigest()[:8], 16) / 2**32


def wrong_answer(answer: str) -> str:
    if answer.isdigit():
        return str(int(answer) + 1)
    return next(c for c in PALETTE if c != answer)


def _texts(message: dict) -> str:
    c = message.get("content")
    if isinstance(c, str):
        return c
    return "\n".join(p.get("text", "") for p in c or [] if p.get("type") == "text")


def _first_image(messages: list[dict]) -> bytes | None:
    for m in messages:
        for p in m.get("content") if isinstance(m.get("content"), list) else []:
            if p.get("type") == "image_url":
                url = p["image_url"]["url"]
                return base64.b64decode(url.partition(",")[2])
    return None


class ScriptedModel:
    """The answers (no HTTP); `reply(model, messages, sample) -> text`."""

    def __init__(self, items, faults: Faults | None = None):
        self.items = {hashlib.sha256(png_bytes(it.image)).hexdigest(): it for it in items}
        self.f = faults or Faults()

    def reply(self, model: str, messages: list[dict], sample: int = 0) -> str:
        png = _first_image(messages)
        item = self.items.get(hashlib.sha256(png).hexdigest()) if png else None
        prompt = _texts(messages[0])
        if item is None:
            return "I cannot see an image I know."
        iid, f = item.id, self.f
        if "expert vision-language analyst" in prompt:
            return "False" if chance(iid, "uninformative") < f.uninformative_rate else "True"
        if "evaluate a visual question" in prompt:
            m = re.search(r"Provided Correct Answer: (.*)", prompt)
            return "GOOD" if m and m.group(1).strip() == item.answer else "BAD"
        if "evaluate a reasoning trajectory" in prompt:
            answers = re.findall(r"<answer>(.*?)</answer>", prompt, re.S)
            good = bool(answers) and answers[-1].strip() == item.answer
            return "GOOD" if good and chance(iid, "verifier") >= f.verifier_bad_rate else "BAD"
        if "Solve the following problem step by step" in prompt:
            if model.endswith("-weak"):
                right = item.difficulty == "easy" or (item.family == "find" and sample % 2 == 1)
                return f"<think>I look at the image.</think>\n<answer>{item.answer if right else wrong_answer(item.answer)}"\
                       "</answer>"
            return f"<think>Looking closely at the image, the answer is {item.answer}.</think>\n" \
                   f"<answer>{item.answer}</answer>"
        answer = wrong_answer(item.answer) if chance(iid, "wrong") < f.wrong_rate else item.answer
        box = ""
        if item.family == "find" and "box" in item.meta:
            b = list(item.meta["box"])
            if chance(iid, "bad_box") < f.bad_box_rate:
                b = [b[0], b[1], b[2] + 10 * item.image.size[0], b[3]]
            box = f" The marked box is at [{b[0]}, {b[1]}, {b[2]}, {b[3]}]."
        if "detect the entire object that most matches the question" in prompt:  # Table 6, then its feedback
            if not any(m["role"] == "assistant" for m in messages):
                if not box:
                    return "[]"
                return "```json\n" + json.dumps([{"label": "marked box", "bbox_2d": b}]) + "\n```"
            if not any(p.get("type") == "image_url" for p in messages[-1].get("content") or []
                       if isinstance(p, dict)):
                return "<think>No crop came back, I cannot see the box.</think>"  # no answer: dropped
            return f"<think>The enlarged crop shows the shape inside the box clearly.</think>\n<answer>{answer}</answer>"
        code = expert_code(item).rstrip()
        if "Modify the original thinking process" in prompt:
            return (f"<think>I will compute this with code instead of by eye.{box}</think>\n<code>\n```python\n{code}\n"
                    f"```\n</code>\n<interpreter>\n{IMAGINED[item.family]}\n</interpreter>\n"
                    f"<think>The code confirms the answer.</think>\n<answer>{answer}</answer>")
        if "at most one code snippet per turn" in prompt:
            turns = sum(1 for m in messages if m["role"] == "assistant")
            last = _texts(messages[-1]) if turns else ""
            bug = chance(iid, "bug") < f.bug_rate
            if turns == 0:
                first = buggy_code(item, "name").rstrip() if bug else code
                return f"<think>This needs exact measurement, so I will use code.{box}</think>\n<code>\n```python\n" \
                       f"{first}\n```\n</code>\n<interpreter>\n{IMAGINED[item.family]}\n</interpreter>"
            if "[status: error]" in last and chance(iid, "unrecovered") >= f.unrecovered_rate:
                return f"<think>The code failed; I fix the name and run it again.</think>\n<code>\n```python\n{code}" \
                       "\n```\n</code>"
            return f"<think>The interpreter output gives the answer.</think>\n<answer>{answer}</answer>"
        return "I do not recognise this prompt."


class ScriptedServer:
    """`ScriptedModel` behind a real HTTP server on 127.0.0.1 (a free port unless given).

    `delay_s` makes each reply slow (the kill-and-resume test); `requests` counts chat calls."""

    def __init__(self, model: ScriptedModel, port: int = 0, delay_s: float = 0.0, names=("scripted",)):
        self.model, self.delay_s, self.requests, self.names = model, delay_s, 0, names
        self.live = self.peak = 0  # requests in flight now / at most (the concurrency test reads it)
        self.bodies: collections.Counter = collections.Counter()  # sha256 of each request body -> times asked
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, code: int, obj: dict) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path.rstrip("/").endswith("/models"):
                    self._send(200, {"object": "list", "data": [{"id": n, "object": "model"} for n in outer.names]})
                else:
                    self._send(404, {"error": {"message": "not found"}})

            def do_POST(self):
                if not self.path.rstrip("/").endswith("/chat/completions"):
                    return self._send(404, {"error": {"message": "not found"}})
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                req = json.loads(raw)
                with outer.lock:
                    outer.requests += 1
                    outer.bodies[hashlib.sha256(raw).hexdigest()] += 1
                    outer.live += 1
                    outer.peak = max(outer.peak, outer.live)
                try:
                    if outer.delay_s:
                        time.sleep(outer.delay_s)
                    text = outer.model.reply(req.get("model", ""), req["messages"], int(req.get("seed") or 0))
                finally:
                    with outer.lock:
                        outer.live -= 1
                finish = "stop"
                for s in req.get("stop") or []:
                    if s in text:
                        text = text[: text.index(s)]  # OpenAI semantics: the stop string is not returned
                self._send(200, {"id": "scripted", "object": "chat.completion", "created": int(time.time()),
                                 "model": req.get("model", ""),
                                 "choices": [{"index": 0, "finish_reason": finish,
                                              "message": {"role": "assistant", "content": text}}],
                                 "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
