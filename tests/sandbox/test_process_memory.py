"""How a session's processes are laid out in memory and named (the speed work of issue 13)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Two private anonymous regions, 8 MB each, kept apart by an inaccessible one (PROT_NONE = 0) (so the kernel cannot
# merge them into one mapping): every page of the first is written, one page per 2 MB of the other.
_PROBE = r"""
import ctypes, json, mmap, os, random
from sandbox import isolation
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MB, page = 1 << 20, os.sysconf("SC_PAGE_SIZE")
base = libc.mmap(None, 26 * MB, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
start = (base + 2 * MB - 1) & ~(2 * MB - 1)
dense, sparse = start, start + 12 * MB
for lo in (dense, sparse):
    assert libc.mprotect(lo, 8 * MB, mmap.PROT_READ | mmap.PROT_WRITE) == 0
value = random.randrange(1, 255)
ctypes.memset(dense, value, 8 * MB)
for off in range(0, 8 * MB, 2 * MB):
    ctypes.memset(sparse + off, value, 1)
collapsed = isolation.collapse_anonymous_memory()
stats, cur = {}, None
for line in open("/proc/self/smaps"):
    head = line.split()
    if "-" in head[0] and not head[0].endswith(":"):
        lo = int(head[0].split("-")[0], 16)
        cur = {dense: "dense", sparse: "sparse"}.get(lo)
    elif cur and head[0] in ("Rss:", "AnonHugePages:"):
        stats[cur + "_" + head[0][:-1]] = int(head[1])
intact = ctypes.string_at(dense, 8 * MB) == bytes([value]) * (8 * MB)
print(json.dumps(dict(stats, collapsed=collapsed, intact=intact)))
"""


def _thp_mode() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "absent"
    return text[text.index("[") + 1:text.index("]")]


def test_collapse_backs_resident_anonymous_memory_with_huge_pages_and_skips_sparse_ranges():
    if sys.platform != "linux" or _thp_mode() in ("never", "absent"):
        pytest.skip("no transparent huge pages on this machine")
    if tuple(int(x) for x in os.uname().release.split(".")[:2]) < (6, 1):
        pytest.skip("MADV_COLLAPSE needs Linux >= 6.1")
    p = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["intact"]  # same contents after the move to huge pages
    assert r["dense_AnonHugePages"] == 8 * 1024, r  # all four 2 MB ranges
    assert r["collapsed"] >= 8 << 20
    # A reservation touched once per 2 MB is left alone: no memory made up for it.
    assert r["sparse_AnonHugePages"] == 0, r
    assert r["sparse_Rss"] <= 4 * os.sysconf("SC_PAGE_SIZE") // 1024 + 16, r


def test_session_processes_are_named_by_role(pool):
    with pool.new_session() as s:
        code = ("import os\ncomm = lambda p: open(f'/proc/{p}/comm').read().strip()\n"
                "print(comm('self'), comm(os.getppid()), comm(1))")
        r = s.execute(code)
        assert (r.status, r.stdout) == ("ok", "sbx-cell sbx-holder sbx-supervisor\n"), r.stderr
        # The cell that succeeded became the holder and took the holder's name; a failed one
        # is gone and the holder keeps its name.
        first = s.execute("import os\nprint(os.getpid())").stdout.strip()
        assert s.execute("raise ValueError").status == "error"
        r = s.execute(code + f"\nprint(os.getppid() == {first})")
        assert (r.status, r.stdout) == ("ok", "sbx-cell sbx-holder sbx-supervisor\nTrue\n"), r.stderr
