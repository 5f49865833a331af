"""The sandbox splice: imagined outputs replaced by real ones, in one session, errors observed."""

import io

import numpy as np
from PIL import Image

from runs.curate import splice


def block(code):
    return f"<code>\n```python\n{code}\n```\n</code>"


def test_imagined_output_replaced_in_one_session(pool):
    rng = np.random.default_rng()
    a, b = (int(x) for x in rng.integers(100, 10_000, size=2))
    text = (f"<think>add them</think>\n{block(f'x = {a}')}\n<interpreter>\nnothing\n</interpreter>\n"
            f"<think>now print</think>\n{block(f'print(x + {b})')}\n<interpreter>\n999999\n</interpreter>\n"
            f"<answer>{a + b}</answer>")
    with pool.new_session() as s:
        msgs, cells, replaced = splice.splice(text, s)
    assert replaced == 2
    assert [m["role"] for m in msgs] == ["assistant", "observation", "assistant", "observation", "assistant"]
    assert msgs[3]["content"] == str(a + b)  # the real output; the variable carried over from cell 1
    assert "999999" not in "".join(m["content"] for m in msgs)
    assert msgs[2]["content"].startswith("<think>now print</think>") and msgs[2]["content"].endswith("</code>")
    assert msgs[-1]["content"] == f"<answer>{a + b}</answer>"
    assert [c.status for c in cells] == ["ok", "ok"]


def test_failing_block_is_an_error_observation_and_images_come_back(pool):
    img = Image.fromarray(np.random.default_rng().integers(0, 255, (20, 30, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    text = (block("print(undefined_name)") + "\n<interpreter>\n42\n</interpreter>\n"
            + block("from PIL import Image\nim = Image.open('image.png')\nprint(im.size)\n"
                    "im.crop((0, 0, 10, 10)).save('crop.png')") + "\n<answer>ok</answer>")
    with pool.new_session(files={"image.png": buf.getvalue()}) as s:
        msgs, cells, _ = splice.splice(text, s)
    assert cells[0].status == "error" and "NameError" in msgs[1]["content"]
    assert msgs[1]["content"].endswith("[status: error]") and "42" not in msgs[1]["content"]
    assert msgs[3]["content"].startswith("(30, 20)") and msgs[3]["num_images"] == 1
    assert Image.open(io.BytesIO(cells[1].images[0])).size == (10, 10)


def test_code_of_turn_restores_stripped_stop():
    turn, code = splice.code_of_turn("<think>t</think>\n<code>\n```python\nprint(1)\n```\n")
    assert turn.endswith("</code>") and code == "print(1)\n"
    assert splice.code_of_turn("<answer>3</answer>") == ("<answer>3</answer>", None)
