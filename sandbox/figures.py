"""Graphical output of a cell, returned as PNG bytes, and the GUI/console calls that are disabled.

Runs inside the sandboxed process. Captured: figures passed to `plt.show()` / `Figure.show()`,
figures still open at the end of a cell, `PIL.Image.show()`, and image files created or changed
in the working directory. Each image is scaled down to at most `max_pixels`; at most `max_images`
per cell are kept and the rest are counted in a note on stderr.
"""

from __future__ import annotations

import builtins
import io
import math
import os

IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")

_shown: list[bytes] = []
_limits = {"max_images": 8, "max_pixels": 4_000_000}
_dropped = [0]


class DisabledInSandbox(RuntimeError):
    """A call that would block on a console or a window, which the sandbox does not have."""


def _disabled(what: str, hint: str):
    def refuse(*_a, **_k):
        raise DisabledInSandbox(f"{what} is not available in the sandbox: {hint}")
    refuse.__name__ = what
    return refuse


def _full() -> bool:
    return len(_shown) >= _limits["max_images"]


def _keep(render) -> None:
    """Render (a callable giving PNG bytes) only while there is room: counting an image as
    dropped costs nothing, rendering 200 figures to drop 195 of them costs the cell's time."""
    if _full():
        _dropped[0] += 1
        return
    png = render()
    if png is not None:
        _shown.append(png)


def figure_png(fig) -> bytes:
    w, h = fig.get_size_inches()
    dpi = fig.dpi
    if w * h * dpi * dpi > _limits["max_pixels"]:
        dpi = math.sqrt(_limits["max_pixels"] / (w * h)) * 0.99
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, pil_kwargs={"compress_level": 1})
    return buf.getvalue()


def pil_png(im) -> bytes:
    from PIL import Image
    if im.width * im.height > _limits["max_pixels"]:
        s = math.sqrt(_limits["max_pixels"] / (im.width * im.height))
        im = im.resize((max(1, int(im.width * s)), max(1, int(im.height * s))),
                       Image.Resampling.BILINEAR)
    if im.mode not in ("1", "L", "LA", "RGB", "RGBA", "P"):
        im = im.convert("RGBA" if "A" in im.getbands() else "RGB")
    buf = io.BytesIO()
    im.save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def _file_png(path: str) -> bytes:
    from PIL import Image

    with Image.open(path) as im:
        # A file is decoded in full before it is scaled down: refuse decompression bombs first.
        if im.width * im.height > _FILE_PIXELS_FACTOR * _limits["max_pixels"]:
            raise ValueError(f"{im.width}x{im.height} is too large to return")
        im.load()
        return pil_png(im)


_FILE_PIXELS_FACTOR = 16


def install(max_images: int, max_pixels: int) -> None:
    """Patch the libraries once in the session's first process; forks inherit the patches."""
    _limits.update(max_images=max_images, max_pixels=max_pixels)
    import cv2
    import matplotlib
    import matplotlib.figure
    import matplotlib.pyplot as plt
    from PIL import Image

    matplotlib.use("Agg", force=True)

    def show(*_a, **_k):
        for num in plt.get_fignums():
            _keep(lambda num=num: figure_png(plt.figure(num)))
        plt.close("all")

    plt.show = show
    matplotlib.figure.Figure.show = lambda self, *a, **k: _keep(lambda: figure_png(self))
    plt.pause = _disabled("plt.pause()", "it needs an interactive window; call plt.show()")
    plt.waitforbuttonpress = _disabled("plt.waitforbuttonpress()", "there is no window")
    plt.ginput = _disabled("plt.ginput()", "there is no window")
    Image.Image.show = lambda self, *a, **k: _keep(lambda: pil_png(self))
    for name in ("imshow", "namedWindow", "waitKey", "waitKeyEx", "selectROI", "destroyAllWindows",
                 "destroyWindow", "pollKey"):
        setattr(cv2, name, _disabled(f"cv2.{name}()", "there is no display; use plt.show() or "
                                     "Image.fromarray(img).show() to return an image"))
    builtins.input = _disabled("input()", "there is no console to read from")


def scan_images(root: str, limit: int = 2000) -> dict[str, tuple[int, int, int]]:
    """Image files under `root` with (inode, size, mtime_ns), to spot new or changed ones."""
    out: dict[str, tuple[int, int, int]] = {}
    stack = [root]
    seen = 0
    while stack and seen < limit:
        d = stack.pop()
        try:
            it = list(os.scandir(d))
        except OSError:
            continue
        for e in it:
            seen += 1
            try:
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                elif e.is_file(follow_symlinks=False) and e.name.lower().endswith(IMAGE_EXTS):
                    st = e.stat(follow_symlinks=False)
                    out[e.path] = (st.st_ino, st.st_size, st.st_mtime_ns)
            except OSError:
                continue
    return out


def collect(root: str, before: dict[str, tuple[int, int, int]]) -> tuple[list[bytes], list[str]]:
    """End of a cell: shown images, then figures left open, then new or changed image files."""
    notes = []
    import matplotlib.pyplot as plt

    for num in plt.get_fignums():
        try:
            _keep(lambda num=num: figure_png(plt.figure(num)))
        except Exception as e:  # a broken figure must not hide the cell's own result
            notes.append(f"[sandbox] figure {num} could not be rendered: {e!r}")
    plt.close("all")
    after = scan_images(root)
    for path in sorted(after):
        if before.get(path) == after[path]:
            continue
        try:
            _keep(lambda path=path: _file_png(path))
        except Exception as e:
            notes.append(f"[sandbox] image file {os.path.relpath(path, root)} not returned: {e!r}")
    if _dropped[0]:
        notes.append(f"[sandbox] {_dropped[0]} more image(s) dropped: at most "
                     f"{_limits['max_images']} per cell")
    images = list(_shown)
    reset()
    return images, notes


def reset() -> None:
    _shown.clear()
    _dropped[0] = 0
