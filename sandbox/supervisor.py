"""The supervisor of one session: the loop that runs its cells (`sandbox.session` builds the tree).

The supervisor enforces the wall-clock limit from outside the cell, captures stdout/stderr from
pipes it owns, kills every other process of the session after each cell (it can list them: the
namespace's /proc shows only them), and rolls the files back (sandbox.workdir). When it dies, the
kernel kills everything left in its pid namespace. The process tree is drawn in `sandbox/session.py`.
"""


from __future__ import annotations

import base64
import io
import os
import select
import signal
import time
import traceback
import warnings

from sandbox import wire


class Supervisor:
    def __init__(self, sock, holder_sock, holder_pid, spec, snapshot, cgroup_fds) -> None:
        self.sock, self.holder_sock, self.holder = sock, holder_sock, holder_pid
        self.spec, self.snapshot, self.cg = spec, snapshot, cgroup_fds
        self.lost: str | None = None
        self.n = 0

    def serve(self) -> None:
        wire.send_sock(self.sock, {"op": "ready"})
        while True:
            try:
                msg, _ = wire.recv_sock(self.sock)
            except (wire.FrameError, OSError):
                os._exit(0)  # the pool closed the session or died
            t0 = time.monotonic()
            images: list[bytes] = []
            # The barrier: whatever a cell made us read or do, the pool gets a reply frame.
            try:
                if msg.get("op") == "run":
                    reply, images = self.run(str(msg.get("code", "")))
                elif msg.get("op") == "stats":
                    reply = {"memory_bytes": self._read_int("usage")}
                else:
                    reply = {"error": f"unknown op {msg.get('op')!r}"}
            except BaseException as e:  # noqa: BLE001
                reply, images = self._internal_error(e, t0), []
            self._send(reply, images)

    def _internal_error(self, e: BaseException, t0: float) -> dict:
        self.lost = f"its supervisor failed ({type(e).__name__}: {e})"[:500]
        try:
            self._kill_all_but(None)
        except BaseException:  # noqa: BLE001
            pass
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))[-2000:]
        return _reply("crashed", "", f"[sandbox] internal error in the session's supervisor:\n{tb}"
                      f"[sandbox] session lost: {self.lost}; start a new session\n", t0)

    def _send(self, reply: dict, images: list[bytes]) -> None:
        """The reply frame lists the images' sizes; their bytes follow it raw (no base64, and no
        frame cap on what max_images images of max_image_pixels may weigh)."""
        reply["image_sizes"] = [len(p) for p in images]
        try:
            data = wire.encode(reply)
        except (wire.FrameError, TypeError, ValueError):
            for key in ("stdout", "stderr"):
                if isinstance(reply.get(key), str):
                    reply[key] = reply[key][:65536] + "\n[sandbox] output cut to fit the reply\n"
            data = wire.encode(reply)
        try:
            self.sock.sendall(data)
            for p in images:
                self.sock.sendall(p)
        except OSError:
            os._exit(0)

    def _read_int(self, key: str) -> int | None:
        fd = self.cg.get(key)
        if fd is None:
            return None
        return int(os.pread(fd, 64, 0).split()[0])

    def _oom_kills(self) -> int:
        fd = self.cg.get("oom")
        if fd is None:
            return 0
        for line in os.pread(fd, 4096, 0).decode().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def run(self, code: str) -> tuple[dict, list[bytes]]:
        t0 = time.monotonic()
        self._reap()
        if self.lost is None and not _alive(self.holder):
            self.lost = "the process holding the session's state died"
        if self.lost:
            return _reply("crashed", "", f"[sandbox] session lost: {self.lost}; start a new "
                          "session", t0), []
        # A cell may have stopped the holder (SIGSTOP): it would never fork the next cell.
        try:
            os.kill(self.holder, signal.SIGCONT)
        except OSError:
            pass
        self.n += 1
        oom_before = self._oom_kills()
        res_r, res_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            wire.send_sock(self.holder_sock, {"op": "run", "code": code, "n": self.n},
                           [res_w, out_w, err_w])
        except OSError:
            self.lost = "the process holding the session's state stopped answering"
        for fd in (res_w, out_w, err_w):
            os.close(fd)
        cap = self.spec["max_output_bytes"]
        outs = {out_r: _Capture(cap), err_r: _Capture(cap)}
        reader = wire.FrameReader()
        result = exit_status = garbage = None
        shown: list = []
        timed_out = False
        deadline = t0 + self.spec["timeout_s"]
        poller = select.poll()
        for fd in (res_r, out_r, err_r):
            os.set_blocking(fd, False)
            poller.register(fd, select.POLLIN)
        open_fds = {res_r, out_r, err_r}
        while result is None and exit_status is None and garbage is None and res_r in open_fds:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for fd, _ev in poller.poll(left * 1000):
                data = _read_some(fd)
                if data is None:
                    continue
                if not data:
                    poller.unregister(fd)
                    open_fds.discard(fd)
                elif fd == res_r:
                    try:
                        frames = reader.feed(data)
                    except wire.FrameError as e:
                        garbage, frames = str(e)[:200], []
                    for f in frames:
                        kind = f.get("kind")
                        if kind == "image" and result is None:
                            if len(shown) < self.spec["max_images"] + 1:
                                shown.append(f.get("png"))
                        elif kind == "result" and result is None:
                            result = f
                        elif kind == "exit":
                            exit_status = f.get("wait_status")
                else:
                    outs[fd].add(data)
        status, notes, images = "error", [], []
        new_holder = None
        if timed_out:
            status = "timeout"
            notes.append(f"[sandbox] timeout: the cell ran longer than {self.spec['timeout_s']:g} s "
                         "and was killed; the state was rolled back to the last successful cell")
        elif garbage is not None:
            notes.append(f"[sandbox] the cell wrote malformed data on the sandbox's result channel "
                         f"({garbage}); the cell was discarded")
        elif result is not None:
            status = "error" if result.get("status") != "ok" else "ok"
            images, dropped = self._check_images(shown)
            if dropped:
                notes.append(f"[sandbox] {dropped} image(s) dropped: not a decodable PNG within "
                             "the limits")
            pid = result.get("pid")
            if status == "ok":
                # The cell child of the holder (or, if the cell killed the holder, our orphan).
                if _is_pid(pid) and _alive(pid) and _parent(pid) in (self.holder, os.getpid()):
                    new_holder = pid
                else:
                    status = "crashed"
                    notes.append("[sandbox] the cell finished but its process vanished")
        else:
            status, note = self._describe_exit(exit_status, oom_before)
            notes.append(note)
        self._kill_all_but(new_holder or self.holder)
        for fd in (out_r, err_r):
            while (data := _read_some(fd)):
                outs[fd].add(data)
        for fd in (res_r, out_r, err_r):
            os.close(fd)
        if new_holder:
            self.holder = new_holder
            try:
                self.snapshot.sync()
            except OSError as e:
                self._files_lost(f"its files could not be saved after the cell ({e})", notes)
                status = "crashed"
        else:
            try:
                self.snapshot.restore()
            except OSError as e:
                self._files_lost(f"its files could not be rolled back ({e})", notes)
            if self.lost:
                pass
            elif not _alive(self.holder):
                self.lost = "the process holding the session's state died during the cell"
                notes.append(f"[sandbox] session lost: {self.lost}; start a new session")
            elif status != "timeout":
                notes.append("[sandbox] the namespace and files were rolled back to the last "
                             "successful cell")
        stderr = outs[err_r].text()
        if notes:
            stderr += ("" if not stderr or stderr.endswith("\n") else "\n") + "\n".join(notes) + "\n"
        return _reply(status, outs[out_r].text(), stderr, t0), images

    def _files_lost(self, why: str, notes: list[str]) -> None:
        self.lost = why[:500]
        notes.append(f"[sandbox] session lost: {self.lost}; start a new session")
        self._kill_all_but(None)

    def _describe_exit(self, wait_status, oom_before: int) -> tuple[str, str]:
        # The exit frame comes from the holder, which user code may have rewritten: any value.
        if not _is_int(wait_status) or not 0 <= wait_status <= 0xFFFF:
            return "crashed", "[sandbox] the cell's process vanished without a result"
        if os.WIFEXITED(wait_status):
            code = os.WEXITSTATUS(wait_status)
            return "error", (f"[sandbox] the cell ended the process with os._exit({code}); exiting "
                             "is disabled in the sandbox")
        sig = os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status) else 0
        if self._oom_kills() > oom_before:
            return "crashed", (f"[sandbox] the cell was killed: out of memory (the session may "
                               f"use {self.spec['memory_mb']} MB)")
        if sig == signal.SIGXCPU:
            return "timeout", "[sandbox] the cell used up its CPU-time limit and was killed"
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        return "crashed", f"[sandbox] the cell's process was killed by {name}"

    def _check_images(self, shown: list) -> tuple[list[bytes], int]:
        """Only PNGs that PIL decodes completely within max_image_pixels leave the session, and
        re-encoded: the trainer never gets the cell's bytes (trailing data, odd chunks, bombs)."""
        from PIL import Image

        limit = self.spec["max_image_pixels"]
        Image.MAX_IMAGE_PIXELS = limit  # PIL refuses bigger ones before decoding (bomb check)
        warnings.simplefilter("ignore")  # PIL warns between 1x and 2x; our stderr is the trainer's
        ok, dropped = [], 0
        for b64 in shown:
            if len(ok) >= self.spec["max_images"]:
                dropped += 1
                continue
            try:
                png = base64.b64decode(b64, validate=True)
                if not png.startswith(b"\x89PNG\r\n\x1a\n"):
                    raise ValueError("not a PNG")
                with Image.open(io.BytesIO(png), formats=["PNG"]) as im:
                    if im.width * im.height > limit:
                        raise ValueError("too many pixels")
                    im.load()
                    if im.mode not in ("1", "L", "LA", "RGB", "RGBA", "P", "I;16"):
                        im = im.convert("RGBA")
                    im.info = {}
                    out = io.BytesIO()
                    im.save(out, format="PNG", compress_level=1)
                ok.append(out.getvalue())
            except Exception:  # noqa: BLE001 - any failure to decode drops the image
                dropped += 1
        return ok, dropped

    def _kill_all_but(self, keep: int | None) -> None:
        """SIGKILL every process of the session except us and `keep`, until none is left.

        Each pass waits (on pidfds, not by polling /proc) until its victims have exited. The
        loop converges under a fork bomb: killed processes cannot fork, and the pids cgroup caps
        how many new ones can appear between two passes."""
        me = os.getpid()
        for attempt in range(2000):
            victims = []
            for name in os.listdir("/proc"):
                if not name.isdigit() or int(name) in (me, keep):
                    continue
                if _alive(int(name)):
                    victims.append(int(name))
            if not victims:
                break
            poller, fds = select.poll(), []
            for pid in victims:
                try:
                    fd = os.pidfd_open(pid)
                except OSError:
                    fd = None  # gone already (or no pidfds: fall back to polling /proc)
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
                if fd is not None:
                    fds.append(fd)
                    poller.register(fd, select.POLLIN)
            self._reap()
            deadline = time.monotonic() + 0.2
            waiting = len(fds)
            while waiting:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    ready = poller.poll(left * 1000)
                except InterruptedError:
                    continue
                for fd, _ in ready:
                    poller.unregister(fd)
                    waiting -= 1
                self._reap()  # victims we are the parent of stay zombies until reaped
            for fd in fds:
                os.close(fd)
            if not fds and attempt:
                time.sleep(0.0005)
        self._reap()
        self._wait_gone(keep)

    def _wait_gone(self, keep: int | None, timeout_s: float = 5.0) -> None:
        """Until no process but us and `keep` is left in /proc (`_kill_all_but` stops at "dying": SIGKILL
        pending or exiting; on a loaded machine such a process may still be there when the next cell
        lists /proc, issue 49). Zombies of `keep` are its own to reap. Bounded by `timeout_s`."""
        me = os.getpid()
        deadline = time.monotonic() + timeout_s
        while True:
            self._reap()
            left = []
            for name in os.listdir("/proc"):
                if not name.isdigit() or int(name) in (me, keep):
                    continue
                pid = int(name)
                if keep is not None and _parent(pid) == keep and _zombie(pid):
                    continue
                left.append(pid)
            if not left or time.monotonic() > deadline:
                return
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.001)

    def _reap(self) -> None:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return


class _Capture:
    """The first `cap` bytes of a stream, and how many more there were."""

    def __init__(self, cap: int) -> None:
        self.cap, self.buf, self.extra = cap, bytearray(), 0

    def add(self, data: bytes) -> None:
        room = self.cap - len(self.buf)
        self.buf += data[:max(room, 0)]
        self.extra += max(len(data) - max(room, 0), 0)

    def text(self) -> str:
        text = self.buf.decode("utf-8", "replace")
        if self.extra:
            text += f"\n[... output truncated: {self.extra} more bytes ...]\n"
        return text


def _read_some(fd: int) -> bytes | None:
    try:
        return os.read(fd, 1 << 16)
    except BlockingIOError:
        return None
    except OSError:
        return b""


_PF_EXITING = 0x4
_SIGKILL_BIT = 1 << (signal.SIGKILL - 1)


def _alive(pid: int) -> bool:
    """Whether `pid` runs and will go on running. A process sent SIGKILL stays in state R/S
    until the scheduler lets it die, which on a loaded machine takes a while: one with SIGKILL
    pending, or already exiting, counts as dead, so a cell that killed its holder is reported
    lost by that very cell rather than by whichever cell next finds the holder gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
        with open(f"/proc/{pid}/status", "rb") as f:
            status = f.read()
    except OSError:
        return False
    if fields[0] in (b"Z", b"X") or int(fields[6]) & _PF_EXITING:
        return False
    for line in status.splitlines():
        if line.startswith((b"SigPnd:", b"ShdPnd:")) and int(line.split()[1], 16) & _SIGKILL_BIT:
            return False
    return True


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] in (b"Z", b"X")
    except OSError:
        return True


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_pid(x) -> bool:
    return _is_int(x) and 1 < x < (1 << 22)


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return int(data[data.rfind(b")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _reply(status: str, stdout: str, stderr: str, t0: float) -> dict:
    return {"status": status, "stdout": stdout, "stderr": stderr,
            "elapsed_s": time.monotonic() - t0}
