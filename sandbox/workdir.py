"""Rollback of a session's files: a mirror of the last successful state, restored in place.

The live tree is the session's private tmpfs (`/tmp`, holding the working directory). The mirror
is a second tmpfs that the supervisor mounted, opened and then detached, so no path leads to it:
only the supervisor's directory descriptor does. After a successful cell the mirror is brought up
to date; after a failed one the live tree is put back from it. Both only touch entries whose
(inode, size, mtime, ctime) changed, so a cell costs a directory walk, not a copy of every file.

Restoring happens in place (files are replaced, the tmpfs root and surviving directories keep
their inodes) because Landlock rules bind to inodes. Runs as the session's uid after every other
process of the session except the idle holder is dead, so nothing races it. FIFOs, sockets and
device nodes are not kept: a restore removes them.
"""

from __future__ import annotations

import os
import stat
import time

# Inode timestamps come from the kernel's coarse clock (or finer). A file stamped before the tick
# in which we looked cannot change later without getting a newer ctime; one stamped within the
# last tick could (same timestamp), so it is copied again at the next sync. One tick of margin.
_REALTIME_COARSE = getattr(time, "CLOCK_REALTIME_COARSE", 5)  # Linux's number; Python lacks it
_TICK_NS = max(int(time.clock_getres(_REALTIME_COARSE) * 1e9), 1_000_000)


def _sig(st: os.stat_result, kind: str, since_ns: int):
    if kind == "d":
        return ("d", stat.S_IMODE(st.st_mode))
    if max(st.st_ctime_ns, st.st_mtime_ns) >= since_ns - _TICK_NS:
        return None  # too recent to trust timestamps: treat as changed next time
    return (kind, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, stat.S_IMODE(st.st_mode))


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "d"
    if stat.S_ISREG(mode):
        return "f"
    if stat.S_ISLNK(mode):
        return "l"
    return "o"


class Snapshot:
    def __init__(self, live_root: str, mirror_fd: int) -> None:
        self.root = live_root
        self.mirror = mirror_fd
        self.manifest: dict[str, tuple] = {}  # rel path -> (kind, sig) as mirrored

    def _walk(self) -> dict[str, tuple]:
        now = time.clock_gettime_ns(_REALTIME_COARSE)
        out: dict[str, tuple] = {}
        stack = [""]
        # Only the session's own tmpfs is its state: mount points inside it (an interpreter tree
        # bound back read-only) are neither snapshotted nor restored.
        root_dev = os.stat(self.root).st_dev
        while stack:
            rel_dir = stack.pop()
            path = os.path.join(self.root, rel_dir) if rel_dir else self.root
            try:
                entries = list(os.scandir(path))
            except PermissionError:
                os.chmod(path, 0o700)  # the session owns it; a cell may have chmod'ed it to 000
                entries = list(os.scandir(path))
            for e in entries:
                rel = os.path.join(rel_dir, e.name) if rel_dir else e.name
                st = e.stat(follow_symlinks=False)
                if st.st_dev != root_dev:
                    continue
                kind = _kind(st.st_mode)
                if kind == "d":
                    stack.append(rel)
                out[rel] = (kind, _sig(st, kind, now))
        return out

    # live -> mirror, after a successful cell
    def sync(self) -> None:
        cur = self._walk()
        for rel in sorted(self.manifest, reverse=True):
            if rel not in cur or cur[rel][0] != self.manifest[rel][0]:
                self._remove(rel, mirror=True)
        new = {}
        for rel in sorted(cur):
            kind, sig = cur[rel]
            if kind == "o":
                continue
            old = self.manifest.get(rel)
            if old is None or old[1] is None or old != cur[rel] or sig is None:
                self._copy(rel, kind, to_mirror=True)
            new[rel] = cur[rel]
        self.manifest = new

    # mirror -> live, after a failed cell
    def restore(self) -> None:
        cur = self._walk()
        for rel in sorted(cur, reverse=True):
            kind, sig = cur[rel]
            old = self.manifest.get(rel)
            if old is None or old[0] != kind or (kind != "d" and (old[1] is None or old != cur[rel])):
                self._remove(rel, mirror=False)
            elif kind == "d" and old != cur[rel]:
                os.chmod(os.path.join(self.root, rel), old[1][1])
        present = set(os.path.join(self.root, r) for r in cur)
        for rel in sorted(self.manifest):
            live = os.path.join(self.root, rel)
            if live in present and os.path.lexists(live):
                continue
            self._copy(rel, self.manifest[rel][0], to_mirror=False)
        self.manifest = {r: v for r, v in self._walk().items() if v[0] != "o"}

    def _remove(self, rel: str, mirror: bool) -> None:
        try:
            if mirror:
                st = os.stat(rel, dir_fd=self.mirror, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    os.rmdir(rel, dir_fd=self.mirror)
                else:
                    os.unlink(rel, dir_fd=self.mirror)
            else:
                path = os.path.join(self.root, rel)
                if os.path.isdir(path) and not os.path.islink(path):
                    os.rmdir(path)
                else:
                    os.unlink(path)
        except FileNotFoundError:
            pass

    def _copy(self, rel: str, kind: str, to_mirror: bool) -> None:
        live = os.path.join(self.root, rel)
        if kind == "d":
            mode = os.stat(live if to_mirror else rel, dir_fd=None if to_mirror else self.mirror,
                           follow_symlinks=False).st_mode
            try:
                if to_mirror:
                    os.mkdir(rel, 0o700, dir_fd=self.mirror)
                else:
                    os.mkdir(live, stat.S_IMODE(mode))
            except FileExistsError:
                pass
            return
        if kind == "l":
            if to_mirror:
                target = os.readlink(live)
                self._remove(rel, mirror=True)
                os.symlink(target, rel, dir_fd=self.mirror)
            else:
                os.symlink(os.readlink(rel, dir_fd=self.mirror), live)
            return
        flags_in = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
        flags_out = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
        if to_mirror:
            try:
                src = os.open(live, flags_in)
            except PermissionError:
                os.chmod(live, 0o600)
                src = os.open(live, flags_in)
            mode = stat.S_IMODE(os.fstat(src).st_mode)
            try:
                dst = os.open(rel, flags_out, 0o600, dir_fd=self.mirror)
            except IsADirectoryError:
                os.rmdir(rel, dir_fd=self.mirror)
                dst = os.open(rel, flags_out, 0o600, dir_fd=self.mirror)
            os.fchmod(dst, mode | 0o600)
        else:
            src = os.open(rel, flags_in, dir_fd=self.mirror)
            mode = stat.S_IMODE(os.fstat(src).st_mode)
            dst = os.open(live, flags_out, mode)
        try:
            if not stat.S_ISREG(os.fstat(src).st_mode):
                return
            size = os.fstat(src).st_size
            offset = 0
            while offset < size:
                n = os.sendfile(dst, src, offset, size - offset)
                if n == 0:
                    break
                offset += n
            if not to_mirror:
                os.fchmod(dst, mode)
        finally:
            os.close(src)
            os.close(dst)
