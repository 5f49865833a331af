"""Agent mode: a whole CodeDance rollout (think -> code -> sandbox -> observation ...) behind one call.

A worker thread owns a `SandboxPool` (created in that thread: the sandbox's parent-death signal is
per thread) and starts one thread per agent request, which runs `RolloutEngine.rollout` on that
request alone (its n choices batched), at most `max_running` at once. So a request never waits
behind another request's slow cells (a cell may take the sandbox's whole timeout): its rollout
decodes while the other's row sits in the sandbox. The cost: agent requests do not share decode
calls with each other. The engine's turn loop is the one the evaluation and GRPO use: the reply is
exactly what `launch.eval` would have produced for the prompt, whatever else is running. Chat
requests are not blocked by agent rollouts: they run in the chat batcher's own thread. A client
that hangs up does not stop its rollout (the engine has no cancel); it ends within its budgets.

The last user message's text is wrapped in the paper's RL template (`Question: ...` + the code
instructions, SPEC §2) unless the request sends `"agent_template": false`.
"""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import io
import logging
import queue
import threading

import numpy as np

from codedance_jax.protocol import rl_question
from codedance_jax.rollout import Prompt, RolloutConfig, RolloutEngine, SamplingConfig

log = logging.getLogger(__name__)


def wrap_question(text: str, turn_format: str = "code") -> str:
    return rl_question(text, turn_format)


@dataclasses.dataclass(frozen=True)
class AgentSettings:
    greedy: bool
    temperature: float
    top_p: float
    seed: int
    max_turns: int
    max_tokens: int


@dataclasses.dataclass
class AgentJob:
    prompt: Prompt
    settings: AgentSettings
    n: int
    future: concurrent.futures.Future
    script: tuple[str, ...] = ()  # assistant turns forced in order (replay); the model samples after them


class AgentWorker:
    """`submit(prompt, settings, n) -> Future[list[dict]]` (one result per choice, see `result_of`)."""

    def __init__(self, model, processor, *, max_context: int, decode_chunk: int = 16, sandbox_workers: int = 2,
                 sandbox_timeout_s: float = 15.0, turn_format: str = "code", max_cached_engines: int = 4,
                 max_running: int = 8, mesh=None):
        self.model, self.processor = model, processor
        self.mesh = mesh  # the sampling mesh the model is placed for (each engine's rows split over its `data`)
        self.max_context, self.decode_chunk = max_context, decode_chunk
        self.sandbox_workers, self.sandbox_timeout_s = sandbox_workers, sandbox_timeout_s
        self.turn_format = turn_format
        self.jobs: queue.Queue[AgentJob | None] = queue.Queue()
        self._engines: dict[AgentSettings, RolloutEngine] = {}
        self._engines_lock = threading.Lock()
        self._max_cached = max_cached_engines
        self._running = threading.BoundedSemaphore(max_running)  # rollouts at once (each holds a KV cache)
        self._runners: set[threading.Thread] = set()
        self._thread = threading.Thread(target=self._run, name="codedance-agent", daemon=True)
        self._ready = threading.Event()
        self.pool = None
        self.pool_error: str | None = None

    def start(self):
        self._thread.start()

    def close(self):
        self.jobs.put(None)
        self._thread.join(timeout=30)

    def submit(self, prompt: Prompt, settings: AgentSettings, n: int, script=()) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.jobs.put(AgentJob(prompt, settings, n, fut, tuple(script)))
        return fut

    # ------------------------------------------------------------------ worker thread
    def _run(self):
        try:
            from sandbox import SandboxPool

            self.pool = SandboxPool(num_workers=self.sandbox_workers, timeout_s=self.sandbox_timeout_s)
        except Exception as e:  # noqa: BLE001 - the server still serves chat; agent calls report this
            self.pool_error = f"{type(e).__name__}: {e}"
            log.warning("agent mode has no sandbox: %s", self.pool_error)
        try:
            while True:
                job = self.jobs.get()
                if job is None:
                    return
                self._running.acquire()
                t = threading.Thread(target=self._run_one, args=(job,), name="codedance-agent-rollout", daemon=True)
                self._runners.add(t)
                t.start()
        finally:
            for t in list(self._runners):  # the pool must outlive the rollouts using it
                t.join(timeout=30)
            if self.pool is not None:
                try:
                    self.pool.close()
                except Exception:  # noqa: BLE001 - shutting down
                    pass

    def _run_one(self, job: AgentJob):
        try:
            self._rollout(job)
        finally:
            self._runners.discard(threading.current_thread())
            self._running.release()

    def _engine(self, s: AgentSettings) -> RolloutEngine:
        with self._engines_lock:  # engines are shared by concurrent rollouts (a call keeps its state apart)
            eng = self._engines.get(s)
            return eng if eng is not None else self._new_engine(s)

    def _new_engine(self, s: AgentSettings) -> RolloutEngine:
        if len(self._engines) >= self._max_cached:
            self._engines.pop(next(iter(self._engines)))
        buckets = tuple(b for b in (256, 512, 1024, 2048, 4096, 8192, 16384) if b < self.max_context)
        buckets += (self.max_context,)  # every prompt that passed the context check has a bucket
        cfg = RolloutConfig.eval(
            turn_format=self.turn_format, max_turns=s.max_turns, max_turn_tokens=min(1024, s.max_tokens),
            max_new_tokens=s.max_tokens, max_total_tokens=self.max_context, decode_chunk=self.decode_chunk,
            prompt_buckets=buckets, batch_multiple=1 if self.mesh is None else int(self.mesh.shape["data"]))
        sampling = SamplingConfig(temperature=1.0 if s.greedy else s.temperature, top_p=s.top_p,
                                  greedy=s.greedy, seed=s.seed)
        self._engines[s] = RolloutEngine(self.model, self.processor, cfg, sampling, mesh=self.mesh)
        return self._engines[s]

    def _rollout(self, job: AgentJob):
        try:
            if self.pool is None:
                raise RuntimeError(f"agent mode needs the code sandbox, which failed to start: {self.pool_error}")
            eng = self._engine(job.settings)

            def script(row: int, turn: int) -> str | None:
                return job.script[turn] if turn < len(job.script) else None

            trajs, _ = eng.rollout([job.prompt], group_size=job.n, sandbox=self.pool,
                                   script=script if job.script else None)
            job.future.set_result([result_of(t, self.processor) for t in trajs])
        except Exception as e:  # noqa: BLE001 - the request gets the error; the worker goes on
            log.exception("agent rollout failed")
            if not job.future.done():
                job.future.set_exception(e)


def result_of(traj, processor) -> dict:
    """The reply (the `<answer>` if any, else the last turn's text) and the trajectory as JSON."""
    toks = np.asarray(traj.tokens)
    tids = np.asarray(traj.turn_ids)
    n_prompt_images = len(traj.images) - sum(t.get("n_images", 0) for t in traj.turns)
    img = n_prompt_images
    turns = []
    for m, t in enumerate(traj.turns):
        text = processor.decode(toks[tids == m].tolist(), skip_special_tokens=True)
        ims = traj.images[img : img + t.get("n_images", 0)]
        img += len(ims)
        turns.append({"text": text, "code": t.get("code"), "status": t.get("status"),
                      "observation": t.get("observation") or "", "images": [_data_url(im) for im in ims]})
    final = traj.answer if traj.answer is not None else (turns[-1]["text"] if turns else "")
    sampled = int(np.sum(np.asarray(traj.loss_mask)))
    return {
        "content": final,
        "finish_reason": "stop" if traj.finish_reason in ("answer", "stop") else "length",
        "completion_tokens": sampled,
        "prompt_tokens": int(traj.prompt_len),
        "trajectory": {"answer": traj.answer, "finish_reason": traj.finish_reason, "turns": turns,
                       "num_tool_calls": traj.num_tool_calls, "turn_status": list(traj.turn_status),
                       "response": traj.response_text(processor), "error": traj.error},
    }


def _data_url(im) -> str:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
