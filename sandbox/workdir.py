"""Rollback of a session's files: a mirror of the last successful state, restored in place.

The live tree is the session's private tmpfs (`/tmp`, holding the working directory). The mirror
is a second tmpfs that the supervisor mounted, opened and then detached, so no path leads to it:
only the supervisor's directory descriptor does. After a successful cell the mirror is brought up
to date; after a failed one the live tree is put back from it. Both only touch entries whose
(inode, size, mtime, ctime, mode, links) changed, so a cell costs a directory walk, not a copy.

Whatever a cell may do to its own tree, the walk keeps working:
- it goes from directory descriptor to directory descriptor (openat), never through absolute
  paths, so trees deeper than PATH_MAX are fine;
- a directory the cell chmod'ed (0o000, 0o644, 0o555) is opened after giving its owner rwx (the
  supervisor runs as the session uid, which owns it) and gets its own mode back afterwards;
- hard links are mirrored as hard links and sparse files keep their holes, so the mirror needs no
  more room than the live tree (it has the same size);
- a file that still has the inode it had at the last successful cell is restored *in place*
  (rewritten and truncated), so file objects and MAP_SHARED mappings the namespace holds see the
  restored contents; only a file the failed cell deleted or replaced comes back as a new inode.

Runs as the session's uid after every other process of the session except the idle holder is
dead, so nothing races it. FIFOs, sockets and device nodes are not kept: a restore removes them.
Only entries the session's uid owns are walked: the cell cannot create any other, and the
directories the sandbox makes as root on the tmpfs (the path down to an interpreter tree bound
under /tmp, e.g. a checkout in /tmp/x with its .venv) are neither the cell's to change nor ours to
chmod (a restore walking into one failed with EPERM and lost the session).
"""

from __future__ import annotations

import errno
import os
import stat
import time

# Inode timestamps come from the kernel's coarse clock (or finer). A file stamped before the tick
# in which we looked cannot change later without getting a newer ctime; one stamped within the
# last tick could (same timestamp), so it is copied again at the next sync. One tick of margin.
_REALTIME_COARSE = getattr(time, "CLOCK_REALTIME_COARSE", 5)  # Linux's number; Python lacks it
_TICK_NS = max(int(time.clock_getres(_REALTIME_COARSE) * 1e9), 1_000_000)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_SEEK_DATA, _SEEK_HOLE = getattr(os, "SEEK_DATA", 3), getattr(os, "SEEK_HOLE", 4)


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "d"
    if stat.S_ISREG(mode):
        return "f"
    if stat.S_ISLNK(mode):
        return "l"
    return "o"


def _sig(st: os.stat_result, since_ns: int):
    if max(st.st_ctime_ns, st.st_mtime_ns) >= since_ns - _TICK_NS:
        return None  # too recent to trust timestamps: treat as changed next time
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, stat.S_IMODE(st.st_mode),
            st.st_nlink)


class _Node:
    __slots__ = ("kind", "sig", "ino", "mode", "children")

    def __init__(self, kind, sig, ino, mode, children=None) -> None:
        self.kind, self.sig, self.ino, self.mode, self.children = kind, sig, ino, mode, children


def _open_dir(parent: int, name: str, st: os.stat_result) -> int:
    """Open a subdirectory for walking, first giving its owner rwx if the cell took it away."""
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o700 != 0o700:
        os.chmod(name, mode | 0o700, dir_fd=parent)
    return os.open(name, _DIR_FLAGS, dir_fd=parent)


def _entries(dfd: int) -> dict[str, os.stat_result]:
    with os.scandir(dfd) as it:
        return {e.name: e.stat(follow_symlinks=False) for e in it}


def _rmtree(parent: int, name: str) -> None:
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=parent)
        return
    fd = _open_dir(parent, name, st)
    try:
        for child in _entries(fd):
            _rmtree(fd, child)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent)


def _copy_data(src: int, dst: int, size: int) -> None:
    """Copy a regular file's data, keeping holes (SEEK_DATA/SEEK_HOLE); dst ends at `size`."""
    offset = 0
    while offset < size:
        try:
            start = os.lseek(src, offset, _SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # only a hole is left
                break
            raise
        end = os.lseek(src, start, _SEEK_HOLE)
        pos = start
        os.lseek(dst, pos, os.SEEK_SET)  # sendfile writes at dst's position: the hole stays
        while pos < end:
            n = os.sendfile(dst, src, pos, end - pos)  # (copy_file_range: EXDEV across tmpfs)
            if n == 0:
                break
            pos += n
        offset = end
    os.ftruncate(dst, size)


class Snapshot:
    def __init__(self, live_root: str, mirror_fd: int) -> None:
        self.root = live_root
        self.mirror = mirror_fd
        self.tree: dict[str, _Node] = {}  # name -> node, as mirrored
        self._links: dict[int, int] = {}  # during one pass: inode -> O_PATH fd of its first copy

    def _pass(self, fn) -> None:
        os.chmod(self.root, 0o700)  # the session's tmpfs root: the cell may have chmod'ed it
        live = os.open(self.root, _DIR_FLAGS)
        self.dev = os.fstat(live).st_dev
        self.uid = os.getuid()
        self.now = time.clock_gettime_ns(_REALTIME_COARSE)
        try:
            fn(live)
        finally:
            os.close(live)
            for fd in self._links.values():
                os.close(fd)
            self._links.clear()

    def _link_or_none(self, st: os.stat_result, dst_dir: int, name: str) -> bool:
        """A later name of an inode already placed in this pass: hard-link it there too."""
        fd = self._links.get(st.st_ino) if st.st_nlink > 1 else None
        if fd is None:
            return False
        os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=dst_dir, follow_symlinks=True)
        return True

    def _remember(self, st: os.stat_result, dst_dir: int, name: str) -> None:
        if st.st_nlink > 1 and st.st_ino not in self._links:
            self._links[st.st_ino] = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC,
                                             dir_fd=dst_dir)

    def _own_entries(self, dfd: int) -> dict[str, os.stat_result]:
        """A live directory's entries on the session's tmpfs and owned by its uid (see the module doc)."""
        return {n: st for n, st in _entries(dfd).items() if st.st_dev == self.dev and st.st_uid == self.uid}

    # live -> mirror, after a successful cell
    def sync(self) -> None:
        def run(live: int) -> None:
            self.tree = self._sync_dir(live, self.mirror, self.tree)
        self._pass(run)

    def _sync_dir(self, lfd: int, mfd: int, old: dict[str, _Node]) -> dict[str, _Node]:
        entries = {n: st for n, st in self._own_entries(lfd).items() if _kind(st.st_mode) != "o"}
        for name, node in old.items():
            st = entries.get(name)
            if st is None or _kind(st.st_mode) != node.kind:
                _rmtree(mfd, name)
        new: dict[str, _Node] = {}
        for name, st in entries.items():
            kind, prev = _kind(st.st_mode), old.get(name)
            if prev is not None and prev.kind != kind:
                prev = None
            if kind == "d":
                try:
                    os.mkdir(name, 0o700, dir_fd=mfd)
                except FileExistsError:
                    pass
                mode = stat.S_IMODE(st.st_mode)
                cl = _open_dir(lfd, name, st)
                try:
                    cm = os.open(name, _DIR_FLAGS, dir_fd=mfd)
                    try:
                        children = self._sync_dir(cl, cm, prev.children if prev else {})
                    finally:
                        os.close(cm)
                    if mode & 0o700 != 0o700:
                        os.fchmod(cl, mode)  # the cell's own choice, back as it was
                finally:
                    os.close(cl)
                new[name] = _Node("d", None, st.st_ino, mode, children)
                continue
            sig = _sig(st, self.now)
            if prev is None or prev.sig is None or prev.sig != sig:
                try:
                    os.unlink(name, dir_fd=mfd)  # a fresh inode: never write through a mirror link
                except FileNotFoundError:
                    pass
                if kind == "l":
                    os.symlink(os.readlink(name, dir_fd=lfd), name, dir_fd=mfd)
                elif not self._link_or_none(st, mfd, name):
                    self._copy_file(lfd, name, mfd, name, st, stat.S_IMODE(st.st_mode) | 0o600)
            if kind == "f":
                self._remember(st, mfd, name)
            new[name] = _Node(kind, sig, st.st_ino, stat.S_IMODE(st.st_mode))
        return new

    # mirror -> live, after a failed cell
    def restore(self) -> None:
        """Two passes: first remove what the failed cell added and rewrite in place what it
        changed, then recreate what it removed, hard-linking names of one mirrored inode to the
        live file that already holds it."""
        def run(live: int) -> None:
            self._rewritten: set[int] = set()
            self._restore_dir(live, self.mirror, self.tree, create=False)
            self._restore_dir(live, self.mirror, self.tree, create=True)
        self._pass(run)

    def _restore_dir(self, lfd: int, mfd: int, tree: dict[str, _Node], create: bool) -> None:
        entries = self._own_entries(lfd)
        if not create:
            for name, st in list(entries.items()):
                node, kind = tree.get(name), _kind(st.st_mode)
                stale = node is None or node.kind != kind or kind == "o" or (
                    kind == "l" and (node.sig is None or _sig(st, self.now) != node.sig)) or (
                    kind == "f" and st.st_ino != node.ino)  # replaced: not the inode it held
                if stale:
                    _rmtree(lfd, name)
                    del entries[name]
        for name, node in tree.items():
            st = entries.get(name)
            if node.kind == "d":
                if st is None:
                    if not create:
                        continue
                    os.mkdir(name, 0o700, dir_fd=lfd)
                    st = os.stat(name, dir_fd=lfd, follow_symlinks=False)
                cl = _open_dir(lfd, name, st)
                try:
                    cm = os.open(name, _DIR_FLAGS, dir_fd=mfd)
                    try:
                        self._restore_dir(cl, cm, node.children, create)
                    finally:
                        os.close(cm)
                    os.fchmod(cl, node.mode)
                finally:
                    os.close(cl)
            elif node.kind == "l":
                if st is None and create:
                    os.symlink(os.readlink(name, dir_fd=mfd), name, dir_fd=lfd)
            elif st is not None and not create:
                if st.st_ino not in self._rewritten and (
                        node.sig is None or _sig(st, self.now) != node.sig):
                    self._rewrite_in_place(mfd, lfd, name, node)
                    node.sig = None  # new timestamps: checked again at the next sync
                self._rewritten.add(st.st_ino)
                self._remember(os.stat(name, dir_fd=mfd, follow_symlinks=False), lfd, name)
            elif st is None and create:
                mst = os.stat(name, dir_fd=mfd, follow_symlinks=False)
                if not self._link_or_none(mst, lfd, name):
                    self._copy_file(mfd, name, lfd, name, mst, node.mode)
                self._remember(mst, lfd, name)
                node.sig = None

    def _rewrite_in_place(self, mfd: int, lfd: int, name: str, node: _Node) -> None:
        os.chmod(name, 0o600, dir_fd=lfd)
        src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=mfd)
        try:
            dst = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=lfd)
            try:
                os.ftruncate(dst, 0)  # same inode, no stale data where the mirror has holes
                _copy_data(src, dst, os.fstat(src).st_size)
                os.fchmod(dst, node.mode)
            finally:
                os.close(dst)
        finally:
            os.close(src)

    def _copy_file(self, sfd: int, sname: str, dfd: int, dname: str, st: os.stat_result,
                   dst_mode: int) -> None:
        """A new copy; the mirror's copies keep owner rw so they can always be read back (the
        mode they had lives in the tree and is what the live copy gets)."""
        mode = stat.S_IMODE(st.st_mode)
        try:
            src = os.open(sname, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                          dir_fd=sfd)
        except PermissionError:  # a live file the cell chmod'ed 0o000: its owner may read it
            os.chmod(sname, mode | 0o400, dir_fd=sfd)
            src = os.open(sname, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                          dir_fd=sfd)
            os.fchmod(src, mode)
        try:
            if not stat.S_ISREG(os.fstat(src).st_mode):
                return
            dst = os.open(dname, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                          0o600, dir_fd=dfd)
            try:
                _copy_data(src, dst, os.fstat(src).st_size)
                os.fchmod(dst, dst_mode)
            finally:
                os.close(dst)
        finally:
            os.close(src)
