"""The SFT data curation pipeline end to end: `run(config, workdir)` (`python -m launch.curate`).

    WORKDIR/items.jsonl        ingest: the candidate items (+ img/ID.png)
    WORKDIR/validate.jsonl     Table 5 informativeness + Table 7 QA validation (judge)
    WORKDIR/stratify.jsonl     pass@k of the weak model -> trivial / medium / hard (Table 8)
    WORKDIR/synthesize.jsonl   teacher trajectories, every cell run in the sandbox (Tables 6, 8, 9, ours)
    WORKDIR/filter.jsonl       rule filters
    WORKDIR/verify.jsonl       cross-validation GOOD/BAD (verifier)
    WORKDIR/sft.jsonl          the kept trajectories in the SFT format (`launch.sft --config.data.jsonl=`)
    WORKDIR/tfds/              their TFDS build (`data.sft_tfds.build_dataset`, name "curated")
    WORKDIR/report.json, report.html   counts per stage and reason, difficulty histogram, examples
                               (`output.report_kept` kept, `output.report_per_reason` per drop reason)
    WORKDIR/cache/ROLE.jsonl   every endpoint reply (a re-run pays nothing twice)

Each stage file holds kept and dropped rows (`"drop": reason`) and resumes on its own
(`stagefile`). Roles (`config.judge`, `.weak`, `.teacher`, `.verifier`): `url` + `model` +
`api_key_env`; `url="scripted"` starts the toy world's scripted stand-in (`scripted.py`) in this
process; `serve="random_tiny"` (or a checkpoint path) starts `python -m launch.serve` on it and
uses that as the role's url (`serve_mode="inprocess"`: the same server in this process, our engine
in-process, still reached over HTTP on 127.0.0.1). Both start on a role's first cache miss, so a resumed run whose weak
stage is done never waits for `launch.serve`.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import subprocess
import sys
import threading
from typing import Any

import numpy as np

from codedance_jax.errors import UserError
from runs.curate import grounding, stages
from runs.curate import report as report_lib
from runs.curate.endpoints import Endpoint
from runs.curate.stagefile import kept, read_stage, run_stage

ROLES = ("judge", "weak", "teacher", "verifier")
STAGES = ("validate", "stratify", "synthesize", "filter", "verify")


# ------------------------------------------------------------------------------ ingest
def toy_items(c) -> list:
    """The toy items of `config.source` (deterministic per seed): families x difficulties cycled."""
    from data.toyworld.tasks import DIFFICULTIES, FAMILIES, make_item

    cells = [(f, d) for d in DIFFICULTIES for f in FAMILIES]
    return [make_item(f, d, np.random.default_rng([c.seed, 16, i]), f"toy-{i:04d}")
            for i, (f, d) in ((i, cells[i % len(cells)]) for i in range(c.num_items))]


def ingest(config, workdir: str, log=print) -> list[dict[str, Any]]:
    """Write `items.jsonl` once (its existence means done); a share `corrupt_rate` of toy gold answers
    is made wrong on purpose, so QA validation has something to catch."""
    path = os.path.join(workdir, "items.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    s = config.source
    rows = []
    if s.kind == "toyworld":
        from data.toyworld.expert import png_bytes
        from runs.curate.scripted import chance, wrong_answer

        os.makedirs(os.path.join(workdir, "img"), exist_ok=True)
        for it in toy_items(s):
            rel = f"img/{it.id}.png"
            with open(os.path.join(workdir, rel), "wb") as f:
                f.write(png_bytes(it.image))
            answer = wrong_answer(it.answer) if chance(it.id, "corrupt") < s.corrupt_rate else it.answer
            rows.append({"id": it.id, "question": it.question, "answer": answer, "image": rel,
                         "meta": {"family": it.family, "difficulty": it.difficulty, "true_answer": it.answer}})
    elif s.kind == "jsonl":
        rows = _ingest_jsonl(s.path, workdir)
    else:
        raise UserError(f"config.source.kind={s.kind!r} is unknown", "use 'toyworld' or 'jsonl'")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)  # atomic: a killed ingest leaves no half file
    log(f"ingest: {len(rows)} items -> {path}")
    return rows


def _ingest_jsonl(src: str, workdir: str) -> list[dict[str, Any]]:
    """Rows of the RL prompt format ({"id", "question", "answer", "images": [path]}, paths relative to
    the file); the first image is copied under WORKDIR/img."""
    import shutil

    if not os.path.isfile(src):
        raise UserError(f"config.source.path={src!r} does not exist", "give a JSONL of {id, question, answer, images}")
    os.makedirs(os.path.join(workdir, "img"), exist_ok=True)
    rows, base = [], os.path.dirname(os.path.abspath(src))
    with open(src) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                rel = f"img/{r['id']}.png"
                shutil.copyfile(os.path.join(base, r["images"][0]), os.path.join(workdir, rel))
                rows.append({"id": r["id"], "question": r["question"], "answer": str(r["answer"]), "image": rel,
                             "meta": {k: v for k, v in r.items() if k not in ("id", "question", "answer", "images")}})
    return rows


# ------------------------------------------------------------------------------ services
class _ServeProcess:
    """`python -m launch.serve` on a checkpoint, as a user would start it; its url once it listens."""

    def __init__(self, ckpt: str, extra: tuple[str, ...], log):
        import re

        cmd = [sys.executable, "-m", "launch.serve", f"--checkpoint={ckpt}", "--port=0", "--noagent", *extra]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("XLA_FLAGS", None)
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines, self.url, ready = [], None, threading.Event()

        def read():
            for line in self.proc.stdout:
                self.lines.append(line)
                m = re.search(r"listening on (http://\S+/v1)", line)
                if m:
                    self.url = m.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        ready.wait(timeout=900)
        if self.url is None:
            self.close()
            raise UserError("curate: launch.serve for the weak model did not start:\n" + "".join(self.lines[-20:]),
                            "run the printed launch.serve command by hand to see why")
        log(f"weak model: launch.serve {ckpt} at {self.url}")

    def close(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class _InProcessServe:
    """launch.serve's server (`codedance_jax.serve.Server`) in THIS process: our engine in-process,
    no second process and no second copy of the model; uvicorn on a thread, 127.0.0.1, a free port.
    `extra`: the role's `serve_flags` (`--max_context=N`, `--max_batch=N`, `--decode_chunk=N`)."""

    def __init__(self, ckpt: str, extra: tuple[str, ...], log):
        import dataclasses
        import time

        import uvicorn

        from codedance_jax.serve import ServeConfig, Server, StartError
        from codedance_jax.serve.server import bind, load

        fields = {f.name: f.type for f in dataclasses.fields(ServeConfig)}
        kw = {"agent": False}
        for flag in extra:
            k, _, v = flag.lstrip("-").partition("=")
            if k not in fields or fields[k] not in ("int", int):
                raise UserError(f"curate: serve_flags {flag!r} cannot be used in process",
                                "in process only --max_context, --max_batch and --decode_chunk apply")
            kw[k] = int(v)
        sock = bind("127.0.0.1", 0)
        try:
            model, processor = load(ckpt)
        except StartError as e:
            sock.close()
            raise UserError(f"curate: {e}", "give the role's serve= a checkpoint directory") from e
        self.server = Server(model, processor, ServeConfig(**kw))
        self.server.start()
        self.uv = uvicorn.Server(uvicorn.Config(self.server.app, log_level="warning"))
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.uv.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self.uv.started:
            self.close()
            raise UserError("curate: the in-process server did not start", "run launch.serve by hand to see why")
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        log(f"weak model: in-process server on {ckpt} at {self.url}")

    def close(self):
        self.uv.should_exit = True
        self.thread.join(timeout=30)
        self.server.close()


def _weak_checkpoint(spec: str, workdir: str) -> str:
    """`spec`, or for "random_tiny" a tiny random checkpoint (weights drawn in numpy: no compile)."""
    if spec != "random_tiny":
        return spec
    path = os.path.join(workdir, "weak_ckpt")
    if not os.path.exists(os.path.join(path, "config.json")):
        from codedance_jax.checkpoint import hf
        from codedance_jax.checkpoint.build import model_from_tensors
        from codedance_jax.model.config import ModelConfig
        from codedance_jax.processing.reference_files import write_qwen25vl_processor_files

        rng = np.random.default_rng(0)
        model = model_from_tensors(ModelConfig.tiny(), lambda r: (0.05 * rng.standard_normal(r.hf_shape)).astype(
            np.float32) + (1.0 if "norm" in r.hf_name else 0.0))
        hf.export_hf(model, path + ".tmp")
        write_qwen25vl_processor_files(path + ".tmp", max_pixels=448 * 448)
        os.replace(path + ".tmp", path)
    return path


@contextlib.contextmanager
def endpoints(config, workdir: str, items: list[dict], log=print):
    """The four role endpoints, starting the scripted stand-in and launch.serve where configured."""
    with contextlib.ExitStack() as stack:
        scripted = []

        def start_scripted() -> str:
            if not scripted:
                from runs.curate.scripted import Faults, ScriptedModel, ScriptedServer

                scripted.append(ScriptedServer(ScriptedModel(toy_items(config.source), Faults(**config.scripted))))
                stack.callback(scripted[0].close)
                log(f"scripted stand-in teacher/judge/verifier at {scripted[0].base_url}")
            return scripted[0].base_url

        def start_serve(rc) -> str:
            kind = {"process": _ServeProcess, "inprocess": _InProcessServe}.get(rc.get("serve_mode", "process"))
            if kind is None:
                raise UserError(f"curate: serve_mode={rc.serve_mode!r} is unknown", "use 'process' or 'inprocess'")
            sp = kind(_weak_checkpoint(rc.serve, workdir), tuple(rc.get("serve_flags", ())), log)
            stack.callback(sp.close)
            return sp.url

        lock = threading.Lock()

        def lazy(fn, *args):
            def start():
                with lock:  # roles start their servers one at a time
                    return fn(*args)
            return start

        urls = {}
        for role in ROLES:
            rc = config[role]
            if rc.get("serve", ""):
                urls[role] = lazy(start_serve, rc)
            elif rc.url == "scripted":
                urls[role] = lazy(start_scripted)
            else:
                urls[role] = rc.url
        eps = {role: Endpoint(urls[role], config[role].model, role=role, api_key_env=config[role].api_key_env,
                              cache_path=os.path.join(workdir, "cache", f"{role}.jsonl"),
                              concurrency=config[role].concurrency, timeout_s=config[role].timeout_s,
                              retries=config[role].retries)
               for role in ROLES}
        yield eps


# ------------------------------------------------------------------------------ run
def run(config, workdir: str, log=print, stop_after: str = "") -> dict[str, Any]:
    """Every stage in order (each resumes), then the output and the report; returns the report."""
    os.makedirs(workdir, exist_ok=True)
    items = ingest(config, workdir, log)
    from sandbox import SandboxPool

    w = config.workers
    grounding.check(config.synthesize.grounding)
    with endpoints(config, workdir, items, log) as eps, \
            SandboxPool(num_workers=config.sandbox.workers, timeout_s=config.sandbox.timeout_s,
                        memory_mb=config.sandbox.memory_mb) as pool:
        ctx = stages.Context(workdir, config, pool=pool, **eps)
        fns = {"validate": stages.validate, "stratify": stages.stratify, "synthesize": stages.synthesize,
               "filter": stages.rule_filter, "verify": stages.cross_validate}
        rows = items
        for name in STAGES:
            rows = kept(run_stage(name, workdir, rows, lambda r, f=fns[name]: f(ctx, r), w, log))
            if name == stop_after:
                return {}
        cache = {role: {"hits": ep.cache.hits, "misses": ep.cache.misses, "requests": ep.requests}
                 for role, ep in eps.items()}
    return write_output(config, workdir, items, cache, log)


def write_output(config, workdir: str, items: list[dict], cache: dict, log=print) -> dict[str, Any]:
    final = kept(read_stage(workdir, "verify"))
    order = {r["id"]: i for i, r in enumerate(items)}
    final.sort(key=lambda r: order[r["id"]])
    sft = os.path.join(workdir, "sft.jsonl")
    with open(sft + ".tmp", "w") as f:
        for r in final:
            f.write(json.dumps({"id": r["id"], "images": r["images"], "messages": r["messages"],
                                "meta": {"difficulty": r["difficulty"], "mode": r["mode"], "pass_rate": r["pass_rate"],
                                         "source": r["meta"]}}) + "\n")
    os.replace(sft + ".tmp", sft)
    built = None
    if final and config.output.tfds:
        from data import sft_tfds

        rep = sft_tfds.build_dataset([sft], os.path.join(workdir, "tfds"), config.output.tfds_name,
                                     on_error="stop")
        built = rep.num_ok
    counts = {name: _counts(read_stage(workdir, name)) for name in STAGES}
    strat = read_stage(workdir, "stratify")
    report = {
        "items": len(items),
        "kept": len(final),
        "stages": counts,
        "difficulty": dict(collections.Counter(r["difficulty"] for r in strat)),
        "modes": dict(collections.Counter(r["mode"] for r in final)),
        "tfds_records": built,
        "sft_jsonl": sft,
        "cache": cache,
    }
    with open(os.path.join(workdir, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    out = config.output
    report_lib.write_html(os.path.join(workdir, "report.html"), report, workdir,
                          kept_rows=final[: out.get("report_kept", 4)],
                          dropped=dropped_examples(workdir, out.get("report_per_reason", 2)))
    log(f"curate: {len(items)} items -> {len(final)} trajectories in {sft}; report {workdir}/report.json")
    return report


def dropped_examples(workdir: str, per_reason: int) -> list[tuple[str, str, list[dict]]]:
    """(stage, reason, its first `per_reason` dropped rows, at least one) for every reason of every stage."""
    out = []
    for name in STAGES:
        by: dict[str, list[dict]] = {}
        for r in read_stage(workdir, name):
            if r.get("drop"):
                by.setdefault(r["drop"], []).append(r)
        out += [(name, reason, rows[: max(1, per_reason)]) for reason, rows in sorted(by.items())]
    return out


def _counts(rows: list[dict]) -> dict[str, Any]:
    return {"in": len(rows), "kept": sum(1 for r in rows if not r.get("drop")),
            "dropped": dict(collections.Counter(r["drop"] for r in rows if r.get("drop")))}
