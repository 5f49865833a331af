"""The session's filesystem: a fresh root that holds only what a session needs.

Runs in the supervisor, as root, in the session's new mount namespace, before it drops to the
session uid. The host's tree is replaced (pivot_root) by an empty tmpfs into which only the system
and interpreter trees, a few /etc files, four device nodes, a fresh /proc, a CPU-topology part of
/sys and the session's own tmpfs mounts are bound; every bound host tree is read-only.

This closes, whatever Landlock covers: host UNIX sockets reachable by path (Landlock has no rule
for `connect()` on a pathname socket), `utime`/`setxattr`/`chmod` on world-writable host files,
and the host's mount table in /proc/self/mountinfo (only the session's own mounts exist here).
"""

from __future__ import annotations

import os
import stat

from sandbox import isolation as m

WORKDIR = "/tmp/work"  # the cells' working directory (sandbox.cell.WORKDIR)

# Read-only trees and files a cell may see (missing ones are skipped; symlinks such as a
# merged-/usr /bin are recreated as symlinks).
SYSTEM_TREES = ["/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc/fonts",
                "/sys/devices/system/cpu"]
ETC_FILES = ["/etc/ld.so.cache", "/etc/localtime", "/etc/passwd", "/etc/group",
             "/etc/nsswitch.conf", "/etc/mime.types", "/etc/matplotlibrc"]
DEVICES = ["/dev/null", "/dev/zero", "/dev/urandom", "/dev/random"]
_COVERED = ("/tmp", "/dev/shm")  # the session's own tmpfs mounts


def _under_covered(path: str) -> bool:
    return any(path == c or path.startswith(c + "/") for c in _COVERED)


def _ro_bind(fd: int, target: str, nodev: bool = True) -> None:
    m.mount(f"/proc/self/fd/{fd}", target, None, m.MS_BIND | m.MS_REC)
    flags = m.MS_REMOUNT | m.MS_BIND | m.MS_RDONLY | m.MS_NOSUID | (m.MS_NODEV if nodev else 0)
    m.mount(None, target, None, flags)


def _nested(path: str, others: list[str]) -> bool:
    return any(path != o and path.startswith(o.rstrip("/") + "/") for o in others)


def build(spec: dict, uid: int, python_trees: list[str]) -> int:
    """Make the session's root; returns the directory fd of its detached file mirror."""
    m.mount(None, "/", None, m.MS_REC | m.MS_PRIVATE)
    trees = [t for t in SYSTEM_TREES + python_trees if os.path.lexists(t)]
    trees = [t for t in dict.fromkeys(trees) if not _nested(t, [x for x in trees
                                                                 if not os.path.islink(x)])]
    links = {t: os.readlink(t) for t in trees if os.path.islink(t)}
    # Handles on every source first: building the new root covers nothing of the host, but
    # mounting on a path that resolves through a symlink would land somewhere else.
    sources = [(t, os.open(t, os.O_PATH | os.O_CLOEXEC)) for t in trees if t not in links]
    files = [(f, os.open(f, os.O_PATH | os.O_CLOEXEC)) for f in ETC_FILES if os.path.exists(f)]
    devs = [(d, os.open(d, os.O_PATH | os.O_CLOEXEC)) for d in DEVICES if os.path.exists(d)]
    # The new root is a tmpfs mounted on a directory that every machine has, then entered with
    # pivot_root(".", "."), which needs no directory for the old root.
    stage = "/mnt" if os.path.isdir("/mnt") and not os.path.islink("/mnt") else "/tmp"
    m.mount("tmpfs", stage, "tmpfs", m.MS_NOSUID | m.MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    root_fd = os.open(stage, os.O_RDONLY | os.O_DIRECTORY)
    os.fchdir(root_fd)
    for t, target in links.items():
        os.makedirs("." + os.path.dirname(t), 0o755, exist_ok=True)
        os.symlink(target, "." + t)
    # An interpreter tree under /tmp (a CI checkout's venv) is bound after the session's tmpfs
    # covers /tmp, at the same path (file snapshots skip mount points).
    late = [(t, fd) for t, fd in sources if _under_covered(t)]
    for t, fd in sources:
        if (t, fd) not in late:
            os.makedirs("." + t, 0o755, exist_ok=True)
            _ro_bind(fd, "." + t)
    for f, fd in files + devs:
        os.makedirs("." + os.path.dirname(f), 0o755, exist_ok=True)
        os.close(os.open("." + f, os.O_WRONLY | os.O_CREAT, 0o644))
        _ro_bind(fd, "." + f, nodev=f not in DEVICES)
    for fd in [fd for t, fd in sources + files + devs if (t, fd) not in late]:
        os.close(fd)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"./dev/{name}")
    for d in ("proc", "tmp", "dev/shm"):
        os.makedirs("./" + d, 0o755, exist_ok=True)
    # Everything is mounted before pivot_root: afterwards the host's tree is detached, and a
    # bind from a detached mount fails (EINVAL).
    # A fresh /proc for the new pid namespace: it lists only this session's processes.
    m.mount("proc", "./proc", "proc", m.MS_NOSUID | m.MS_NODEV | m.MS_NOEXEC)
    opts = (f"size={spec['disk_mb']}m,nr_inodes={spec['max_files'] + 64},mode=0700,"
            f"uid={uid},gid={uid}")
    flags = m.MS_NOSUID | m.MS_NODEV
    m.mount("tmpfs", "./tmp", "tmpfs", flags, opts)
    mirror = os.open("./tmp", os.O_RDONLY | os.O_DIRECTORY)
    m.umount_detach("./tmp")  # now reachable only through `mirror`
    m.mount("tmpfs", "./tmp", "tmpfs", flags, opts)
    os.mkdir("." + WORKDIR, 0o755)
    os.chown("." + WORKDIR, uid, uid)
    m.mount("tmpfs", "./dev/shm", "tmpfs", flags | m.MS_NOEXEC, "size=64m,mode=1777")
    for t, fd in late:
        os.makedirs("." + t, 0o755, exist_ok=True)
        _ro_bind(fd, "." + t)
        os.close(fd)
    m.pivot_root(".", ".")
    m.umount_detach(".")  # the host's root, now stacked under ours
    os.chdir("/")
    os.close(root_fd)
    m.mount(None, "/", None, m.MS_REMOUNT | m.MS_RDONLY | m.MS_NOSUID | m.MS_NODEV)
    if not stat.S_ISDIR(os.fstat(mirror).st_mode):
        raise OSError("the file mirror is not a directory")
    return mirror
