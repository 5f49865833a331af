"""`launch.curate` user errors: status 2 and one line naming the field and the fix."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_missing_source_is_a_user_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "launch.curate", "--config=configs/curate.py:endpoints",
                        f"--workdir={tmp_path}/wd", f"--config.source.path={tmp_path}/nope.jsonl"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "config.source.path" in r.stderr and "Traceback" not in r.stderr


def test_missing_url_is_a_user_error(tmp_path, make_config):
    import pytest

    from codedance_jax.errors import UserError
    from runs.curate import pipeline

    c = make_config(num_items=2)
    c.judge.url = ""
    with pytest.raises(UserError, match="judge endpoint has no url"):
        with pipeline.endpoints(c, str(tmp_path), []):
            pass
