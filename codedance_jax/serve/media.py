"""Images in requests: which URLs the server reads on a client's behalf, and how it decodes them.

Sources:
- `data:image/...;base64,` URLs: always read.
- `http(s)://` URLs: never fetched.
- local paths and `file://` URLs: refused unless the operator names directories
  (`--allowed_local_media_path`, vLLM's name). Then a file is read only if it lies under one of
  them once symlinks are resolved, and only if an unprivileged local user could read it there:
  every directory from the named one down must be searchable by others (o+x), and the file must
  be a regular file readable by others (o+r). The server usually runs as root, which can read
  anything, so we check these permission bits ourselves instead of asking the kernel (os.access
  answers for root). We do not switch the reading thread's file-system uid to `nobody`: that
  needs setfsuid through ctypes on a shared thread pool, and the bits give the same answer for
  plain modes (ACLs and group bits are not consulted; only "other" counts, which is stricter).
  The directories above the named one are the operator's choice and are not checked. The file is
  opened by descriptor, one component at a time from the named directory with O_NOFOLLOW, so a
  symlink swapped in after the check is refused rather than followed.
- Every refusal of a local path (missing, outside the directories, not world-readable, not a
  regular file, a directory, a swapped symlink) is the same 400 message, which never echoes the
  path: a reply does not tell an existing file from a missing one. Timing still differs by
  microseconds; that is not hidden.

Decoding: PNG, JPEG, WebP and GIF (its first frame) only, named to `Image.open(formats=...)`, so
Pillow never runs another decoder (EPS would run Ghostscript on client bytes). `Image.open` reads
only the header; the size is checked against `max_pixels` there, before any pixel is decoded
(a 20 KB PNG can declare 170 megapixels). Any exception while decoding is a 400 `invalid_image`,
never a 500.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import stat
import urllib.parse
from collections.abc import Sequence

from PIL import Image

from codedance_jax.serve.errors import APIError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
DEFAULT_MAX_PIXELS = 25_000_000  # 25 MP: ~75 MB as RGB; the processor resizes far below this anyway.


def _bad(where: str, why: str) -> APIError:
    return APIError(400, f"{where}: {why}", param=where, code="invalid_image")


class LocalMedia:
    """The local files the server may read for clients: those under `roots` (see the module docstring)."""

    def __init__(self, roots: Sequence[str] = (), max_bytes: int = 64 << 20):
        self.roots = tuple(os.path.realpath(r) for r in roots)
        self.max_bytes = max_bytes

    def read(self, url: str, where: str) -> bytes:
        if not self.roots:
            raise _bad(where, "this server does not read local files or file:// URLs; send the image as a "
                       "data:image/...;base64, URL (the operator can allow directories with "
                       "--allowed_local_media_path)")
        denied = _bad(where, "cannot read the local image: it is not a world-readable file under the directories "
                      "this server serves images from (--allowed_local_media_path)")
        path = url
        if url.startswith("file:"):
            parts = urllib.parse.urlsplit(url)
            if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
                raise denied
            path = urllib.parse.unquote(parts.path)
        if not path.startswith("/") or "\x00" in path:
            raise _bad(where, "a local image must be an absolute path or a file:///absolute/path URL")
        real = os.path.realpath(path)
        for root in self.roots:
            if real != root and real.startswith(root.rstrip("/") + "/"):
                try:
                    data = self._read_under(root, os.path.relpath(real, root).split("/"))
                except OSError:
                    data = None
                if data is not None:
                    return data
        raise denied

    def _read_under(self, root: str, parts: list[str]) -> bytes | None:
        """The file's bytes, walked from `root` by descriptor (no symlink followed); None if an
        unprivileged user could not read it there or it is not a regular file within max_bytes."""
        dir_flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
        fd = os.open(root, dir_flags)
        try:
            for name in parts[:-1]:
                if not os.fstat(fd).st_mode & stat.S_IXOTH:
                    return None
                nfd = os.open(name, dir_flags | os.O_NOFOLLOW, dir_fd=fd)
                os.close(fd)
                fd = nfd
            if not os.fstat(fd).st_mode & stat.S_IXOTH:
                return None
            # O_NONBLOCK: a FIFO opens at once (and is refused below) instead of blocking the server.
            ffd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
        finally:
            os.close(fd)
        try:
            st = os.fstat(ffd)
            if not stat.S_ISREG(st.st_mode) or not st.st_mode & stat.S_IROTH or st.st_size > self.max_bytes:
                return None
            with os.fdopen(ffd, "rb", closefd=False) as f:
                return f.read(self.max_bytes)
        finally:
            os.close(ffd)


def decode_image(raw: bytes, where: str, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """An RGB image from PNG, JPEG, WebP or GIF bytes, its size checked before decoding (400 if not)."""
    try:
        img = Image.open(io.BytesIO(raw), formats=FORMATS)
    except Exception as e:  # noqa: BLE001  (UnidentifiedImageError, and whatever a corrupt header raises)
        raise _bad(where, f"cannot read the image: not a PNG, JPEG, WebP or GIF image ({type(e).__name__})") from e
    w, h = img.size
    if w < 1 or h < 1:
        raise _bad(where, "the image is empty")
    if w * h > max_pixels:
        raise _bad(where, f"the image is {w}x{h} = {w * h} pixels; this server decodes at most {max_pixels}")
    try:
        img.load()  # a GIF or animated WebP stays on its first frame
        return img.convert("RGB")
    except Exception as e:  # noqa: BLE001  (a corrupt image body: SyntaxError, zlib.error, OSError, ...)
        raise _bad(where, f"cannot decode the image ({type(e).__name__}: {e})") from e


def load_image(url: str, where: str, local: LocalMedia | None = None,
               max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """A PIL RGB image from a data URL, or a local path / file:// URL that `local` allows."""
    if not isinstance(url, str) or not url:
        raise _bad(where, "image_url.url must be a non-empty string")
    if url.startswith(("http://", "https://")):
        raise _bad(where, "remote image URLs are not fetched by this server; send the image as a "
                   "data:image/...;base64, URL")
    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        if ";base64" not in header:
            raise _bad(where, "only base64 data URLs are supported (data:image/png;base64,...)")
        try:
            raw = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise _bad(where, f"the data URL is not valid base64 ({e})") from e
    else:
        raw = (local or LocalMedia()).read(url, where)
    return decode_image(raw, where, max_pixels)
