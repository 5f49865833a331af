"""The trainer-side API: `SandboxPool` and `Session` (SPEC section 3).

This side never runs user code and never unpickles anything: it talks JSON frames to the zygote
and to each session's supervisor. Cells of one session run in order; cells of different sessions
run concurrently, at most `num_workers` at a time.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import fcntl
import itertools
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
import weakref

from sandbox import wire
from sandbox.result import ExecResult

log = logging.getLogger("sandbox")

_GRACE_S = 10.0  # how long past its own limit a supervisor may take before we kill the session
_UID_BASE = 200_000  # session uids: unused on these machines; the zygote gives each live session
# its own from a range of 1000 per pool
_UID_BLOCKS = 100  # pools that can live on one host at once (uids 200000..299999)
_UID_LOCK_DIR = "/run/codedance-sandbox" if os.path.isdir("/run") else "/tmp/codedance-sandbox"


def _claim_uid_block() -> tuple[int, int]:
    """(lock fd, first uid) of a uid range no other live pool on this host holds.

    Two pools sharing uids would give sessions of one a uid of the other's (the kernel keeps
    per-uid state such as keyrings), so each pool holds an flock on its block's file for its
    lifetime; a crashed pool's lock goes with its process. Tried from pid % blocks upwards."""
    d = _UID_LOCK_DIR
    os.makedirs(d, mode=0o700, exist_ok=True)
    start = os.getpid() % _UID_BLOCKS
    for i in range(_UID_BLOCKS):
        k = (start + i) % _UID_BLOCKS
        fd = os.open(os.path.join(d, f"uids-{k}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return fd, _UID_BASE + k * 1000
    raise SandboxError(f"all {_UID_BLOCKS} sandbox uid ranges are held by live pools on this host "
                       f"(lock files in {d}); close a pool first")
_req_counter = itertools.count()


class SandboxError(RuntimeError):
    """The pool could not start, or a session could not be created."""


class SandboxUnavailable(SandboxError):
    """This machine cannot run the sandbox as set up (not root): a user's fix, not a bug; the
    launchers report it in one line and exit 2."""

    fix = "run as root (in a container if need be): the sandbox creates namespaces, mounts and cgroups"


class SandboxPool:
    """A warm zygote process plus the sessions forked from it.

    num_workers: cells that may run at the same time (across sessions).
    timeout_s: wall-clock limit per cell, enforced from outside the cell.
    memory_mb: memory of a whole session (holder, cell, its children, its files in tmpfs).
    Keyword-only limits: max_output_bytes (per stream), disk_mb (the session's tmpfs),
    max_files (inodes in it), max_open_files, max_processes, max_images and max_image_pixels
    (per cell), cpus_per_session (CFS quota), spare_sessions (sessions the zygote keeps set up
    ahead of demand so that `new_session` only hands one over; default min(num_workers, 4)).
    """

    def __init__(self, num_workers: int = 4, timeout_s: float = 15.0, memory_mb: int = 2048, *,
                 max_output_bytes: int = 65536, disk_mb: int = 256, max_files: int = 4096,
                 max_open_files: int = 256, max_processes: int = 64, max_images: int = 8,
                 max_image_pixels: int = 4_000_000, cpus_per_session: float = 1.0,
                 spare_sessions: int | None = None) -> None:
        if os.geteuid() != 0:
            raise SandboxUnavailable("the code sandbox needs root (it creates namespaces, mounts and cgroups "
                                     "for each session)")
        if num_workers < 1 or timeout_s <= 0 or memory_mb < 64:
            raise ValueError(f"need num_workers >= 1, timeout_s > 0 and memory_mb >= 64; got "
                             f"{num_workers}, {timeout_s}, {memory_mb}")
        self.timeout_s = float(timeout_s)
        self.config = dict(timeout_s=self.timeout_s, memory_mb=int(memory_mb),
                           max_output_bytes=max_output_bytes, disk_mb=disk_mb, max_files=max_files,
                           max_open_files=max_open_files, max_processes=max_processes,
                           max_images=max_images, max_image_pixels=max_image_pixels,
                           cpus_per_session=cpus_per_session)
        spares = min(num_workers, 4) if spare_sessions is None else int(spare_sessions)
        self._uid_lock, uid_base = _claim_uid_block()
        zcfg = dict(self.config, spare_sessions=spares, uid_base=uid_base)
        ours, theirs = socket.socketpair()
        pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        # No HOME or anything else of the trainer's: sessions can read this start-up environment.
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "MPLBACKEND": "Agg", "PYTHONPATH": pkg_parent,
               "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "PYTHONDONTWRITEBYTECODE": "1"}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "sandbox.zygote", str(theirs.fileno()), json.dumps(zcfg)],
            pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL, cwd="/")
        theirs.close()
        self._zygote = ours
        self._zlock = threading.Lock()
        # Weak: a session the trainer drops without close() is collected, and its finalizer
        # closes the life socket, which makes its anchor kill it.
        self._sessions: weakref.WeakSet[Session] = weakref.WeakSet()
        self._closed = False
        try:
            hello, _ = wire.recv_sock(ours)
        except wire.FrameError:
            self._proc.kill()
            os.close(self._uid_lock)
            raise SandboxError(f"the sandbox zygote exited during start-up (code "
                               f"{self._proc.wait()}); see its traceback above") from None
        if hello.get("op") != "hello":
            self._proc.kill()
            os.close(self._uid_lock)
            raise SandboxError(hello.get("error", f"unexpected zygote reply {hello}"))
        self.layers = hello["layers"]
        for layer, why in self.layers["missing"].items():
            log.warning("sandbox: running without %s (%s)", layer, why)
        self._executor = concurrent.futures.ThreadPoolExecutor(num_workers, "sandbox")
        self._slots = threading.BoundedSemaphore(num_workers)  # cells running at once
        atexit.register(self.close)

    def _spawn(self) -> tuple[dict, list[int]]:
        with self._zlock:
            if self._closed:
                raise SandboxError("the pool is closed")
            wire.send_sock(self._zygote, {"op": "spawn", "req": next(_req_counter)})
            reply, fds = wire.recv_sock(self._zygote, max_fds=2)
        if reply.get("op") != "spawned" or len(fds) != 2:
            for fd in fds:
                os.close(fd)
            raise SandboxError(reply.get("error", f"unexpected zygote reply {reply}"))
        return reply, fds

    def new_session(self, files: dict[str, bytes] | None = None) -> Session:
        """A fresh session whose working directory holds `files` (relative name -> bytes)."""
        sid = uuid.uuid4().hex[:12]
        reply, (sess_fd, life_fd) = self._spawn()
        ours = socket.socket(fileno=sess_fd)
        session = Session(self, sid, ours, socket.socket(fileno=life_fd))
        try:
            items = [(str(k), memoryview(v).cast("B")) for k, v in (files or {}).items()]
            # Raw bytes after the frame: no base64 or JSON for what may be megabytes of images.
            wire.send_sock(ours, {"op": "init", "files": [[k, v.nbytes] for k, v in items]})
            for _, v in items:
                ours.sendall(v)
            ours.settimeout(30.0)
            ready, _ = wire.recv_sock(ours)
            ours.settimeout(None)
        except (wire.FrameError, OSError) as e:
            ready = {"op": "failed", "error": f"the session died during set-up ({e})"}
        if ready.get("op") != "ready":
            session.close()
            raise SandboxError(ready.get("error", "session set-up failed"))
        self._sessions.add(session)
        return session

    def close(self) -> None:
        """Kill every session and the zygote; returns once no session process is left."""
        if self._closed:
            return
        for s in list(self._sessions):
            s.close()
        with self._zlock:
            self._closed = True
            self._zygote.close()  # the zygote kills what is left and exits on EOF
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        os.close(self._uid_lock)  # the uid range is free for the next pool
        self._executor.shutdown(wait=True, cancel_futures=True)
        atexit.unregister(self.close)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Session:
    """One trajectory's sandbox: a private working directory and a persistent namespace."""

    workdir = "/tmp/work"  # the cells' working directory, as seen from inside the sandbox

    def __init__(self, pool: SandboxPool, sid: str, sock: socket.socket,
                 life: socket.socket) -> None:
        self.pool, self.sid, self._sock, self._life = pool, sid, sock, life
        self._lock = threading.Lock()
        self._queue: collections.deque = collections.deque()
        self._busy = False
        self._closed = False
        self._dead: str | None = None
        self._finalizer = weakref.finalize(self, _close_sockets, sock, life)

    def execute(self, code: str) -> ExecResult:
        """Run one cell and wait for its result."""
        with self._lock:
            if self._closed:
                raise SandboxError(f"session {self.sid} is closed")
            inline = not self._busy
            if inline:
                self._busy = True
        if not inline:
            return self.submit(code).result()
        # Nothing queued: run it on the caller's thread (saves two thread hand-offs per cell).
        try:
            with self.pool._slots:
                return self._run(code)
        finally:
            self._next()

    def submit(self, code: str) -> concurrent.futures.Future:
        """Queue one cell; the future resolves to its ExecResult. Cells of a session run in
        submission order."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise SandboxError(f"session {self.sid} is closed")
            self._queue.append((code, fut))
            if not self._busy:
                self._busy = True
                self.pool._executor.submit(self._drain)
        return fut

    def _drain(self) -> None:
        with self._lock:
            code, fut = self._queue.popleft()
        if fut.set_running_or_notify_cancel():
            try:
                with self.pool._slots:
                    fut.set_result(self._run(code))
            except BaseException as e:  # noqa: BLE001 - the caller sees it on the future
                fut.set_exception(e)
        self._next()

    def _next(self) -> None:
        with self._lock:
            if self._queue:
                self.pool._executor.submit(self._drain)
            else:
                self._busy = False

    def _run(self, code: str) -> ExecResult:
        if self._dead:
            return ExecResult("crashed", "", f"[sandbox] session lost: {self._dead}", [], 0.0)
        t0 = time.monotonic()
        try:
            self._sock.settimeout(self.pool.timeout_s + _GRACE_S)
            wire.send_sock(self._sock, {"op": "run", "code": code})
            reply, _ = wire.recv_sock(self._sock)
        except (OSError, wire.FrameError) as e:
            timed_out = isinstance(e, TimeoutError)
            self._dead = ("its supervisor did not answer in time" if timed_out else
                          f"its supervisor went away ({e})")
            self._kill()
            return ExecResult("timeout" if timed_out else "crashed", "",
                              f"[sandbox] session lost: {self._dead}", [],
                              time.monotonic() - t0)
        try:
            return _parse_reply(reply, self._sock)
        except (OSError, wire.FrameError, ValueError, TypeError) as e:
            self._dead = f"its supervisor sent a malformed reply ({e})"
            self._kill()
            return ExecResult("crashed", "", f"[sandbox] session lost: {self._dead}", [],
                              time.monotonic() - t0)

    def memory_bytes(self) -> int | None:
        """Memory charged to this session's cgroup (None without the memory cgroup)."""
        with self._lock:
            if self._busy or self._closed:
                return None
            wire.send_sock(self._sock, {"op": "stats"})
            reply, _ = wire.recv_sock(self._sock)
        return reply.get("memory_bytes")

    def _kill(self) -> None:
        """Ask the session's anchor to kill it; returns once every process of it is gone (the
        anchor exits only then, which closes its end of the life socket)."""
        life = self._life
        try:
            life.settimeout(None)
            life.send(b"k")
            while life.recv(64):
                pass
        except OSError:
            pass  # the anchor is gone already (or the zygote, and with it every session)

    def close(self) -> None:
        """Kill the session's processes (returns once they are gone) and drop its files.
        Cells still queued are cancelled; a running one ends as "crashed"."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while self._queue:
                self._queue.popleft()[1].cancel()
        self._kill()
        self._finalizer()
        self.pool._sessions.discard(self)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_STATUSES = ("ok", "error", "timeout", "crashed")


def _parse_reply(reply: dict, sock: socket.socket) -> ExecResult:
    """A supervisor's reply frame, then the raw bytes of the images it lists."""
    sizes = reply.get("image_sizes", [])
    if not isinstance(sizes, list) or not all(isinstance(n, int) and 0 <= n <= wire.MAX_FRAME
                                              for n in sizes):
        raise ValueError("bad image list")
    images = []
    for n in sizes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = sock.recv_into(view[got:], n - got)
            if not k:
                raise wire.FrameError("the supervisor closed the channel mid-reply")
            got += k
        images.append(bytes(buf))
    status, stdout, stderr = reply.get("status"), reply.get("stdout"), reply.get("stderr")
    elapsed = reply.get("elapsed_s")
    if status not in _STATUSES or not isinstance(stdout, str) or not isinstance(stderr, str):
        raise ValueError(f"bad reply fields {sorted(reply)}")
    if not isinstance(elapsed, (int, float)):
        raise ValueError("bad elapsed_s")
    return ExecResult(status, stdout, stderr, images, float(elapsed))


def _close_sockets(*socks: socket.socket) -> None:
    for s in socks:
        try:
            s.close()
        except OSError:
            pass
