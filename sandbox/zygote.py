"""The pool's warm process: imports the heavy libraries once, then forks one session per request.

Started by `SandboxPool` with a scrubbed environment (a forked process can read the zygote's
start-up environment through /proc/self/environ, so nothing secret may be in it). Runs as root and
never runs user code. It exits, killing every session, when the pool's end of its socket closes,
which also happens when the trainer dies.

Requests (JSON frames): {"op": "spawn", "sid", "uid"} with the session's socket attached, answered
with the anchor and supervisor pids; {"op": "kill", "sid"}, answered once every process of that
session is gone.
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import socket
import struct
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
    import sandbox.cell  # noqa: F401  - everything the session side needs, imported before forks
    import sandbox.supervisor  # noqa: F401


def main() -> None:
    ctl = socket.socket(fileno=int(sys.argv[1]))
    cfg = json.loads(sys.argv[2])
    from sandbox import isolation, wire
    from sandbox.supervisor import anchor_main

    isolation.prctl(isolation.PR_SET_PDEATHSIG, signal.SIGKILL)
    _warm_up()
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

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    wire.send_sock(ctl, {"op": "hello", "layers": layers, "pid": os.getpid()})
    sessions: dict[str, dict] = {}
    by_anchor: dict[int, str] = {}

    def finished(sid: str) -> None:
        s = sessions.pop(sid)
        by_anchor.pop(s["anchor"], None)
        for d in s["cgroups"].values():
            try:
                os.rmdir(d)
            except OSError:
                pass

    def reap() -> None:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in by_anchor:
                finished(by_anchor[pid])

    try:
        while True:
            ready, _, _ = select.select([ctl, wake_r], [], [])
            if wake_r in ready:
                os.read(wake_r, 4096)
                reap()
            if ctl not in ready:
                continue
            try:
                msg, fds = wire.recv_sock(ctl, max_fds=1)
            except (wire.FrameError, OSError):
                return
            if msg.get("op") == "spawn" and len(fds) == 1:
                sid = msg["sid"]
                dirs = {}
                for ctl_name, base in bases.items():
                    dirs[ctl_name] = os.path.join(base, sid)
                    os.mkdir(dirs[ctl_name])
                spec = dict(cfg, uid=msg["uid"], cgroups=dirs, layers=layers)
                r, w = os.pipe()
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    for fd in (ctl.fileno(), wake_r, wake_w, r):
                        os.close(fd)
                    anchor_main(fds[0], w, spec)
                    os._exit(0)
                os.close(w)
                os.close(fds[0])
                data = b""
                while len(data) < 4:
                    try:
                        chunk = os.read(r, 4 - len(data))
                    except InterruptedError:
                        continue
                    if not chunk:
                        break
                    data += chunk
                os.close(r)
                spid = struct.unpack("i", data)[0] if len(data) == 4 else -1
                sessions[sid] = {"anchor": pid, "supervisor": spid, "cgroups": dirs}
                by_anchor[pid] = sid
                wire.send_sock(ctl, {"op": "spawned", "anchor": pid, "supervisor": spid})
            elif msg.get("op") == "kill":
                _kill(sessions.get(msg.get("sid")))
                reap()
                if msg.get("sid") in sessions:
                    finished(msg["sid"])
                wire.send_sock(ctl, {"op": "killed"})
            else:
                for fd in fds:
                    os.close(fd)
                wire.send_sock(ctl, {"op": "error", "error": f"unknown request {msg.get('op')!r}"})
    finally:
        for sid in list(sessions):
            _kill(sessions.get(sid))
            finished(sid)
        for base in bases.values():
            try:
                os.rmdir(base)
            except OSError:
                pass


def _kill(s: dict | None) -> None:
    """Kill a session's supervisor (pid 1 of its namespace: the kernel then kills the rest) and
    wait for its anchor, which exits only after the whole namespace is gone."""
    if s is None:
        return
    try:
        os.kill(s["supervisor"] if s["supervisor"] > 0 else s["anchor"], signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(s["anchor"], 0)
    except ChildProcessError:
        pass


if __name__ == "__main__":
    main()
