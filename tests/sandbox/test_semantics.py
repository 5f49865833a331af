"""Paper semantics of the sandbox: persistence, atomic cells, figures, output, concurrency."""

import io
import os
import random
import struct
import time

import numpy as np
import pytest
from PIL import Image

PNG = b"\x89PNG\r\n\x1a\n"


def png_size(png: bytes) -> tuple[int, int]:
    assert png.startswith(PNG)
    return struct.unpack(">II", png[16:24])


def make_png(w=64, h=48) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.randint(0, 255, (h, w, 3), np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def test_files_and_namespace_persist(pool):
    img = make_png(64, 48)
    with pool.new_session(files={"image.png": img, "sub/notes.txt": b"hi"}) as s:
        r = s.execute("from PIL import Image\nim = Image.open('image.png')\n"
                      "def area(i):\n    return i.size[0] * i.size[1]\n"
                      "print(open('sub/notes.txt').read())")
        assert r.status == "ok", r.stderr
        assert r.stdout == "hi\n"
        r = s.execute("print(area(im), im.size)")
        assert (r.status, r.stdout) == ("ok", "3072 (64, 48)\n")
        r = s.execute("import os; print(os.getcwd(), sorted(os.listdir('.')))")
        assert r.stdout == "/tmp/work ['image.png', 'sub']\n"


@pytest.mark.parametrize("failure, status", [
    ("raise ValueError('boom')", "error"),
    ("while True:\n    pass", "timeout"),
    ("import ctypes\nctypes.string_at(0)", "crashed"),
])
def test_failed_cell_rolls_back_namespace_and_files(pool, failure, status):
    with pool.new_session(files={"keep.txt": b"original"}) as s:
        r = s.execute("x = [1, 2]\nopen('made.txt', 'w').write('v1')\nimport os\nos.mkdir('d')\n"
                      "open('d/f', 'w').write('in dir')")
        assert r.status == "ok", r.stderr
        r = s.execute("x.append(3)\ny = 7\nopen('made.txt', 'w').write('v2')\n"
                      "open('keep.txt', 'a').write(' changed')\nos.remove('d/f')\nos.rmdir('d')\n"
                      "open('new.txt', 'w').write('new')\nos.symlink('/etc/passwd', 'link')\n"
                      + failure)
        assert r.status == status, r.stderr
        r = s.execute("print(x, 'y' in globals(), open('made.txt').read(), open('keep.txt').read(),"
                      " open('d/f').read(), sorted(os.listdir('.')))")
        assert r.status == "ok", r.stderr
        assert r.stdout == "[1, 2] False v1 original in dir ['d', 'keep.txt', 'made.txt']\n"


def test_timeout_is_enforced_from_outside(pool):
    with pool.new_session() as s:
        t0 = time.monotonic()
        r = s.execute("import signal, time\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
                      "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nsignal.alarm(1)\n"
                      "time.sleep(60)")
        took = time.monotonic() - t0
        assert r.status == "timeout"
        assert 1.9 <= r.elapsed_s and took < 6.0
        assert "timeout" in r.stderr
        assert s.execute("print('alive')").stdout == "alive\n"


def test_figures_come_back_as_png(pool):
    with pool.new_session(files={"in.png": make_png(100, 80)}) as s:
        r = s.execute(
            "import matplotlib.pyplot as plt\nfrom PIL import Image\nimport cv2, numpy as np\n"
            "plt.plot([1, 2, 3]); plt.show()\n"        # shown
            "plt.figure(); plt.bar([1], [2])\n"         # left open
            "Image.new('RGB', (30, 20), 'red').show()\n")
        assert r.status == "ok", r.stderr
        assert len(r.images) == 3
        sizes = [png_size(p) for p in r.images]
        assert sizes[1] == (30, 20)                   # shown order: plt.show, PIL.show, open fig
        assert sizes[0] == sizes[2]                   # 640x480 scaled under the 300k-pixel cap
        assert 290_000 < sizes[0][0] * sizes[0][1] <= 300_000
        r = s.execute("cv2.imwrite('boxes.png', np.zeros((40, 50, 3), np.uint8))\n"
                      "im = Image.open('in.png'); im.crop((0, 0, 10, 10)).save('in.png')")
        assert r.status == "ok", r.stderr
        assert sorted(png_size(p) for p in r.images) == [(10, 10), (50, 40)]
        r = s.execute("print('nothing new')")
        assert r.images == []                          # figures were closed, files unchanged


def test_images_capped_in_count_and_pixels(pool):
    with pool.new_session() as s:
        r = s.execute("from PIL import Image\nfor i in range(5):\n"
                      "    Image.new('L', (2000, 1000)).show()")
        assert r.status == "ok", r.stderr
        assert len(r.images) == 3                      # max_images=3 in the test pool
        assert "2 more image(s) dropped" in r.stderr
        for p in r.images:
            w, h = png_size(p)
            assert w * h <= 300_000 and w / h == pytest.approx(2, rel=0.01)


def test_output_truncated_with_marker(pool):
    with pool.new_session() as s:
        r = s.execute("import sys\nprint('a' * 100000)\nsys.stderr.write('e' * 5000)")
        assert r.status == "ok"
        assert r.stdout.startswith("a" * 4096)
        assert "[... output truncated: 95905 more bytes ...]" in r.stdout
        assert "truncated: 904 more bytes" in r.stderr
        assert len(r.stdout) < 4200


def test_sessions_cannot_see_each_other(pool):
    a = pool.new_session(files={"a_only.txt": b"secret of a"})
    b = pool.new_session()
    try:
        assert a.execute("token = 'A-1234'\nimport os\nos.system('sleep 30 &')").status == "ok"
        r = b.execute("import os\nprint(sorted(os.listdir('/tmp/work')), 'token' in globals())\n"
                      "print(len([p for p in os.listdir('/proc') if p.isdigit()]))")
        assert r.stdout.splitlines()[0] == "[] False"
        assert int(r.stdout.splitlines()[1]) <= 3     # supervisor, holder, this cell: no others
    finally:
        a.close()
        b.close()


def test_rngs_are_reseeded_per_session(pool):
    code = "import random, numpy as np\nprint(random.random(), np.random.rand())"
    outs = set()
    for _ in range(3):
        with pool.new_session() as s:
            outs.add(s.execute(code).stdout)
    assert len(outs) == 3


def test_rng_state_carries_over_between_cells_and_rolls_back(pool):
    # Like any other state: random.seed() in one cell decides the next cell's draws (the holder
    # forks cells without CPython's at-fork handlers, one of which reseeded `random` per cell),
    # and a failed cell's draws are rolled back with it.
    seed = int(np.random.default_rng().integers(1 << 30))
    local, local_np = random.Random(seed), np.random.RandomState(seed)
    expect = [(local.random(), local_np.rand()) for _ in range(2)]
    with pool.new_session() as s:
        assert s.execute(f"import random, numpy as np\nrandom.seed({seed})\n"
                         f"np.random.seed({seed})").status == "ok"
        draw = "print(repr(random.random()), repr(np.random.rand()))"
        r = s.execute(draw)
        assert r.stdout == f"{expect[0][0]!r} {expect[0][1]!r}\n", r.stderr
        assert s.execute(draw + "\nraise ValueError").status == "error"
        r = s.execute(draw)
        assert r.stdout == f"{expect[1][0]!r} {expect[1][1]!r}\n", r.stderr


def test_concurrent_sessions_get_their_own_results(pool):
    sessions = [pool.new_session(files={"id.txt": str(i).encode()}) for i in range(6)]
    try:
        futs = []
        for s in sessions:
            futs.append(s.submit("me = int(open('id.txt').read())\nimport time\n"
                                 "time.sleep(0.05 * (me % 3))\nacc = [me]"))
            futs.append(s.submit("acc.append(me * 10)"))
            futs.append(s.submit("print(acc, me)"))
        results = [f.result(timeout=30) for f in futs]
        for i in range(6):
            assert results[3 * i + 2].stdout == f"[{i}, {i * 10}] {i}\n"
    finally:
        for s in sessions:
            s.close()


def _uids_running(uid: int) -> list[int]:
    pids = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                for line in open(f"/proc/{p}/status"):
                    if line.startswith("Uid:") and int(line.split()[1]) == uid:
                        pids.append(int(p))
            except OSError:
                pass
    return pids


def test_nothing_left_running_after_close(pool):
    s = pool.new_session()
    r = s.execute("import os, subprocess\nsubprocess.Popen(['sleep', '100'], start_new_session=True)"
                  "\nprint(os.getuid())")
    uid = int(r.stdout)
    # A successful cell's leftovers are already gone; start one more inside the holder's tree.
    s.execute("import os\npid = os.fork()\nif pid == 0:\n    os.setsid()\n"
              "    import time; time.sleep(100)")
    assert len(_uids_running(uid)) >= 2                # supervisor and holder at least
    s.close()
    assert _uids_running(uid) == []


def test_same_size_rewrite_right_after_start_is_kept(pool):
    # The file mirror trusts timestamps only for files older than one clock tick; a rewrite
    # (same size) right after the session's files were mirrored must still be committed.
    for i in range(3):
        with pool.new_session(files={"a.txt": b"0000"}) as s:
            assert s.execute(f"open('a.txt', 'w').write('{i}' * 4)").status == "ok"
            assert s.execute("open('a.txt', 'w').write('xxxx')\nraise ValueError").status == "error"
            assert s.execute("print(open('a.txt').read())").stdout == f"{i}{i}{i}{i}\n"


def test_pool_without_spare_sessions(pool):
    from sandbox import SandboxPool

    with SandboxPool(num_workers=1, timeout_s=2.0, memory_mb=256, spare_sessions=0) as p:
        with p.new_session(files={"f.txt": b"hi"}) as s:
            assert s.execute("print(open('f.txt').read())").stdout == "hi\n"


def test_pools_alive_at_once_use_disjoint_uids(pool):
    """Each live pool holds its own uid range (an flock per range), so no session of one pool
    shares a uid with a session of another, even from the same process (same pid modulo)."""
    from sandbox import SandboxPool

    def uid(p):
        with p.new_session() as s:
            r = s.execute("import os\nprint(os.getuid())")
            assert r.status == "ok", r.stderr
            return int(r.stdout)

    import fcntl

    from sandbox import pool as pool_module

    with SandboxPool(num_workers=1, timeout_s=2.0, memory_mb=256, spare_sessions=0) as p:
        a, b = uid(pool), uid(p)
        assert a // 1000 != b // 1000, (a, b)
        lock = os.path.join(pool_module._UID_LOCK_DIR, f"uids-{(b - pool_module._UID_BASE) // 1000}.lock")
        fd = os.open(lock, os.O_RDWR)
        with pytest.raises(BlockingIOError):  # held while the pool lives
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # and given back when it closes
    os.close(fd)
