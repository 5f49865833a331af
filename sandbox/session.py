"""One session's process tree and its setup: the anchor, then the supervisor's namespaces and limits.

Process tree of a session (forked from the zygote, which runs as root and never runs user code):

    anchor    stays in the host pid namespace; reaps the supervisor; dies with the zygote;
    │         kills the session when the pool closes (or writes to) the session's life socket
    └ supervisor   pid 1 of a new pid/mount/net/ipc/uts namespace; sets up mounts and cgroups as
      │            root, then drops to the session uid and forks the holder (all of this may
      │            happen ahead of demand, see zygote.py), then writes the pool's input files;
      │            never runs user code, so it is trusted.
      └ holder     owns the session's namespace of variables; forks one child per cell
        └ cell     runs the user's code; on success it becomes the next holder

This module builds that tree (`anchor_main`, then the supervisor's setup); `sandbox.supervisor`
holds the loop that then runs the session's cells.
"""


from __future__ import annotations

import os
import resource
import select
import signal
import socket
import sys
import traceback

from sandbox import cell, isolation, rootfs, wire
from sandbox.supervisor import Supervisor
from sandbox.workdir import Snapshot


def anchor_main(sess_fd: int, life_fd: int, spec: dict) -> None:
    """Runs in the zygote's child: make the namespaces, fork the supervisor, then wait until it
    dies or the pool asks (a byte or EOF on the life socket) to kill the session. Exiting closes
    the life socket, which tells the pool that every process of the session is gone: the
    supervisor is pid 1 of the session's pid namespace, and the kernel reaps it only after every
    other process in that namespace is gone."""
    isolation.prctl(isolation.PR_SET_PDEATHSIG, signal.SIGKILL)
    isolation.set_process_name("sbx-anchor")
    flags = (isolation.CLONE_NEWPID | isolation.CLONE_NEWNS | isolation.CLONE_NEWIPC
             | isolation.CLONE_NEWUTS)
    if spec["layers"]["net"]:
        flags |= isolation.CLONE_NEWNET
    try:
        isolation.unshare(flags)
        pid = os.fork()
    except OSError as e:
        _fail(sess_fd, f"could not create the session's namespaces: {e}")
        os._exit(1)
    if pid == 0:
        os.close(life_fd)
        try:
            _supervisor_main(sess_fd, spec)
        except BaseException:  # noqa: BLE001 - report set-up failures to the pool, then die
            _fail(sess_fd, "session set-up failed:\n" + traceback.format_exc())
        os._exit(1)
    os.close(sess_fd)
    poller = select.poll()
    poller.register(life_fd, select.POLLIN)
    try:
        pidfd = os.pidfd_open(pid)  # our unreaped child: the pid cannot have been reused
        poller.register(pidfd, select.POLLIN)
    except (AttributeError, OSError):
        pidfd = None
    while True:
        try:
            events = poller.poll(None if pidfd is not None else 200)
        except InterruptedError:
            continue
        if any(fd == life_fd for fd, _ in events):
            os.kill(pid, signal.SIGKILL)
            break
        if events or pidfd is None and os.waitpid(pid, os.WNOHANG)[0]:
            break
    while True:
        try:
            os.waitpid(pid, 0)
            break
        except ChildProcessError:
            break
        except InterruptedError:
            continue
    os._exit(0)


def _fail(sess_fd: int, error: str) -> None:
    try:
        wire.write_fd(sess_fd, {"op": "failed", "error": error})
    except OSError:
        pass


def _join_cgroups(spec: dict) -> dict[str, int]:
    """Limit the whole session (supervisor, holder, cells) together; returns fds for reading."""
    fds = {}
    dirs = spec["cgroups"]
    if "memory" in dirs:
        d = dirs["memory"]
        isolation.write_file(f"{d}/memory.limit_in_bytes", str(spec["memory_mb"] << 20))
        isolation.write_file(f"{d}/cgroup.procs", "0")
        fds["oom"] = os.open(f"{d}/memory.oom_control", os.O_RDONLY)
        fds["usage"] = os.open(f"{d}/memory.usage_in_bytes", os.O_RDONLY)
    if "pids" in dirs:
        # Room for the supervisor and holder on top of what a cell may start.
        isolation.write_file(f"{dirs['pids']}/pids.max", str(spec["max_processes"] + 4))
        isolation.write_file(f"{dirs['pids']}/cgroup.procs", "0")
    if "cpu" in dirs:
        isolation.write_file(f"{dirs['cpu']}/cpu.cfs_period_us", "100000")
        isolation.write_file(f"{dirs['cpu']}/cpu.cfs_quota_us",
                             str(int(100000 * spec["cpus_per_session"])))
        isolation.write_file(f"{dirs['cpu']}/cgroup.procs", "0")
    return fds


def _receive_files(sock, listing, max_bytes: int) -> None:
    """The pool's input files: (name, size) pairs in the init frame, then their raw bytes."""
    if not isinstance(listing, list):
        raise ValueError("malformed file listing")
    total = 0
    paths = []
    for name, size in listing:
        norm = os.path.normpath(str(name))
        if os.path.isabs(norm) or norm.startswith("..") or norm == ".":
            raise ValueError(f"input file name {name!r} must be a relative path inside the "
                             "working directory")
        if not isinstance(size, int) or size < 0:
            raise ValueError(f"bad size for input file {name!r}")
        total += size
        paths.append((os.path.join(cell.WORKDIR, norm), size))
    if total > max_bytes:
        raise ValueError(f"input files of {total} bytes do not fit the session's "
                         f"{max_bytes >> 20} MB disk")
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    for path, size in paths:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        try:
            left = size
            while left:
                n = sock.recv_into(view, min(left, len(buf)))
                if not n:
                    raise wire.FrameError("the pool closed the channel while sending files")
                mv = view[:n]
                while mv:
                    mv = mv[os.write(fd, mv):]
                left -= n
        finally:
            os.close(fd)


def _landlock_rules(extra_rw: list) -> list:
    rw = ~0 & ((1 << 16) - 1)
    rules = [(p, isolation.READ_ONLY) for p in isolation.SYSTEM_READ_PATHS if p != "/proc"]
    # /proc is this session's own (pid namespace); writing it is how a process sets its own
    # oom_score_adj (cells 1000, the holder lower), which a read-only /proc silently prevented.
    rules.append(("/proc", isolation.READ_ONLY | isolation.FS_WRITE_FILE))
    rules += [(p, isolation.READ_ONLY) for p in isolation.python_read_paths()]
    rules += [("/tmp", rw), ("/dev/shm", rw), ("/dev/null", rw)]
    return rules + [(x, rw) for x in extra_rw]


def _supervisor_main(sess_fd: int, spec: dict) -> None:
    isolation.prctl(isolation.PR_SET_PDEATHSIG, signal.SIGKILL)
    isolation.set_process_name("sbx-supervisor")
    sock = socket.socket(fileno=sess_fd)
    uid = spec["uid"]
    cg = _join_cgroups(spec)  # before the new root: it has no /sys/fs/cgroup
    mirror = rootfs.build(spec, uid, isolation.python_read_paths())
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    try:
        isolation.join_new_session_keyring()  # owned by the session uid, empty
    except OSError:
        pass  # no keyrings in this kernel: nothing to leave
    # The file walk holds two descriptors per directory level and recurses once per level; the
    # tmpfs inode limit bounds both.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 4 * spec["max_files"] + 1000))
    isolation.prctl(isolation.PR_SET_DUMPABLE, 0)  # the holder shares our uid: no ptrace of us
    abi = spec["layers"]["landlock_abi"]
    holder_rules = _landlock_rules([]) if abi else None
    if abi:
        isolation.landlock_restrict(_landlock_rules([mirror]), abi)
    else:
        isolation.prctl(isolation.PR_SET_NO_NEW_PRIVS, 1)
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        sock.close()
        ours.close()
        cell.holder_main(theirs, spec, holder_rules, abi)
        os._exit(0)
    theirs.close()
    # Everything above can happen ahead of demand (a spare session); the pool's files come now.
    # They are written as the session's uid, before any user code runs.
    init, _ = wire.recv_sock(sock)
    _receive_files(sock, init.get("files", []), spec["disk_mb"] << 20)
    snapshot = Snapshot("/tmp", mirror)
    snapshot.sync()
    Supervisor(sock, ours, pid, spec, snapshot, cg).serve()
