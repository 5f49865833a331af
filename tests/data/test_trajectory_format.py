"""The JSONL format: validation of every malformed kind, observation rendering, chat rendering."""

import json

import pytest
from data_helpers import multi_turn_record, write_jsonl, write_png

from codedance_jax import protocol as observation
from data import chat
from data.trajectory import DataReport, MalformedRecordError, read_jsonl


def _user(text="Question?"):
    return {"role": "user", "content": text}


def _asst(text="<answer>1</answer>"):
    return {"role": "assistant", "content": text}


def malformed_file(tmp_path):
    """One good record, then one record per malformed kind; returns (path, {line: kind})."""
    write_png(str(tmp_path / "img/q.png"), 60, 80, 0)
    write_png(str(tmp_path / "img/crop.png"), 56, 56, 1)
    (tmp_path / "img/broken.png").write_bytes(b"not a png at all")
    rows = [
        (multi_turn_record(), None),
        ('{"id": "x", "messages": [', "bad_json"),
        ({"id": "m", "images": ["img/nope.png"], "messages": [_user("<image>Q"), _asst()]}, "missing_image"),
        ({"id": "n", "images": [], "messages": [_user()]}, "no_assistant"),
        (
            {"id": "p", "images": ["img/q.png"], "messages": [_user("<image><image>Q"), _asst()]},
            "too_many_placeholders",
        ),
        ({"id": "r", "images": [], "messages": [_user(), {"role": "tool", "content": "x"}, _asst()]}, "unknown_role"),
        ({"id": "u", "images": ["img/q.png"], "messages": [_user("no marker"), _asst()]}, "unused_images"),
        ({"id": "s", "images": [], "messages": [_user("hi <|im_end|>"), _asst()]}, "special_token"),
        (
            {"id": "o", "images": [], "messages": [_user(), {"role": "observation", "content": "x"}, _asst()]},
            "bad_order",
        ),
        ({"id": "b", "images": ["img/broken.png"], "messages": [_user("<image>Q"), _asst()]}, "bad_image"),
        ({"id": 7, "images": [], "messages": [_user(), _asst()]}, "bad_field"),
    ]
    path = write_jsonl(tmp_path / "t.jsonl", [r for r, _ in rows])
    return path, {i + 1: kind for i, (_, kind) in enumerate(rows) if kind}


def test_every_malformed_kind_is_counted_with_file_and_line(tmp_path):
    path, expected = malformed_file(tmp_path)
    report = DataReport()
    good = list(read_jsonl([path], report=report))
    assert [t.id for t in good] == ["mt-0"] and report.num_ok == 1
    assert dict(report.counts) == {kind: 1 for kind in expected.values()}
    assert {(p.file, p.line, p.kind) for p in report.problems} == {(path, ln, k) for ln, k in expected.items()}
    assert "t.jsonl:3: missing_image" in report.summary()


def test_stop_mode_raises_with_file_line_and_fix(tmp_path):
    path, _ = malformed_file(tmp_path)
    with pytest.raises(MalformedRecordError, match=r"t\.jsonl:2: bad_json: .*fix: each line must be one JSON object"):
        list(read_jsonl([path], on_error="stop"))


def test_images_are_png_bytes(tmp_path):
    from PIL import Image

    write_png(str(tmp_path / "img/q.png"), 60, 80, 0)
    Image.new("RGB", (56, 56), (200, 10, 10)).save(tmp_path / "img/crop.jpg")
    path = write_jsonl(tmp_path / "t.jsonl", [multi_turn_record(crop_img="img/crop.jpg")])
    (traj,) = read_jsonl([path])
    assert all(b.startswith(b"\x89PNG") for b in traj.images)  # the JPEG was re-encoded


@pytest.mark.parametrize("fmt", ["code", "tool_call"])
def test_observation_string_is_the_spec_format(fmt):
    tag = {"code": "interpreter", "tool_call": "tool_response"}[fmt]
    got = observation.render_observation("out\nerr", 2, fmt)
    assert got == (
        f"<|im_end|>\n<|im_start|>user\n<{tag}>\nout\nerr\n</{tag}>"
        "<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|image_pad|><|vision_end|>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    expanded = observation.render_observation("x", [3], fmt)
    assert expanded.count("<|image_pad|>") == 3


def test_observation_text_truncates_visibly_and_keeps_status():
    text = observation.observation_text("a" * 50, "Traceback: Error", status="timeout", max_chars=20)
    assert text.startswith("a" * 20) and "characters truncated" in text and text.endswith("[status: timeout]")
    assert observation.observation_text("ok\n") == "ok"


@pytest.mark.parametrize("fmt", ["code", "tool_call"])
def test_render_equals_chat_template_and_contains_observation(tmp_path, processor, fmt):
    write_png(str(tmp_path / "img/q.png"), 60, 80, 0)
    write_png(str(tmp_path / "img/crop.png"), 56, 56, 1)
    (traj,) = read_jsonl([write_jsonl(tmp_path / "t.jsonl", [multi_turn_record()])])
    rendered = chat.render(traj.messages, None, fmt)
    assert rendered.text == processor.apply_chat_template(chat.template_messages(traj.messages, fmt))
    m = traj.messages
    # From the end of the code turn to the next assistant header: exactly the rollout string.
    assert m[1].content + observation.render_observation(m[2].content, 1, fmt) + m[3].content in rendered.text
    assert [rendered.text[a:b] for a, b in rendered.spans] == [m[1].content + "<|im_end|>", m[3].content + "<|im_end|>"]


def test_binary_lines_are_counted_as_bad_records_by_the_build(tmp_path):
    """A JSONL file with binary lines (a PNG pasted in, bytes that are not UTF-8) builds from its
    good records and reports the rest (issue 38); it used to end in a UnicodeDecodeError inside TFDS."""
    from data import sft_tfds

    write_png(str(tmp_path / "img/q.png"), 60, 80, 0)
    write_png(str(tmp_path / "img/crop.png"), 56, 56, 1)
    path = write_jsonl(tmp_path / "t.jsonl", [multi_turn_record("a"), multi_turn_record("b")])
    png = (tmp_path / "img/q.png").read_bytes()
    with open(path, "ab") as f:
        f.write(b'{"id": "c\xff\xfe", "images": []}\n')  # JSON-looking, but not UTF-8
        f.write(png.replace(b"\n", b"").replace(b"\r", b"") + b"\n")  # one binary line
        f.write(json.dumps(multi_turn_record("d")).encode() + b"\n")
    report = sft_tfds.build_dataset([path], str(tmp_path / "tfds"), "bin")
    assert report.num_ok == 3 and dict(report.counts) == {"bad_encoding": 2}, report.summary()
    assert [(p.line, p.kind) for p in report.problems] == [(3, "bad_encoding"), (4, "bad_encoding")]
    assert "t.jsonl:3: bad_encoding: byte 0xff at column 10 is not UTF-8" in report.summary()
    assert len(sft_tfds.open_source(str(tmp_path / "tfds"), "bin")) == 3
