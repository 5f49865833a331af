"""The curation stages (paper section 3.2 and appendix 7.1), one function per item each.

Every function takes an item row and returns it with the stage's fields, plus `"drop": reason`
when the stage removes it (`stagefile.run_stage` writes, resumes and counts). Item rows:
`{"id", "question", "answer", "image": "img/ID.png" (relative to the workdir), "meta": {...}}`.

- `validate` (Table 5, Table 7; judge): drops `uninformative` (Table 5 says False), `qa_bad`
  (Table 7 says BAD), `judge_unparsed` (neither word).
- `stratify` (Table 8; weak model): `k` samples; `pass_rate` = correct / k. `trivial` when
  pass_rate >= `trivial_rate`, `medium` when >= `medium_rate`, else `hard`. Trivial items are
  dropped (`trivial`) or kept for a direct answer, by `trivial` = "drop" | "direct".
- `synthesize` (Tables 6, 8, 9, ours; teacher, sandbox): trivial -> a direct answer (the weak
  model's first correct reply: the paper's "answer directly" for easy questions); medium ->
  Table 8 thinking, revised with code by Table 9 in one reply, spliced (`splice.splice`); hard ->
  multi-turn, one cell per turn, the real output sent back (`MULTI_TURN`), at most `max_turns`.
  Items that need localisation (`synthesize.grounding`, `grounding.py`) instead get the Table 6
  box, a crop cell and the answer (medium: single turn with the Table 8 reply; hard: the real
  crop sent back first); drops `no_box` when the reply holds no box.
  Every cell of an item runs in order in one sandbox session holding `image.png`.
- `rule_filter` (`filters.rule_reason`): drops by rule; first `malformed` for a record the SFT
  format rejects (`data.trajectory.parse_record`, e.g. a reply holding `<|im_end|>`).
- `cross_validate` (ours, from Table 7; verifier): drops `verifier_bad`, `verifier_unparsed`.
"""

from __future__ import annotations

import dataclasses
import io
import os
from typing import Any

from PIL import Image

from codedance_jax.protocol import rl_question
from codedance_jax.rl.answers import accuracy_reward
from data.trajectory import RecordError, parse_record
from runs.curate import filters, grounding, splice, templates
from runs.curate.endpoints import Endpoint, ask, image_part


@dataclasses.dataclass
class Context:
    workdir: str
    cfg: Any  # the `curate` ConfigDict
    judge: Endpoint | None = None
    weak: Endpoint | None = None
    teacher: Endpoint | None = None
    verifier: Endpoint | None = None
    pool: Any = None  # sandbox.SandboxPool

    def image(self, rel: str) -> bytes:
        with open(os.path.join(self.workdir, rel), "rb") as f:
            return f.read()

    def save_image(self, rel: str, png: bytes) -> None:
        path = os.path.join(self.workdir, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(png)


def _word(reply: str, yes: str, no: str) -> bool | None:
    r = reply.strip().strip('."\'').lower()
    if r.startswith(yes.lower()) or (yes.lower() in r and no.lower() not in r):
        return True
    if r.startswith(no.lower()) or no.lower() in r:
        return False
    return None


def validate(ctx: Context, row: dict) -> dict:
    c, png = ctx.cfg.validate, ctx.image(row["image"])
    out = dict(row)
    if c.informativeness:
        v = _word(ask(ctx.judge, templates.INFORMATIVENESS, [png], max_tokens=c.max_tokens), "true", "false")
        if v is not True:
            return {**out, "drop": "uninformative" if v is False else "judge_unparsed"}
    if c.qa:
        prompt = templates.QA_VALIDATION.format(question=row["question"], correct_answer=row["answer"])
        v = _word(ask(ctx.judge, prompt, [png], max_tokens=c.max_tokens), "good", "bad")
        if v is not True:
            return {**out, "drop": "qa_bad" if v is False else "judge_unparsed"}
    return out


def difficulty(pass_rate: float, c) -> str:
    if pass_rate >= c.trivial_rate:
        return "trivial"
    return "medium" if pass_rate >= c.medium_rate else "hard"


def stratify(ctx: Context, row: dict) -> dict:
    c, png = ctx.cfg.stratify, ctx.image(row["image"])
    prompt = templates.STEP_BY_STEP.format(question=row["question"])
    replies = [ask(ctx.weak, prompt, [png], temperature=c.temperature, max_tokens=c.max_tokens, sample=s + 1)
               for s in range(c.k)]
    correct = [r for r in replies if accuracy_reward(r, row["answer"], question=row["question"]) == 1.0]
    rate = len(correct) / c.k
    d = difficulty(rate, c)
    out = {**row, "difficulty": d, "pass_rate": rate, "direct": correct[0] if correct else None}
    if d == "trivial" and c.trivial == "drop":
        out["drop"] = "trivial"
    return out


def _user(row: dict) -> dict:
    """The SFT user turn: exactly the RL prompt's (`protocol.rl_question`), so SFT and RL agree."""
    return {"role": "user", "content": "<image>" + rl_question(row["question"], "code")}


def _record(ctx: Context, row: dict, messages: list[dict], cells: list[splice.Cell], **extra) -> dict:
    images = [row["image"]]
    for cell in cells:
        for png in cell.images:
            rel = f"img/{row['id']}-obs{len(images)}.png"
            ctx.save_image(rel, png)
            images.append(rel)
    return {**row, "messages": [_user(row), *messages], "images": images,
            "cell_status": [c.status for c in cells], **extra}


def synthesize(ctx: Context, row: dict) -> dict:
    c, png = ctx.cfg.synthesize, ctx.image(row["image"])
    if row["difficulty"] == "trivial":
        return _record(ctx, row, [{"role": "assistant", "content": row["direct"].strip()}], [], mode="direct")
    if grounding.wanted(row, c.grounding):
        return _synthesize_grounding(ctx, row, png)
    with ctx.pool.new_session(files={"image.png": png}) as session:
        if row["difficulty"] == "medium":
            thinking = ask(ctx.teacher, templates.STEP_BY_STEP.format(question=row["question"]), [png],
                           max_tokens=c.max_tokens)
            prompt = templates.REVISE_WITH_CODE.format(question=row["question"], original_response=thinking)
            reply = ask(ctx.teacher, prompt, [png], max_tokens=c.max_tokens)
            messages, cells, replaced = splice.splice(reply, session, c.max_images)
            return _record(ctx, row, messages, cells, mode="single_turn", replaced=replaced)
        chat = [{"role": "user", "content": [image_part(png),
                                             {"type": "text", "text": templates.MULTI_TURN.format(
                                                 question=row["question"])}]}]
        messages, cells = [], []
        for _ in range(c.max_turns):
            reply = ctx.teacher.chat(chat, max_tokens=c.max_tokens, stop=["</code>"])
            turn, code = splice.code_of_turn(reply)
            messages.append({"role": "assistant", "content": turn})
            if code is None:
                break
            cell = splice.run_cell(session, code, c.max_images)
            cells.append(cell)
            messages.append(splice.observation(cell))
            chat.append({"role": "assistant", "content": turn})
            chat.append({"role": "user", "content": [{"type": "text", "text": f"<interpreter>\n{cell.text}\n"
                                                      "</interpreter>"}] + [image_part(p) for p in cell.images]})
        if messages[-1]["role"] != "assistant":
            # Out of turns after a cell: the trajectory ends unanswered (dropped as no_answer).
            messages.append({"role": "assistant", "content": ""})
        return _record(ctx, row, messages, cells, mode="multi_turn")


def _synthesize_grounding(ctx: Context, row: dict, png: bytes) -> dict:
    """Table 6 box -> crop cell in the sandbox -> answer (single turn for medium, with the real crop
    sent back for hard); see `grounding.py`."""
    c = ctx.cfg.synthesize
    g = c.grounding
    bbox_chat = [{"role": "user", "content": [image_part(png), {"type": "text", "text": templates.BBOX.format(
        question=row["question"])}]}]
    reply = ctx.teacher.chat(bbox_chat, max_tokens=g.max_tokens)
    found = grounding.parse_boxes(reply)
    if not found:
        return {**row, "drop": "no_box", "bbox_reply": reply}
    label, box = found[0]
    turn, code = grounding.code_turn(label, box, g.zoom_px)
    with ctx.pool.new_session(files={"image.png": png}) as session:
        cell = splice.run_cell(session, code, c.max_images)
    if row["difficulty"] == "medium":
        answer = ask(ctx.teacher, templates.STEP_BY_STEP.format(question=row["question"]), [png],
                     max_tokens=c.max_tokens)
        mode = "grounding_single_turn"
    else:
        feedback = templates.GROUNDING_FEEDBACK.format(observation=cell.text, question=row["question"])
        chat = bbox_chat + [{"role": "assistant", "content": reply},
                            {"role": "user", "content": [{"type": "text", "text": feedback}]
                             + [image_part(p) for p in cell.images]}]
        answer = ctx.teacher.chat(chat, max_tokens=c.max_tokens)
        mode = "grounding_multi_turn"
    messages = [{"role": "assistant", "content": turn}, splice.observation(cell),
                {"role": "assistant", "content": answer.strip()}]
    return _record(ctx, row, messages, [cell], mode=mode, bbox=box, bbox_label=label)


def rule_filter(ctx: Context, row: dict) -> dict:
    try:  # a reply holding chat special tokens would fail the TFDS build later: drop it here
        parse_record({"id": row["id"], "images": row["images"], "messages": row["messages"]})
    except RecordError as e:
        return {**row, "drop": "malformed", "malformed": e.kind}
    with Image.open(io.BytesIO(ctx.image(row["image"]))) as im:
        size = im.size
    reason = filters.rule_reason(row, ctx.cfg.filters, size)
    return {**row, "drop": reason} if reason else dict(row)


def render_trajectory(row: dict) -> str:
    parts = []
    for m in row["messages"][1:]:
        if m["role"] == "observation":
            parts.append(f"<interpreter>\n{m['content']}\n</interpreter>" + " [image]" * m.get("num_images", 0))
        else:
            parts.append(m["content"])
    return "\n".join(parts)


def cross_validate(ctx: Context, row: dict) -> dict:
    prompt = templates.CROSS_VALIDATION.format(question=row["question"], correct_answer=row["answer"],
                                               trajectory=render_trajectory(row))
    v = _word(ask(ctx.verifier, prompt, [ctx.image(row["image"])], max_tokens=ctx.cfg.verify.max_tokens),
              "good", "bad")
    if v is True:
        return dict(row)
    return {**row, "drop": "verifier_bad" if v is False else "verifier_unparsed"}
