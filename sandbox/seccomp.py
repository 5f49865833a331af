"""A seccomp filter for the session's holder and cells: kernel interfaces no cell needs, closed.

Landlock and namespaces restrict *what* a cell reaches through the syscalls it has; this layer takes
away whole syscall families whose mere presence is attack surface or a way around the other layers:
kernel keyrings, ptrace and cross-process memory access, BPF, perf events, userfaultfd, io_uring
(whose operations bypass seccomp), new namespaces and mounts, module and kexec loading, and shared
memory outside the session's files (anonymous MAP_SHARED mmap, SysV segments, memfd), which a
failed cell could write without the rollback undoing it (see the package docstring). Socket
families other than AF_UNIX, AF_INET, AF_INET6 and route netlink (glibc's if_nameindex and
getaddrinfo use it) fail with EAFNOSUPPORT; the filter decides on the family number alone and never
opens such a socket itself (AF_VSOCK and the other virtualization channels are never probed).

Written as a classic BPF program by hand (no libseccomp binding needed). Only x86-64 has a table
here; elsewhere `supported()` is False and the pool reports the layer as missing. A syscall made
through another ABI (int 0x80, x32) kills the process: numbers-based rules mean nothing there.
"""

from __future__ import annotations

import ctypes
import errno
import platform
import struct

from sandbox import isolation

_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_BIT = 0x40000000

# x86-64 numbers (arch/x86/entry/syscalls/syscall_64.tbl).
DENIED_X86_64 = {
    "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312,
    "pidfd_getfd": 438,
    "add_key": 248, "request_key": 249, "keyctl": 250,
    "bpf": 321, "perf_event_open": 298, "userfaultfd": 323,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "unshare": 272, "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
    "fspick": 433, "mount_setattr": 442,
    "kexec_load": 246, "kexec_file_load": 320, "init_module": 175, "finit_module": 313,
    "delete_module": 176, "reboot": 169, "swapon": 167, "swapoff": 168, "acct": 163,
    "quotactl": 179, "syslog": 103, "iopl": 172, "ioperm": 173, "modify_ldt": 154,
    "name_to_handle_at": 303, "open_by_handle_at": 304, "fanotify_init": 300,
    "lookup_dcookie": 212, "uselib": 134, "vhangup": 153, "settimeofday": 164,
    "clock_settime": 227, "adjtimex": 159, "clock_adjtime": 305,
    # Shared memory that is not a file in the session's directory: a failed cell's writes to it
    # would survive the rollback (see the package docstring); anonymous MAP_SHARED mmap below.
    "shmget": 29, "shmat": 30, "memfd_create": 319, "memfd_secret": 447,
}
_NR_CLONE, _NR_CLONE3, _NR_SOCKET, _NR_MMAP = 56, 435, 41, 9
# mmap flags: MAP_SHARED and MAP_SHARED_VALIDATE both have bit 0 (MAP_PRIVATE is 0x02).
_MAP_SHARED_ANONYMOUS = 0x01 | 0x20
# clone() flags that make a namespace (CLONE_NEWTIME shares bits with the exit signal: left out;
# it needs CAP_SYS_ADMIN in the caller's user namespace, which a user namespace would give).
_CLONE_NS_FLAGS = 0x7E020000
_AF_UNIX, _AF_INET, _AF_INET6, _AF_NETLINK, _NETLINK_ROUTE = 1, 2, 10, 16, 0

_RET_KILL_PROCESS, _RET_ERRNO, _RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K, _AND_K = 0x20, 0x15, 0x35, 0x45, 0x06, 0x54
_OFF_NR, _OFF_ARCH, _OFF_ARG0, _OFF_ARG2, _OFF_ARG3 = 0, 4, 16, 32, 40  # struct seccomp_data, little-endian
_SECCOMP_SET_MODE_FILTER, _NR_SECCOMP = 1, 317


def supported() -> bool:
    return platform.machine() == "x86_64"


def _program() -> list[tuple[int, int, int, int]]:
    deny = (_RET_K, 0, 0, _RET_ERRNO | errno.EPERM)
    allow = (_RET_K, 0, 0, _RET_ALLOW)
    no_family = (_RET_K, 0, 0, _RET_ERRNO | errno.EAFNOSUPPORT)
    p = [(_LD_W_ABS, 0, 0, _OFF_ARCH),
         (_JEQ_K, 1, 0, _AUDIT_ARCH_X86_64),
         (_RET_K, 0, 0, _RET_KILL_PROCESS),
         (_LD_W_ABS, 0, 0, _OFF_NR),
         (_JGE_K, 0, 1, _X32_BIT), deny]
    for nr in sorted(DENIED_X86_64.values()):
        p += [(_JEQ_K, 0, 1, nr), deny]
    # clone3 passes its flags in memory a filter cannot read: ENOSYS makes glibc use clone().
    p += [(_JEQ_K, 0, 1, _NR_CLONE3), (_RET_K, 0, 0, _RET_ERRNO | errno.ENOSYS)]
    p += [(_JEQ_K, 0, 4, _NR_CLONE), (_LD_W_ABS, 0, 0, _OFF_ARG0),
          (_JSET_K, 0, 1, _CLONE_NS_FLAGS), deny, allow]
    p += [(_JEQ_K, 0, 9, _NR_SOCKET), (_LD_W_ABS, 0, 0, _OFF_ARG0),
          (_JEQ_K, 5, 0, _AF_UNIX), (_JEQ_K, 4, 0, _AF_INET), (_JEQ_K, 3, 0, _AF_INET6),
          (_JEQ_K, 0, 3, _AF_NETLINK), (_LD_W_ABS, 0, 0, _OFF_ARG2),
          (_JEQ_K, 0, 1, _NETLINK_ROUTE), allow, no_family]
    # Anonymous shared memory: pages the holder shares with its cell, which no rollback undoes.
    p += [(_JEQ_K, 0, 5, _NR_MMAP), (_LD_W_ABS, 0, 0, _OFF_ARG3), (_AND_K, 0, 0, _MAP_SHARED_ANONYMOUS),
          (_JEQ_K, 0, 1, _MAP_SHARED_ANONYMOUS), deny, allow]
    p.append(allow)
    return p


def install() -> None:
    """Apply the filter to this thread's process and all its future children (irrevocable).
    Needs no_new_privs, which Landlock set already (set again here in case it was not)."""
    prog = _program()
    raw = b"".join(struct.pack("=HBBI", *ins) for ins in prog)
    buf = ctypes.create_string_buffer(raw, len(raw))
    fprog = struct.pack("=HxxxxxxQ", len(prog), ctypes.addressof(buf))
    fbuf = ctypes.create_string_buffer(fprog, len(fprog))
    isolation.prctl(isolation.PR_SET_NO_NEW_PRIVS, 1)
    isolation._check(isolation._libc.syscall(_NR_SECCOMP, _SECCOMP_SET_MODE_FILTER, 0, fbuf),
                     "seccomp")


def denies_keyctl() -> bool:
    """In a filtered process: whether keyctl is refused (the probe's check)."""
    ret = isolation._libc.syscall(DENIED_X86_64["keyctl"], 0, -3, 0, 0, 0)
    return ret < 0 and ctypes.get_errno() == errno.EPERM
