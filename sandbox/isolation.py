"""Kernel isolation layers as small functions: namespaces, mounts, cgroups v1, Landlock, rlimits.

Only the zygote side (root, before any user code) calls the privileged ones. Each layer that may be
missing on a machine has a probe, so the pool can report once what it runs without.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import resource
import struct
import sys

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                        ctypes.c_ulong]

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2

PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38


def _check(ret: int, what: str) -> int:
    if ret < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
    return ret


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def mount(src: str | None, target: str, fstype: str | None, flags: int = 0,
          data: str | None = None) -> None:
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    _check(_libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def umount_detach(target: str) -> None:
    _check(_libc.umount2(target.encode(), MNT_DETACH), f"umount {target}")


def prctl(option: int, arg: int) -> None:
    _check(_libc.prctl(option, arg, 0, 0, 0), f"prctl({option})")


_PR_SET_NAME = 15


def set_process_name(name: str) -> None:
    """The name ps, top and perf show (15 bytes): tells a session's processes apart."""
    buf = ctypes.create_string_buffer(name.encode()[:15])
    _libc.prctl(_PR_SET_NAME, ctypes.addressof(buf), 0, 0, 0)


# (keyctl, pivot_root) by architecture; glibc has no wrapper for either.
_NR_KEYCTL, _NR_PIVOT_ROOT = {"aarch64": (219, 41)}.get(platform.machine(), (250, 155))
_KEYCTL_JOIN_SESSION_KEYRING = 1


def join_new_session_keyring() -> None:
    """Leave the inherited session keyring (the trainer's) for a fresh anonymous one, so that
    keys the trainer holds are not possessed here even where seccomp is missing."""
    _check(_libc.syscall(_NR_KEYCTL, _KEYCTL_JOIN_SESSION_KEYRING, None), "keyctl(join)")


def pivot_root(new_root: str, put_old: str) -> None:
    _check(_libc.syscall(_NR_PIVOT_ROOT, new_root.encode(), put_old.encode()), "pivot_root")


# --- cgroups v1 -------------------------------------------------------------------------------

CGROUP_ROOT = "/sys/fs/cgroup"


def own_cgroup_dirs() -> dict[str, str]:
    """Writable v1 directories of this process for memory, pids and cpu (the ones we limit).

    Groups are created under our own group, never at the hierarchy root of a controller that put
    us somewhere else (see SANDBOX-NOTES)."""
    out = {}
    try:
        lines = open("/proc/self/cgroup").read().splitlines()
    except OSError:
        return out
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for ctl in controllers.split(","):
            if ctl in ("memory", "pids", "cpu"):
                d = os.path.join(CGROUP_ROOT, ctl, path.lstrip("/"))
                if os.path.isdir(d) and os.access(d, os.W_OK):
                    out[ctl] = d
    return out


def write_file(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


# --- Landlock ----------------------------------------------------------------------------------

_SYS_CREATE, _SYS_ADD, _SYS_RESTRICT = 444, 445, 446
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_TRUNCATE, FS_IOCTL_DEV = 1 << 14, 1 << 15
_FS_BITS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1,
                   5: (1 << 16) - 1}
_FILE_ONLY = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV
READ_ONLY = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
NET_BIND_TCP, NET_CONNECT_TCP = 1, 2
SCOPE_ABSTRACT_UNIX, SCOPE_SIGNAL = 1, 2


def landlock_abi() -> int:
    ret = _libc.syscall(_SYS_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return ret if ret > 0 else 0


def landlock_restrict(rules: list[tuple[str | int, int]], abi: int) -> None:
    """Allow only `rules` (path or O_PATH fd, access bits) from now on, for this process and its
    future children. Missing paths are skipped (a distribution may lack /lib64)."""
    fs_all = _FS_BITS_BY_ABI.get(abi, (1 << 16) - 1)
    net = NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0
    scoped = SCOPE_ABSTRACT_UNIX | SCOPE_SIGNAL if abi >= 6 else 0
    attr = struct.pack("QQQ", fs_all, net, scoped)
    size = 24 if abi >= 6 else (16 if abi >= 4 else 8)
    buf = ctypes.create_string_buffer(attr, len(attr))
    rfd = _check(_libc.syscall(_SYS_CREATE, buf, ctypes.c_size_t(size), ctypes.c_uint32(0)),
                 "landlock_create_ruleset")
    try:
        for target, access in rules:
            own = isinstance(target, str)
            try:
                fd = os.open(target, os.O_PATH | os.O_CLOEXEC) if own else target
            except FileNotFoundError:
                continue
            try:
                import stat
                if not stat.S_ISDIR(os.fstat(fd).st_mode):
                    access &= _FILE_ONLY
                rule = ctypes.create_string_buffer(struct.pack("=Qi", access & fs_all, fd), 12)
                _check(_libc.syscall(_SYS_ADD, ctypes.c_int(rfd), ctypes.c_int(1), rule,
                                     ctypes.c_uint32(0)), f"landlock_add_rule {target}")
            finally:
                if own:
                    os.close(fd)
        prctl(PR_SET_NO_NEW_PRIVS, 1)
        _check(_libc.syscall(_SYS_RESTRICT, ctypes.c_int(rfd), ctypes.c_uint32(0)),
               "landlock_restrict_self")
    finally:
        os.close(rfd)


def python_read_paths() -> list[str]:
    """Interpreter and library trees a cell may import from; the repository itself is not one
    (the sandbox package is imported before user code runs)."""
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    roots.add(os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))))
    return sorted(r for r in roots if r and os.path.exists(r))


SYSTEM_READ_PATHS = [
    "/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin",
    "/etc/fonts", "/etc/ld.so.cache", "/etc/localtime", "/etc/passwd", "/etc/group",
    "/etc/nsswitch.conf", "/etc/mime.types", "/etc/matplotlibrc",
    "/proc", "/sys/devices/system/cpu", "/dev/urandom", "/dev/random", "/dev/zero",
]


# --- rlimits -----------------------------------------------------------------------------------

def lower_rlimit(which: int, soft: int, hard: int | None = None) -> None:
    """Lower a limit; never tries to raise (CAP_SYS_RESOURCE is absent on these machines)."""
    cur_soft, cur_hard = resource.getrlimit(which)
    hard = soft if hard is None else hard
    if cur_hard != resource.RLIM_INFINITY:
        hard = min(hard, cur_hard)
    soft = min(soft, hard)
    try:
        resource.setrlimit(which, (soft, hard))
    except (ValueError, OSError):
        pass


_PAGE = os.sysconf("SC_PAGE_SIZE")


def vm_size_bytes() -> int:
    fd = os.open("/proc/self/statm", os.O_RDONLY)
    try:
        return int(os.read(fd, 256).split()[0]) * _PAGE
    finally:
        os.close(fd)


_MADV_COLLAPSE = 25  # Linux >= 6.1; independent of the THP sysfs "enabled" mode except "never"
_HUGE = 2 << 20
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def collapse_anonymous_memory() -> int:
    """Back this process's private anonymous memory (heap and anonymous mappings) with 2 MB
    pages where the kernel can; returns the bytes it collapsed (0 where it cannot).

    Why: a session's processes are forks of the zygote, and every cell is a fork of its holder.
    On this kind of machine (a nested VM) fork and exit cost ~0.2 us per 4 kB page table entry of
    the tens of MB the imported libraries hold; memory in large folios is copied and torn down
    in batches (and in 2 MB entries until first written). Only ranges already mapped are
    touched, and only 2 MB ranges at least half resident (no memory is made up for sparse
    reservations); the pages stay shared copy-on-write with the sessions, as before."""
    done = 0
    resident = ctypes.create_string_buffer(_HUGE // _PAGE)
    with open("/proc/self/maps") as f:
        lines = f.readlines()
    for line in lines:
        parts = line.split()
        if len(parts) < 5 or not parts[1].startswith("rw") or parts[1][3] != "p":
            continue
        name = parts[5] if len(parts) > 5 else ""
        if name not in ("", "[heap]"):
            continue  # files, stacks, vdso: not anonymous heap memory
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        lo, hi = (lo + _HUGE - 1) & ~(_HUGE - 1), hi & ~(_HUGE - 1)
        for start in range(lo, hi, _HUGE):  # one 2 MB range at a time: one failure skips little
            if _libc.mincore(start, _HUGE, resident) != 0:
                continue
            if sum(b & 1 for b in resident.raw) * 2 < len(resident.raw):
                continue
            if _libc.madvise(start, _HUGE, _MADV_COLLAPSE) == 0:
                done += _HUGE
    return done


# --- probes ------------------------------------------------------------------------------------

def probe_namespaces() -> dict[str, str | None]:
    """Try each namespace in a throwaway child; returns {name: None if usable else why not}."""
    results = {}
    for name, flag in (("pid+mount", CLONE_NEWPID | CLONE_NEWNS), ("net", CLONE_NEWNET),
                       ("ipc+uts", CLONE_NEWIPC | CLONE_NEWUTS)):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                unshare(flag)
                msg = b""
            except OSError as e:
                msg = str(e).encode()[:200] or b"failed"
            os.write(w, msg)
            os._exit(0)
        os.close(w)
        msg = os.read(r, 256)
        os.close(r)
        os.waitpid(pid, 0)
        results[name] = msg.decode() or None
    return results


def is_missing(e: OSError) -> bool:
    return e.errno in (errno.ENOENT, errno.EPERM, errno.EACCES, errno.EROFS, errno.ENOSYS)
