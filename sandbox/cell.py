"""The session's holder process and the forked child that runs one cell.

Everything here runs as the session's unprivileged uid, inside its namespaces and Landlock domain,
and is *untrusted* once the first cell has run: user code can rewrite any of it. The supervisor
therefore treats what comes out of here as data, enforces the time limit itself, and only trusts
the kernel (exit statuses, /proc) for what it kills or keeps.

Atomicity comes from fork: the holder forks a child per cell; on success the child reports "ok"
and becomes the next holder (the supervisor then kills the old one), on failure the child is
discarded and the untouched holder serves the next cell.
"""

from __future__ import annotations

import base64
import builtins
import ctypes
import fcntl
import gc
import io
import linecache
import os
import random
import resource
import signal
import stat
import sys
import threading
import time
import traceback

from sandbox import figures, isolation, seccomp, wire

WORKDIR = "/tmp/work"  # inside the session's private tmpfs; the cwd of every cell

# Own references, taken before any user code runs, so that `os.fork = None` in a cell breaks
# nothing here. (User code can still reach these through gc; that only harms its own session.)
_exit, _getpid, _waitpid, _dup2 = os._exit, os.getpid, os.waitpid, os.dup2
_close, _write, _open = os.close, os.write, os.open
# The holder forks each cell with fork(2) itself, not os.fork(): CPython's after-fork work in the
# child (lock re-initialisation for threads that do not exist here: a successful cell must end
# its threads, so the holder is single-threaded when it forks) and the handlers libraries
# register with os.register_at_fork cost ~1 ms and ~200 page copies per cell, and those
# handlers are for two processes that both go on, while of holder and cell only one ever runs
# (and they changed what a cell sees: `random` reseeded itself in every cell, so random.seed()
# in one cell did not carry over to the next, unlike every other piece of state). The one that
# matters here, matplotlib's (fonts read through a file offset the cell shares with the holder),
# is covered at its root by _after_fork_in_cell. PyDLL keeps the GIL held through the call,
# so both processes come back holding it, as after os.fork().
_libc = ctypes.PyDLL(None, use_errno=True)
_raw_fork = _libc.fork
_raw_fork.restype, _raw_fork.argtypes = ctypes.c_int, []


def _fork() -> int:
    if _single_threaded is False:
        return os.fork()  # (never seen) a first holder with threads: CPython must tidy up after them
    pid = _raw_fork()
    if pid < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return pid


_single_threaded: bool | None = None  # of the first holder; later holders are checked per cell


# Status flags a reopened description keeps (open(2) drops O_CREAT, O_EXCL, O_TRUNC, O_NOCTTY).
_KEEP_FLAGS = (os.O_ACCMODE | os.O_APPEND | os.O_NONBLOCK | os.O_DSYNC | os.O_SYNC
               | getattr(os, "O_DIRECT", 0) | getattr(os, "O_NOATIME", 0))


def _after_fork_in_cell() -> None:
    """Every regular file the holder has open gets a description of its own in the cell (same
    file, flags and offset, reopened through /proc/self/fd): a failed cell's reads, writes and
    seeks then move only its own offsets, never the holder's. That covers file objects the
    namespace keeps across cells and the font files matplotlib keeps open in its font cache
    (whose at-fork handler used to drop the cache in every cell for this reason). A file that
    can no longer be opened so (its mode changed since) stays shared, as before."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return
    for name in names:
        fd = int(name)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                continue  # pipes, sockets, devices: nothing to reopen
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            if flags & os.O_PATH:
                continue  # a reopened O_PATH descriptor would be readable
            inheritable = not fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
            pos = os.lseek(fd, 0, os.SEEK_CUR)
            new = os.open(f"/proc/self/fd/{fd}", (flags & _KEEP_FLAGS) | os.O_CLOEXEC)
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor) or not permitted
        try:
            nst = os.fstat(new)
            if (nst.st_dev, nst.st_ino) == (st.st_dev, st.st_ino):
                os.lseek(new, pos, os.SEEK_SET)
                os.dup2(new, fd, inheritable=inheritable)
        except OSError:
            pass
        finally:
            os.close(new)


def holder_main(sock, cfg: dict, landlock_rules: list | None, landlock_abi: int) -> None:
    """First holder of a session; never returns."""
    isolation.set_process_name("sbx-holder")
    devnull = _open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        _dup2(devnull, fd)
    _close(devnull)
    keep = sock.fileno()
    os.closerange(3, keep)
    os.closerange(keep + 1, 65536)
    os.chdir(WORKDIR)
    os.environ.clear()
    os.environ.update(PATH="/usr/local/bin:/usr/bin:/bin", HOME=WORKDIR, TMPDIR="/tmp",
                      LANG="C.UTF-8", MPLBACKEND="Agg", OPENBLAS_NUM_THREADS="1",
                      OMP_NUM_THREADS="1")
    isolation.lower_rlimit(resource.RLIMIT_NOFILE, cfg["max_open_files"])
    isolation.lower_rlimit(resource.RLIMIT_NPROC, cfg["max_processes"])
    isolation.lower_rlimit(resource.RLIMIT_FSIZE, cfg["disk_mb"] << 20)
    isolation.lower_rlimit(resource.RLIMIT_CORE, 0)
    isolation.prctl(isolation.PR_SET_DUMPABLE, 1)
    if landlock_rules is not None:
        isolation.landlock_restrict(landlock_rules, landlock_abi)
    else:
        isolation.prctl(isolation.PR_SET_NO_NEW_PRIVS, 1)
    if cfg.get("seccomp"):
        seccomp.install()
    _set_oom_score_adj(HOLDER_OOM_SCORE_ADJ)
    # Every session is forked from the same zygote: without this, all would draw the same numbers.
    random.seed(os.urandom(32))
    import cv2
    import numpy as np
    np.random.seed(int.from_bytes(os.urandom(4), "little"))
    cv2.setRNGSeed(int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF)
    figures.install(cfg["max_images"], cfg["max_image_pixels"])
    for sig in signal.valid_signals():
        try:
            _signals[sig] = signal.getsignal(sig)
        except (ValueError, OSError):
            pass
    global _single_threaded
    _single_threaded = len(os.listdir("/proc/self/task")) == 1
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    _holder_loop(sock, namespace, cfg)


# Under memory pressure in the session's cgroup the kernel kills the highest score first: the cell
# (1000), then the holder with the state, never first the supervisor (inherited 0). Raising one's
# own score needs no privilege; writing it needs /proc writable in Landlock (see supervisor).
CELL_OOM_SCORE_ADJ, HOLDER_OOM_SCORE_ADJ = 1000, 300
_signals: dict = {}  # the holder's signal dispositions, put back after every successful cell


def _set_oom_score_adj(value: int) -> None:
    try:
        fd = _open("/proc/self/oom_score_adj", os.O_WRONLY)
        try:
            _write(fd, str(value).encode())
        finally:
            _close(fd)
    except OSError:
        pass


def _reap_strays() -> None:
    """Reap the holder's exited children: processes an earlier cell started (this holder was that
    cell) and the supervisor killed after it. Left as zombies they would stay in the session's /proc
    for as long as this holder lives (issue 49)."""
    while True:
        try:
            pid, _ = _waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _holder_loop(sock, namespace: dict, cfg: dict) -> None:
    while True:
        try:
            msg, fds = wire.recv_sock(sock, max_fds=3)
        except (wire.FrameError, OSError):
            _exit(0)  # the supervisor is gone
        if msg.get("op") != "run" or len(fds) != 3:
            for fd in fds:
                _close(fd)
            continue
        res_w, out_w, err_w = fds
        _reap_strays()
        pid = _fork()  # raises when it cannot: the holder dies and the session is reported lost
        if pid == 0:
            try:
                _after_fork_in_cell()
            except Exception:  # noqa: BLE001 - a cell that broke `os` broke its own session only
                pass
            if _run_cell(msg, namespace, cfg, res_w, out_w, err_w):
                continue  # this process is now the holder
            _exit(0)
        _close(out_w)
        _close(err_w)
        try:
            _, status = _waitpid(pid, 0)
        except ChildProcessError:
            status = -1
        try:
            wire.write_fd(res_w, {"kind": "exit", "pid": pid, "wait_status": status})
        except OSError:
            pass  # the supervisor already decided (timeout, or it read the child's result)
        _close(res_w)


def _streams():
    # New ones per cell: a cell that closes or replaces sys.stdout must not break the next one.
    return tuple(io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8",
                                  errors="backslashreplace", line_buffering=True,
                                  write_through=True) for fd in (1, 2))


def _run_cell(msg, namespace, cfg, res_w, out_w, err_w) -> bool:
    me = _getpid()
    isolation.set_process_name("sbx-cell")
    _dup2(out_w, 1)
    _dup2(err_w, 2)
    _close(out_w)
    _close(err_w)
    _set_oom_score_adj(CELL_OOM_SCORE_ADJ)
    # Soft limits only, so the next holder can lift them again; the cgroup is the hard bound.
    as_soft = isolation.vm_size_bytes() + (cfg["memory_mb"] << 20)
    resource.setrlimit(resource.RLIMIT_AS, (as_soft, resource.getrlimit(resource.RLIMIT_AS)[1]))
    cpu_soft = int(cfg["timeout_s"]) + 2
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_soft, resource.getrlimit(resource.RLIMIT_CPU)[1]))
    sys.stdout, sys.stderr = _streams()
    sys.__stdout__, sys.__stderr__ = sys.stdout, sys.stderr
    sys.stdin = sys.__stdin__ = open(os.devnull)
    figures.reset()
    before = figures.scan_images(WORKDIR)
    code = msg.get("code", "")
    name = f"<cell {msg.get('n', 0)}>"
    linecache.cache[name] = (len(code), None, code.splitlines(True), name)
    status = "ok"
    try:
        exec(compile(code, name, "exec"), namespace)
    except SystemExit as e:
        status = "error"
        _say(f"SystemExit: the cell called exit({e.code!r}); exiting is disabled in the sandbox, "
             "the cell was discarded and the state rolled back\n")
    except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt from user code is an error too
        status = "error"
        _say("".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next)))
    if _getpid() != me:
        _exit(0)  # a process forked by the cell reached its end; only the cell child reports
    if status == "ok":
        status = _threads_finished()
    try:
        images, notes = figures.collect(WORKDIR, before)
    except Exception as e:  # noqa: BLE001
        images, notes = [], [f"[sandbox] images could not be collected: {e!r}"]
    for note in notes:
        _say(note + "\n")
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except Exception:  # noqa: BLE001
            pass
    # The supervisor may have closed the result pipe already: it took a frame the cell forged
    # as this cell's result (then this process is the next holder and must go on as one), or it
    # timed the cell out (then it kills us anyway). A closed pipe is no reason to die here.
    for png in images:
        # One frame per image: a few large images together would exceed the frame cap.
        try:
            wire.write_fd(res_w, {"kind": "image", "png": base64.b64encode(png).decode()})
        except wire.FrameError:
            _say("[sandbox] an image too large to return was dropped\n")
        except OSError:
            break
    if status == "ok":
        _reset_process_state()
    try:
        wire.write_fd(res_w, {"kind": "result", "status": status, "pid": me})
    except OSError:
        pass
    if status != "ok":
        return False
    devnull = _open(os.devnull, os.O_RDWR)
    _dup2(devnull, 1)
    _dup2(devnull, 2)
    _close(devnull)
    _close(res_w)
    for which in (resource.RLIMIT_AS, resource.RLIMIT_CPU):
        hard = resource.getrlimit(which)[1]
        resource.setrlimit(which, (hard, hard))
    # Now the holder, off the cell's clock: collect this cell's cyclic garbage (figures closed
    # by plt.close are cycles), then freeze what is left, so that the garbage collector of the
    # next cells never walks (and so copies on write) the pages of everything kept so far.
    gc.collect()
    gc.freeze()
    isolation.set_process_name("sbx-holder")
    return True


def _threads_finished() -> str:
    """A cell's threads end with it: non-daemon Python threads are joined (as at interpreter
    exit; the supervisor's time limit bounds the wait), and any thread still alive then (daemon
    or started from C) makes the cell fail, so that nothing keeps running in the next holder
    (mutating a namespace that may be rolled back, racing the file walk, burning CPU)."""
    main = threading.main_thread()
    for t in threading.enumerate():
        if t is not main and not t.daemon:
            try:
                t.join()
            except Exception:  # noqa: BLE001
                pass
    # A joined thread's OS thread may take a moment to exit after its Python part is done.
    for attempt in range(200):
        try:
            n = len(os.listdir("/proc/self/task"))
        except OSError:
            n = threading.active_count()
        if n <= 1:
            return "ok"
        if attempt == 0 and threading.active_count() > 1:
            break  # a daemon thread is still alive: no point in waiting
        time.sleep(0.001)
    _say(f"[sandbox] the cell left {n - 1} thread(s) running (daemon threads or threads started "
         "from C); a cell's threads must finish before it ends. The cell was discarded and the "
         "state rolled back\n")
    return "error"


def _reset_process_state() -> None:
    """What a successful cell changed in its process that would break the next cells."""
    for which in (signal.ITIMER_REAL, signal.ITIMER_VIRTUAL, signal.ITIMER_PROF):
        signal.setitimer(which, 0)  # a pending alarm would kill the holder later
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    try:
        signal.set_wakeup_fd(-1)
    except (ValueError, OSError):
        pass
    for sig, handler in _signals.items():
        try:
            if signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)
        except (ValueError, OSError, TypeError):
            pass
    _set_oom_score_adj(HOLDER_OOM_SCORE_ADJ)


def _say(text: str) -> None:
    data = text.encode("utf-8", "backslashreplace")
    while data:
        try:
            n = _write(2, data)
        except OSError:
            return
        data = data[n:]
