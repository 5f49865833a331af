"""The pool's warm process: imports the heavy libraries once, then forks one session per request.

Started by `SandboxPool` with a scrubbed environment (a forked process can read the zygote's
start-up environment through /proc/self/environ, so nothing secret may be in it). Runs as root and
never runs user code. It exits, killing every session, when the pool's end of its socket closes,
which also happens when the trainer dies.

It keeps `spare_sessions` sessions ready ahead of demand: namespaces, mounts, cgroups, uid and
Landlock done and the holder forked, waiting only for the pool's input files. A session owns a
uid from a pool-wide range while it lives. Request (JSON frames): {"op": "spawn", "req"}, answered
with {"op": "spawned", "req", "anchor", "uid"} and two sockets attached: the session's (to its
supervisor) and its life socket (to its anchor, which kills the whole session and exits when that
socket closes or gets a byte; the pool sees EOF on it once every process of the session is gone).
"""

from __future__ import annotations

import collections
import gc
import json
import os
import pwd
import select
import signal
import socket
import sys


def _warm_up() -> None:
    import cv2
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import io

    import matplotlib.pyplot as plt
    from PIL import Image, ImageDraw, ImageFont  # noqa: F401

    cv2.setNumThreads(1)
    # Render once so that fonts, the Agg backend and the PNG encoder are loaded before forking.
    fig, ax = plt.subplots()
    ax.hist(np.random.rand(100), bins=10)
    ax.set_title("warm-up")
    fig.savefig(io.BytesIO(), format="png")
    plt.close(fig)
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(io.BytesIO(), format="PNG")
    import threading  # noqa: F401

    import sandbox.cell  # noqa: F401  - everything the session side needs, imported before forks
    import sandbox.rootfs  # noqa: F401
    import sandbox.seccomp  # noqa: F401
    import sandbox.session  # noqa: F401
    import sandbox.supervisor  # noqa: F401
    import sandbox.workdir  # noqa: F401


def _probe_seccomp() -> str | None:
    """Install the filter in a throwaway child and check that keyctl is refused there."""
    from sandbox import seccomp

    if not seccomp.supported():
        return "no syscall table for this architecture"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            seccomp.install()
            msg = b"" if seccomp.denies_keyctl() else b"the filter did not take effect"
        except OSError as e:
            msg = str(e).encode()[:200] or b"failed"
        os.write(w, msg)
        os._exit(0)
    os.close(w)
    msg = os.read(r, 256)
    os.close(r)
    os.waitpid(pid, 0)
    return msg.decode() or None


def main() -> None:
    ctl = socket.socket(fileno=int(sys.argv[1]))
    cfg = json.loads(sys.argv[2])
    from sandbox import isolation, wire
    from sandbox.session import anchor_main

    isolation.prctl(isolation.PR_SET_PDEATHSIG, signal.SIGKILL)
    isolation.set_process_name("sbx-zygote")
    try:
        isolation.join_new_session_keyring()  # nothing forked from here possesses the trainer's keys
    except OSError:
        pass
    # The pool passes no HOME (a forked process can read the start-up environment): matplotlib
    # finds its font cache under root's home from the password database instead.
    os.environ["HOME"] = pwd.getpwuid(os.getuid()).pw_dir
    _warm_up()
    del os.environ["HOME"]
    ns = isolation.probe_namespaces()
    layers = {"net": ns["net"] is None, "landlock_abi": isolation.landlock_abi(), "cgroups": {},
              "missing": {}}
    for name in ("pid+mount", "ipc+uts"):
        if ns[name] is not None:
            wire.send_sock(ctl, {"op": "fatal", "error": f"the kernel refused a {name} namespace "
                                 f"({ns[name]}); the sandbox cannot isolate sessions without it"})
            return
    if ns["net"] is not None:
        layers["missing"]["net namespace"] = f"{ns['net']}: cells can reach the network"
    sc = _probe_seccomp()
    layers["seccomp"] = sc is None
    if sc is not None:
        layers["missing"]["seccomp"] = (f"{sc}: cells keep keyrings, ptrace, bpf, perf events, "
                                        "io_uring, namespaces and every socket family")
    if not layers["landlock_abi"]:
        layers["missing"]["landlock"] = ("not supported by this kernel: cells can read any "
                                         "world-readable file and connect to TCP ports")
    bases = {}
    for ctl_name, d in isolation.own_cgroup_dirs().items():
        base = os.path.join(d, f"codedance-sandbox-{os.getpid()}")
        try:
            os.mkdir(base)
            bases[ctl_name] = base
        except OSError as e:
            layers["missing"][f"cgroup {ctl_name}"] = str(e)
    for ctl_name in ("memory", "pids", "cpu"):
        if ctl_name not in bases and f"cgroup {ctl_name}" not in layers["missing"]:
            layers["missing"][f"cgroup {ctl_name}"] = "no writable cgroup v1 hierarchy"
    layers["cgroups"] = bases
    gc.collect()
    gc.freeze()  # keeps forked sessions from copying pages just because the GC touched them
    isolation.collapse_anonymous_memory()  # cheaper forks for every session and cell (see there)

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    wire.send_sock(ctl, {"op": "hello", "layers": layers, "pid": os.getpid()})
    n_spares = max(0, int(cfg.get("spare_sessions", 0)))
    uid_base = int(cfg["uid_base"])
    # Least recently freed first: the kernel keeps a uid's keyrings after its last process.
    free_uids = collections.deque(range(uid_base, uid_base + _MAX_SESSIONS))
    spares: list[dict] = []      # set up up to the holder, waiting for the pool's files
    sessions: dict[int, dict] = {}  # anchor pid -> session (spare or handed to the pool)
    counter = 0

    def spawn() -> dict:
        """Fork the anchor of a new session; it sets itself up while we go on serving."""
        nonlocal counter
        if not free_uids:
            raise OSError(f"more than {_MAX_SESSIONS} live sessions")
        counter += 1
        key = f"s{counter}"
        dirs = {}
        for ctl_name, base in bases.items():
            dirs[ctl_name] = os.path.join(base, key)
            os.mkdir(dirs[ctl_name])
        uid = free_uids.popleft()
        spec = dict(cfg, uid=uid, cgroups=dirs, layers=layers, seccomp=layers["seccomp"])
        sess_pool, sess_sup = socket.socketpair()
        life_pool, life_anchor = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            # Only this session's own ends: a copy of another session's socket would keep that
            # session alive after the pool closed it.
            for fd in [ctl.fileno(), wake_r, wake_w, sess_pool.fileno(), life_pool.fileno()] + [
                    x.fileno() for s in spares for x in (s["sess"], s["life"])]:
                os.close(fd)
            anchor_main(sess_sup.detach(), life_anchor.detach(), spec)
            os._exit(0)
        sess_sup.close()
        life_anchor.close()
        s = {"anchor": pid, "uid": uid, "cgroups": dirs, "sess": sess_pool, "life": life_pool}
        sessions[pid] = s
        return s

    def finished(pid: int) -> None:
        s = sessions.pop(pid)
        for x in ("sess", "life"):
            if s.get(x) is not None:
                s[x].close()
        if s in spares:
            spares.remove(s)
        for d in s["cgroups"].values():
            try:
                os.rmdir(d)
            except OSError:
                pass
        free_uids.append(s["uid"])

    def reap() -> None:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in sessions:
                finished(pid)

    try:
        while True:
            idle = len(spares) < n_spares
            ready, _, _ = select.select([ctl, wake_r], [], [], 0 if idle else None)
            if wake_r in ready:
                os.read(wake_r, 4096)
                reap()
            if ctl not in ready:
                if idle:
                    try:
                        spares.append(spawn())
                    except OSError as e:
                        print(f"sandbox zygote: could not prepare a session: {e}",
                              file=sys.stderr)
                        n_spares = 0
                continue
            try:
                msg, fds = wire.recv_sock(ctl, max_fds=1)
            except (wire.FrameError, OSError):
                return
            for fd in fds:
                os.close(fd)
            req = msg.get("req")
            if msg.get("op") == "spawn":
                try:
                    s = spares.pop(0) if spares else spawn()
                except OSError as e:
                    wire.send_sock(ctl, {"op": "error", "req": req, "error": str(e)})
                    continue
                wire.send_sock(ctl, {"op": "spawned", "req": req, "anchor": s["anchor"],
                                     "uid": s["uid"]},
                               [s["sess"].fileno(), s["life"].fileno()])
                # The pool now holds the only other ends; the anchor watches its end.
                s["sess"].close()
                s["life"].close()
                s["sess"] = s["life"] = None
            else:
                wire.send_sock(ctl, {"op": "error", "req": req,
                                     "error": f"unknown request {msg.get('op')!r}"})
    finally:
        # Closing a spare's life socket makes its anchor kill the session and exit; the pool
        # holds the life sockets of the others, so their anchors are killed (their supervisors
        # follow by PDEATHSIG, taking their namespaces with them).
        for pid, s in sessions.items():
            if s.get("life") is None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for x in ("sess", "life"):
                if s.get(x) is not None:
                    s[x].close()
                    s[x] = None
        for pid in list(sessions):
            _wait(pid)
            finished(pid)
        for base in bases.values():
            try:
                os.rmdir(base)
            except OSError:
                pass


_MAX_SESSIONS = 1000  # uids per pool, one per live session


def _wait(pid: int) -> None:
    while True:
        try:
            os.waitpid(pid, 0)
            return
        except ChildProcessError:
            return
        except InterruptedError:
            continue


if __name__ == "__main__":
    main()
