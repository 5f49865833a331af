"""Every launcher fails like a product (issue 17): bad inputs x launchers, run as real subprocesses.

Each case asserts exit status 2, that stderr names the culprit, that no traceback is printed, and
that the workdir is as it was (absent when it was absent) or holds the intact last checkpoint.
All subprocesses start at once from one module fixture (most fail in flag parsing or before any
JAX work); the cases that need a trained workdir wait for one tiny real SFT run, which also
checks that a partly malformed dataset trains on its good records and reports the bad lines.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from launch_env import launcher_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_ARGS = ["--config=configs/sft.py:tiny", "--config.total_steps=1", "--config.checkpoint.every_steps=1",
              "--config.batch_size=4", "--config.tensorboard=False", "--config.export_policy=False"]


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    launcher: str
    args: tuple[str, ...]
    culprit: tuple[str, ...]  # substrings stderr must contain
    untouched: str | None = "{tmp}/wd"  # a path that must be exactly as before (absent here)
    trained: bool = False  # runs in (a copy of) the trained workdir


CASES = [
    # flag and config-file errors: no JAX imported
    Case("sft-misspelt-field", "sft", ("--config=configs/sft.py:tiny", "--config.batch_sizee=3", "--workdir={tmp}/wd"),
         ("--config.batch_sizee", '"batch_size"')),
    Case("grpo-misspelt-nested-field", "grpo",
         ("--config=configs/grpo.py:tiny", "--config.rollout.max_turnz=3", "--workdir={tmp}/wd"),
         ("max_turnz", '"max_turns"')),
    Case("sft-wrong-type", "sft", ("--config=configs/sft.py:tiny", "--config.batch_size=abc", "--workdir={tmp}/wd"),
         ("--config.batch_size", "abc")),
    Case("sft-unknown-flag", "sft", ("--config=configs/sft.py:tiny", "--workdirr={tmp}/wd"), ("workdirr",)),
    Case("eval-unknown-benchmark", "eval", ("--config=configs/eval.py:ChartQAA", "--workdir={tmp}/wd"), ("ChartQAA",)),
    Case("demo-missing-config-file", "demo", ("--config=configs/nope.py", "--workdir={tmp}/wd"), ("configs/nope.py",)),
    Case("ablate-unknown-mode", "ablate", ("--modes=outcome,bogus", "--workdir={tmp}/wd"), ("--modes",)),
    Case("convert-missing-flag", "convert", ("--src={tmp}/llama",), ("--dst",)),
    # detected by the library before any work
    Case("convert-missing-src", "convert", ("--src=/nonexistent_ckpt", "--dst={tmp}/wd"), ("/nonexistent_ckpt",)),
    Case("ask-workdir-under-a-file", "ask", ("--workdir={tmp}/afile/sub",), ("afile",), untouched="{tmp}/afile"),
    Case("sft-all-records-malformed", "sft",
         ("--config=configs/sft.py:tiny", "--config.data.jsonl={tmp}/bad.jsonl", "--workdir={tmp}/wd"),
         ("all 2 records are malformed", "bad.jsonl:1")),
    Case("sft-mesh-cannot-hold", "sft", ("--config=configs/sft.py:tiny", "--config.mesh.data=3", "--workdir={tmp}/wd"),
         ("mesh", "[3, -1, 1]")),
    Case("sft-other-architecture", "sft",
         ("--config=configs/sft.py:tiny", "--config.init_from={tmp}/llama", "--workdir={tmp}/wd"),
         ("model_type='llama'", "qwen2_5_vl")),
    Case("grpo-missing-prompts", "grpo",
         ("--config=configs/grpo.py:tiny", "--config.data.toyworld=False", "--config.data.jsonl={tmp}/nope.jsonl",
          "--config.processor_dir={tmp}/llama", "--workdir={tmp}/wd"), ("nope.jsonl",)),
    Case("grpo-bad-reward-mode", "grpo", ("--config=configs/grpo.py:tiny", "--config.rbat.mode=bogus",
                                          "--workdir={tmp}/wd"), ("mode='bogus'",)),
    Case("eval-missing-benchmark-file", "eval",
         ("--config=configs/eval.py:ChartQA", "--config.checkpoint={tmp}/llama", "--config.data_path={tmp}/nodata",
          "--workdir={tmp}/wd"), ("ChartQA_TEST.tsv", "--config.data_path")),
    Case("sft-port-in-use", "sft", ("--config=configs/sft.py:tiny", "--coordinator_address=localhost:{port}",
                                    "--num_processes=1", "--process_id=0", "--workdir={tmp}/wd"),
         ("--coordinator_address", "{port} is in use")),
    # a workdir that holds another run; an error mid-run
    Case("sft-workdir-other-config", "sft", (*TRAIN_ARGS, "--config.data.jsonl={tmp}/syn/partly.jsonl",
                                             "--config.batch_size=8", "--config.seed=1", "--workdir={trained}"),
         ("config.batch_size: 4 (saved) -> 8", "config.seed", "--allow_config_change"),
         untouched="{trained}", trained=True),
    Case("grpo-in-sft-workdir", "grpo", ("--config=configs/grpo.py:tiny", "--workdir={trained}"),
         ("holds a 'sft' run",), untouched="{trained}", trained=True),
    Case("sft-midrun-no-bucket-fits", "sft",
         (*TRAIN_ARGS, "--config.data.jsonl={tmp}/syn/partly.jsonl", "--config.total_steps=3",
          "--config.data.buckets=((16,4,2),)", "--allow_config_change", "--workdir={tmp}/resumed"),
         ("no example fits a bucket", "--config.data.buckets", "step 1", "re-run the same command"),
         untouched=None, trained=True),
    # issue 38: the disk fills during the step-2 save (a tmpfs with room for one checkpoint)
    Case("sft-disk-full", "sft",
         (*TRAIN_ARGS, "--config.data.jsonl={tmp}/syn/partly.jsonl", "--config.total_steps=2",
          "--workdir={tmp}/full/wd"),
         ("the disk is full: the checkpoint of step 2 was not written", "(step 1) is intact", "free disk space"),
         untouched=None, trained=True),
]


def _env(**extra) -> dict:
    env = launcher_env(drop=("CODEDANCE_VERBOSE",), JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3", **extra)
    env.setdefault("JAX_COMPILATION_CACHE_DIR", "/tmp/jax_cache")
    return env


def _run(argv, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=REPO, env=_env(**env), capture_output=True, text=True,
                          timeout=900)


def snapshot(path: str):
    """None when absent; else {relative path: sha1} of every file under it (or of the file)."""
    if not os.path.exists(path):
        return None
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return {".": hashlib.sha1(f.read()).hexdigest()}
    out = {}
    for root, _, files in os.walk(path):
        for n in files:
            p = os.path.join(root, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, path)] = hashlib.sha1(f.read()).hexdigest()
    return out


def _write_inputs(tmp: str) -> None:
    from data.synthetic import write_synthetic_sft

    good = {"id": "x", "messages": [{"role": "user", "content": "<image>\nq"}, {"role": "assistant", "content": "a"}]}
    with open(os.path.join(tmp, "bad.jsonl"), "w") as f:
        f.write(json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
        f.write("{not json\n")
    partly = write_synthetic_sft(os.path.join(tmp, "syn"), 8, seed=0)
    with open(partly, "a") as f:
        f.write("{not json\n")
        f.write(json.dumps({**good, "images": ["img/none.png"]}) + "\n")
    shutil.move(partly, os.path.join(tmp, "syn", "partly.jsonl"))
    os.makedirs(os.path.join(tmp, "llama"))
    with open(os.path.join(tmp, "llama", "config.json"), "w") as f:
        json.dump({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, f)
    with open(os.path.join(tmp, "afile"), "w") as f:
        f.write("a file, not a directory\n")


def _small_disk(mount: str, workdir: str) -> bool:
    """A tmpfs at `mount` holding a copy of `workdir` (one checkpoint) with 4 MiB to spare: not
    room for another checkpoint (~13 MB). False where a tmpfs cannot be mounted (not root)."""
    used = sum(os.lstat(os.path.join(r, n)).st_blocks * 512 for r, _, ns in os.walk(workdir) for n in ns)
    os.makedirs(mount)
    size = (used >> 20) + 4
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}m", "tmpfs", mount], capture_output=True).returncode:
        return False
    shutil.copytree(workdir, os.path.join(mount, "wd"), symlinks=True)
    return True


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("bad_inputs"))
    _write_inputs(tmp)
    trained = os.path.join(tmp, "trained")
    held = socket.socket()
    held.bind(("", 0))
    held.listen()
    subs = {"tmp": tmp, "trained": trained, "port": str(held.getsockname()[1])}

    def fill(s: str) -> str:
        return s.format(**subs)

    def one(case: Case):
        path = fill(case.untouched) if case.untouched else None
        if case.id == "sft-midrun-no-bucket-fits":
            shutil.copytree(trained, fill("{tmp}/resumed"), symlinks=True)
            path = fill("{tmp}/resumed")
        if case.id == "sft-disk-full":
            path = fill("{tmp}/full/wd")
            if not _small_disk(fill("{tmp}/full"), trained):
                return None, None, None
        try:
            before = snapshot(path) if path else None
            proc = _run(["-m", f"launch.{case.launcher}", *map(fill, case.args)])
            return proc, before, snapshot(path) if path else None
        finally:
            if case.id == "sft-disk-full":
                subprocess.run(["umount", "-l", fill("{tmp}/full")], check=True)

    with ThreadPoolExecutor(max_workers=3) as pool:
        train = pool.submit(_run, ["-m", "launch.sft", *TRAIN_ARGS, f"--config.data.jsonl={tmp}/syn/partly.jsonl",
                                   f"--workdir={trained}"])
        early = {c.id: pool.submit(one, c) for c in CASES if not c.trained}
        trained_run = train.result()
        assert trained_run.returncode == 0, trained_run.stderr[-3000:]
        later = {c.id: pool.submit(one, c) for c in CASES if c.trained}
        results = {k: f.result() for k, f in {**early, **later}.items()}
    held.close()
    return {"results": results, "trained_run": trained_run, "subs": subs, "tmp": tmp}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_user_error_exits_2_names_the_culprit_and_loses_nothing(table, case):
    proc, before, after = table["results"][case.id]
    if proc is None:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    err = proc.stderr
    assert proc.returncode == 2, f"status {proc.returncode}\n{err[-3000:]}"
    assert "Traceback" not in err, err[-3000:]
    for s in case.culprit:
        assert s.format(**table["subs"]) in err, f"{s!r} not in stderr:\n{err[-2000:]}"
    assert f"launch.{case.launcher}: error: " in err
    if case.id == "sft-disk-full":
        # the step-1 checkpoint is intact and the partial step-2 one is gone
        keep = {k: v for k, v in before.items() if k.startswith("checkpoints/")}
        assert keep and {k for k in after if k.startswith("checkpoints/")} == set(keep)
        assert {k: after.get(k) for k in keep} == keep
    elif case.id == "sft-midrun-no-bucket-fits":
        # the checkpoint and the metrics written so far are untouched by the failed resume
        keep = {k: v for k, v in before.items() if k.startswith("checkpoints/") or k == "metrics.jsonl"}
        assert keep and any(k.startswith("checkpoints/1/") for k in keep)
        assert {k: after.get(k) for k in keep} == keep
    elif case.untouched:
        assert after == before, "the workdir changed"


def test_partly_malformed_data_trains_on_the_good_records_and_reports_the_bad_lines(table):
    run, tmp = table["trained_run"], table["tmp"]
    out = run.stdout + run.stderr
    assert "8 records ok, 2 malformed (bad_json 1, missing_image 1)" in out, out[-3000:]
    assert "partly.jsonl:9: bad_json" in out and "partly.jsonl:10: missing_image" in out
    trained = os.path.join(tmp, "trained")
    assert os.path.isdir(os.path.join(trained, "checkpoints", "1"))
    with open(os.path.join(trained, "run_config.json")) as f:
        rec = json.load(f)
    assert rec["kind"] == "sft" and rec["config"]["batch_size"] == 4


RAISER = """
import os, sys
from launch import runner
from codedance_jax.errors import DataError

def main(argv):
    if sys.argv[-1] == "user":
        raise DataError("data.jsonl:3: bad_json", "one object per line")
    if sys.argv[-1] == "missing":
        open("/nonexistent_dir/x.json")
    if sys.argv[-1] == "loop":
        loop = os.path.join(os.path.dirname(__file__), "loop.json")
        os.symlink(loop, loop)
        open(loop)
    if sys.argv[-1] == "full":  # how orbax reports a full disk from its writer threads
        try:
            raise OSError(28, "No space left on device")
        except OSError as e:
            raise ValueError('RESOURCE_EXHAUSTED: Error writing "w/0" in OCDBT database at local file '
                             '"/ckpt/2.orbax-checkpoint-tmp/": Failed writing') from e
    raise RuntimeError("a bug")

runner.run(main)
"""


@pytest.mark.parametrize(
    "arg, flags, env, status, traceback",
    [("user", [], {}, 2, False), ("missing", [], {}, 2, False), ("loop", [], {}, 2, False), ("full", [], {}, 2, False),
     ("bug", [], {}, 1, True),
     ("user", ["--verbose"], {}, 2, True), ("user", [], {"CODEDANCE_VERBOSE": "1"}, 2, True)],
)
def test_runner_sorts_user_errors_from_bugs(tmp_path, arg, flags, env, status, traceback):
    script = tmp_path / "raiser.py"
    script.write_text(RAISER)
    proc = _run([str(script), *flags, arg], **env)
    assert proc.returncode == status, proc.stderr
    assert ("Traceback" in proc.stderr) == traceback, proc.stderr
    if status == 2:
        expect = {"user": "data.jsonl:3: bad_json", "missing": "/nonexistent_dir/x.json: No such file or directory",
                  "loop": f"{tmp_path}/loop.json: Too many levels of symbolic links",
                  "full": "/ckpt/2.orbax-checkpoint-tmp/: no space left on the device while writing"}[arg]
        assert f"raiser.py: error: {expect}" in proc.stderr
        assert "fix: " in proc.stderr
    else:
        assert "RuntimeError: a bug" in proc.stderr


def test_a_launcher_without_root_says_so_and_exits_2(tmp_path):
    """Without root the sandbox cannot start: one message line and its fix, status 2, no traceback
    (issue 48 item 7). The uid is faked in the launcher's own process: the Python here lives under
    /root (mode 0700), so a process dropped to another uid could not import it."""
    code = ("import os, runpy, sys\nsys.path.insert(0, os.getcwd())\nos.geteuid = lambda: 1000\n"
            f"sys.argv = ['launch.demo', '--workdir={tmp_path}/w', '--config=configs/demo.py:mini']\n"
            "runpy.run_module('launch.demo', run_name='__main__')\n")
    r = _run(["-c", code])
    err = [ln for ln in r.stderr.splitlines() if ln.startswith(("launch.demo:", "  fix:", "Traceback"))]
    assert r.returncode == 2, r.stderr[-2000:]
    assert err == ["launch.demo: error: the code sandbox needs root (it creates namespaces, mounts and cgroups "
                   "for each session)", "  fix: " + __import__("sandbox").SandboxUnavailable.fix], err
