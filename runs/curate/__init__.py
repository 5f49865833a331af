"""SFT data curation (paper section 3.2, appendix 7.1-7.2): an application (layer 4).

`pipeline.run(config, workdir)` (`python -m launch.curate`): ingest -> validate (judge, Tables 5
and 7) -> stratify (weak model pass@k, Table 8) -> synthesize (teacher + sandbox splice, Tables 8
and 9) -> rule filters -> cross-validation (verifier) -> SFT JSONL + TFDS + report. Modules:
`templates.py` (the prompt templates), `endpoints.py` (roles, concurrency, retries, cache),
`stagefile.py` (resumable JSONL stages), `stages.py`, `splice.py`, `filters.py`, `scripted.py`
(the toy world's stand-in teacher/judge/verifier server), `report.py`.
"""
