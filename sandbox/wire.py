"""Length-prefixed JSON frames between the pool, the zygote, supervisors and cells.

Every hop that can carry bytes written by user code is parsed as JSON with a size cap, never
unpickled: a supervisor or the trainer must not execute anything a cell sends it. (The one raw
stream is trainer -> supervisor: a session's input files follow its init frame as plain bytes,
their sizes listed in the frame.)
"""

from __future__ import annotations

import json
import os
import socket
import struct

MAX_FRAME = 64 << 20  # a result with a few capped PNGs fits easily; anything bigger is hostile
_HEADER = struct.Struct(">I")


class FrameError(Exception):
    """The peer sent something that is not a well-formed frame (or hung up mid-frame)."""


def encode(msg: dict) -> bytes:
    body = json.dumps(msg, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME:
        raise FrameError(f"frame of {len(body)} bytes exceeds the {MAX_FRAME}-byte cap")
    return _HEADER.pack(len(body)) + body


def write_fd(fd: int, msg: dict) -> None:
    data = memoryview(encode(msg))
    while data:
        n = os.write(fd, data)
        data = data[n:]


def _read_exact_fd(fd: int, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise FrameError("peer closed the channel mid-frame" if chunks or n != left else "eof")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def send_sock(sock: socket.socket, msg: dict, fds: list[int] | None = None) -> None:
    data = encode(msg)
    if fds:
        # The descriptors ride on the first bytes of the frame; the receiver asks for them there.
        sent = socket.send_fds(sock, [data[:_HEADER.size]], fds)
        if sent != _HEADER.size:
            raise FrameError("short send of a frame header")
        data = data[_HEADER.size:]
    sock.sendall(data)


def recv_sock(sock: socket.socket, max_fds: int = 0) -> tuple[dict, list[int]]:
    """Blocking receive of one frame; raises FrameError('eof') when the peer is gone."""
    if max_fds:
        head, fds, _flags, _addr = socket.recv_fds(sock, _HEADER.size, max_fds)
    else:
        head, fds = sock.recv(_HEADER.size, socket.MSG_WAITALL), []
    if len(head) < _HEADER.size:
        for fd in fds:
            os.close(fd)
        raise FrameError("eof" if not head else "peer closed the channel mid-frame")
    (length,) = _HEADER.unpack(head)
    if length > MAX_FRAME:
        raise FrameError(f"frame of {length} bytes exceeds the {MAX_FRAME}-byte cap")
    body = bytearray()
    while len(body) < length:
        chunk = sock.recv(min(length - len(body), 1 << 20))
        if not chunk:
            raise FrameError("peer closed the channel mid-frame")
        body += chunk
    return decode_body(bytes(body)), fds


def decode_body(body: bytes) -> dict:
    try:
        msg = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise FrameError(f"malformed frame: {e}") from None
    except RecursionError:  # deeply nested arrays or objects, as a cell can forge
        raise FrameError("malformed frame: nested too deeply") from None
    if not isinstance(msg, dict):
        raise FrameError("malformed frame: not a JSON object")
    return msg


class FrameReader:
    """Incremental parser for a non-blocking pipe carrying frames from untrusted writers."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[dict]:
        self.buf += data
        out = []
        while len(self.buf) >= _HEADER.size:
            (length,) = _HEADER.unpack_from(self.buf)
            if length > MAX_FRAME:
                raise FrameError(f"frame of {length} bytes exceeds the {MAX_FRAME}-byte cap")
            if len(self.buf) < _HEADER.size + length:
                break
            body = bytes(self.buf[_HEADER.size:_HEADER.size + length])
            del self.buf[:_HEADER.size + length]
            out.append(decode_body(body))
        return out
