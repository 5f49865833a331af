r"""SFT data curation configs (paper section 3.2, appendix 7.1-7.2; `runs/curate/`).

  python -m launch.curate --config=configs/curate.py:toy --workdir=/tmp/curate_toy
  python -m launch.curate --config=configs/curate.py:endpoints --workdir=DIR \
      --config.source.path=/data/prompts.jsonl \
      --config.judge.url=http://judge:8000/v1 --config.judge.model=Qwen2.5-VL-72B-Instruct \
      --config.weak.url=http://weak:8000/v1 --config.weak.model=Qwen2.5-VL-7B-Instruct ...

Each role is `url` + `model` + `api_key_env` (the variable holding its key; unset = no key), with
`concurrency` (requests in flight), `timeout_s` and `retries` (the openai client's backoff).
`serve` (a checkpoint path, or "random_tiny") starts launch.serve on it for the role: a subprocess
(`serve_mode="process"`) or our engine in this process (`serve_mode="inprocess"`).
`toy`: the toy world; the weak model is our served tiny policy (`serve="random_tiny"`: a random
tiny checkpoint behind `python -m launch.serve`), teacher / judge / verifier the scripted stand-in
(`url="scripted"`, `runs/curate/scripted.py`, with fault rates that exercise each filter).
"""

import ml_collections


def _role(url="", model="", concurrency=4, timeout_s=120.0, retries=4, serve=""):
    return ml_collections.ConfigDict(dict(url=url, model=model, api_key_env="OPENAI_API_KEY", concurrency=concurrency,
                                          timeout_s=timeout_s, retries=retries, serve=serve, serve_flags=(),
                                          serve_mode="process"))


def get_config(preset: str = "toy") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.source = ml_collections.ConfigDict(dict(kind="jsonl", path="", seed=0, num_items=0, corrupt_rate=0.0))
    c.judge = _role(model="Qwen2.5-VL-72B-Instruct")
    c.weak = _role(model="Qwen2.5-VL-7B-Instruct")
    c.teacher = _role(model="Qwen2.5-VL-72B-Instruct")
    c.verifier = _role(model="Qwen2.5-VL-72B-Instruct")
    c.workers = 8  # items in flight per stage (each role's concurrency still bounds its requests)
    c.validate = ml_collections.ConfigDict(dict(informativeness=True, qa=True, max_tokens=16))
    # pass_rate >= trivial_rate: trivial; >= medium_rate: medium; else hard.
    c.stratify = ml_collections.ConfigDict(dict(k=8, temperature=1.0, max_tokens=1024, trivial_rate=1.0,
                                                medium_rate=0.125, trivial="direct"))  # direct | drop
    c.synthesize = ml_collections.ConfigDict(dict(max_tokens=4096, max_turns=6, max_images=4))
    # Grounding (crop) trajectories from the Table 6 box for items that need localisation, instead of the
    # Table 9 revision (runs/curate/grounding.py). select: off | all | meta (meta[meta_key] in
    # meta_values: a task column of the source JSONL) | question (question_regex matches).
    c.synthesize.grounding = ml_collections.ConfigDict(dict(
        select="meta", meta_key="task", meta_values=("grounding", "crop"),
        question_regex=r"(?i)\b(zoom|crop|marked|highlighted|small|tiny|box(ed)?|region)\b",
        zoom_px=448, max_tokens=512))
    c.filters = ml_collections.ConfigDict(dict(min_box_frac=0.0005, max_box_frac=0.9, max_turn_chars=8000,
                                               max_cells=8))
    c.verify = ml_collections.ConfigDict(dict(max_tokens=16))
    c.sandbox = ml_collections.ConfigDict(dict(workers=4, timeout_s=30.0, memory_mb=1024))
    # report.html: up to report_kept kept trajectories, and up to report_per_reason dropped items for every
    # drop reason of every stage (so each reason is shown at least once).
    c.output = ml_collections.ConfigDict(dict(tfds=True, tfds_name="curated", report_kept=4, report_per_reason=2))
    # Fault rates of the scripted stand-in (only used where a role's url is "scripted").
    c.scripted = ml_collections.ConfigDict(dict(uninformative_rate=0.0, wrong_rate=0.0, bad_box_rate=0.0,
                                                bug_rate=0.0, unrecovered_rate=0.0, verifier_bad_rate=0.0))
    if preset == "toy":
        c.source = ml_collections.ConfigDict(dict(kind="toyworld", path="", seed=0, num_items=12, corrupt_rate=0.1))
        for role in ("judge", "teacher", "verifier"):
            c[role].url, c[role].model = "scripted", "scripted"
        c.weak = _role(model="codedance", concurrency=4, timeout_s=600.0, retries=1, serve="random_tiny")
        c.weak.serve_flags = ("--max_context=1024", "--decode_chunk=8", "--max_batch=4")
        c.workers = 4
        c.stratify.k, c.stratify.max_tokens, c.stratify.medium_rate = 2, 16, 0.5
        c.synthesize.max_tokens = 1024
        c.synthesize.grounding.update(dict(meta_key="family", meta_values=("find",), zoom_px=112))
        c.sandbox.workers, c.sandbox.memory_mb = 2, 512
        c.scripted.update(dict(uninformative_rate=0.1, wrong_rate=0.1, bad_box_rate=0.3, bug_rate=0.5,
                               unrecovered_rate=0.3, verifier_bad_rate=0.1))
    elif preset != "endpoints":
        raise ValueError(f"unknown preset {preset!r}: toy | endpoints")
    return c
