"""Throughput of the sandbox pool against a naive subprocess-per-cell baseline (issue 3).

    .venv/bin/python benchmarks/sandbox_throughput.py [--workers N] [--baseline-sessions 8]

Workloads: a trivial cell; a realistic image cell (open a 1024x768 image, crop, draw boxes,
histogram plot, show); 64 sessions x 6 cells. The baseline starts a fresh `python` per cell and
re-runs the session's previous cells to restore state (what stateless sandboxes do); it runs on
fewer sessions (its rate, not its total, is compared). Prints a table and writes
benchmarks/results/sandbox_throughput.json. Targets on 2 cores: >= 300 trivial cells/s, >= 25
realistic cells/s, session start <= 50 ms, >= 50x the baseline on the 6-cell workload.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import io
import json
import os
import resource
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sandbox import SandboxPool  # noqa: E402

TRIVIAL = "x = 1 + 1\nprint(x)"
REALISTIC = textwrap.dedent("""\
    from PIL import Image, ImageDraw
    import numpy as np
    import matplotlib.pyplot as plt
    im = Image.open('image.png').convert('RGB')
    crop = im.crop((128, 96, 768, 576))
    d = ImageDraw.Draw(crop)
    for i in range(6):
        d.rectangle((20 + 60 * i, 30, 70 + 60 * i, 120 + 20 * i), outline='red', width=3)
    g = np.asarray(crop.convert('L'))
    plt.figure(figsize=(4, 3))
    plt.hist(g.ravel(), bins=64)
    plt.title(f'mean {g.mean():.1f}')
    plt.show()
""")
SIX_CELLS = [
    "from PIL import Image, ImageDraw\nimport numpy as np\nim = Image.open('image.png').convert('RGB')"
    "\nprint(im.size)",
    "crop = im.crop((128, 96, 768, 576))\nprint(crop.size)",
    "d = ImageDraw.Draw(crop)\nfor i in range(6):\n"
    "    d.rectangle((20 + 60 * i, 30, 70 + 60 * i, 120), outline='red', width=3)",
    "g = np.asarray(crop.convert('L'))\nprint(g.mean(), g.std())",
    "import matplotlib.pyplot as plt\nplt.figure(figsize=(4, 3))\nplt.hist(g.ravel(), bins=64)"
    "\nplt.show()",
    "print((g > 128).sum())",
]
BASELINE_EPILOGUE = ("\nimport io, matplotlib.pyplot as _p\n"
                     "_imgs = [_p.figure(n).savefig(io.BytesIO(), format='png') "
                     "for n in _p.get_fignums()]\n")


def make_image() -> bytes:
    rng = np.random.default_rng(0)
    arr = (rng.random((768, 1024, 3)) * 255).astype(np.uint8)
    arr[200:500, 300:700] = (30, 160, 220)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def pct(xs, q):
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def run_cells(pool, image, code, n_threads, cells_per_thread):
    """n_threads sessions, each executing `code` repeatedly; returns cells/s and latencies."""
    sessions = [pool.new_session(files={"image.png": image}) for _ in range(n_threads)]
    for s in sessions:
        s.execute(code)  # first call in a fresh session pays one-time costs
    lat: list[float] = []

    def worker(s):
        out = []
        for _ in range(cells_per_thread):
            t = time.perf_counter()
            r = s.execute(code)
            out.append(time.perf_counter() - t)
            assert r.status == "ok", r.stderr
        return out

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(n_threads) as ex:
        for out in ex.map(worker, sessions):
            lat += out
    wall = time.perf_counter() - t0
    for s in sessions:
        s.close()
    return {"cells": len(lat), "cells_per_s": len(lat) / wall, "p50_ms": pct(lat, 50) * 1e3,
            "p95_ms": pct(lat, 95) * 1e3}


def ours_six(pool, image, n_sessions, n_threads):
    starts, mems, lat = [], [], []

    def one(_):
        t = time.perf_counter()
        s = pool.new_session(files={"image.png": image})
        start = time.perf_counter() - t
        cell_lat = []
        for c in SIX_CELLS:
            t = time.perf_counter()
            r = s.execute(c)
            cell_lat.append(time.perf_counter() - t)
            assert r.status == "ok", r.stderr
        mem = s.memory_bytes()
        s.close()
        return start, mem, cell_lat

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(n_threads) as ex:
        for start, mem, cl in ex.map(one, range(n_sessions)):
            starts.append(start)
            lat += cl
            if mem is not None:
                mems.append(mem)
    wall = time.perf_counter() - t0
    return {"sessions": n_sessions, "cells": len(lat), "cells_per_s": len(lat) / wall,
            "p50_ms": pct(lat, 50) * 1e3, "p95_ms": pct(lat, 95) * 1e3,
            "session_start_p50_ms": pct(starts, 50) * 1e3,
            "session_start_p95_ms": pct(starts, 95) * 1e3,
            "session_memory_mb_median": pct(mems, 50) / 2**20 if mems else None}


def baseline_cell(workdir, prior, code):
    src = "\n".join(prior + [code]) + BASELINE_EPILOGUE
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", src], cwd=workdir, capture_output=True, timeout=60,
                       env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "MPLBACKEND": "Agg",
                            "OPENBLAS_NUM_THREADS": "1", "HOME": workdir})
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    return time.perf_counter() - t


def baseline(image, cells_of_session, n_sessions, n_threads):
    lat, starts = [], []

    def one(_):
        with tempfile.TemporaryDirectory() as d:
            t = time.perf_counter()
            with open(os.path.join(d, "image.png"), "wb") as f:
                f.write(image)
            start = time.perf_counter() - t
            out = [baseline_cell(d, cells_of_session[:i], c)
                   for i, c in enumerate(cells_of_session)]
        return start, out

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(n_threads) as ex:
        for start, out in ex.map(one, range(n_sessions)):
            starts.append(start)
            lat += out
    wall = time.perf_counter() - t0
    return {"sessions": n_sessions, "cells": len(lat), "cells_per_s": len(lat) / wall,
            "p50_ms": pct(lat, 50) * 1e3, "p95_ms": pct(lat, 95) * 1e3,
            "session_start_p50_ms": pct(starts, 50) * 1e3}


def baseline_memory_mb(image) -> float:
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "image.png"), "wb") as f:
            f.write(image)
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        baseline_cell(d, [], SIX_CELLS[0] + "\n" + "\n".join(SIX_CELLS[1:]))
        after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(after, before) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2 * (os.cpu_count() or 2))
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--baseline-sessions", type=int, default=8)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results", "sandbox_throughput.json"))
    args = ap.parse_args()
    image = make_image()
    w = args.workers
    res: dict = {"cpus": os.cpu_count(), "workers": w}
    t = time.perf_counter()
    with SandboxPool(num_workers=w, timeout_s=15.0, memory_mb=2048) as pool:
        res["pool_start_s"] = time.perf_counter() - t
        res["layers_missing"] = pool.layers["missing"]
        res["ours_trivial"] = run_cells(pool, image, TRIVIAL, w, 150)
        res["ours_realistic"] = run_cells(pool, image, REALISTIC, w, 15)
        res["ours_6cell"] = ours_six(pool, image, args.sessions, w)
    res["baseline_trivial"] = baseline(image, [TRIVIAL] * 1, 4 * w, w)
    res["baseline_realistic"] = baseline(image, [REALISTIC] * 1, 2 * w, w)
    res["baseline_6cell"] = baseline(image, SIX_CELLS, args.baseline_sessions, w)
    res["baseline_session_memory_mb"] = baseline_memory_mb(image)
    res["ratio_6cell"] = res["ours_6cell"]["cells_per_s"] / res["baseline_6cell"]["cells_per_s"]
    res["ratio_trivial"] = (res["ours_trivial"]["cells_per_s"]
                            / res["baseline_trivial"]["cells_per_s"])
    res["ratio_realistic"] = (res["ours_realistic"]["cells_per_s"]
                              / res["baseline_realistic"]["cells_per_s"])

    print(f"{'workload':<22}{'cells/s':>10}{'p50 ms':>10}{'p95 ms':>10}   notes")
    for key in ("trivial", "realistic", "6cell"):
        for who in ("ours", "baseline"):
            r = res[f"{who}_{key}"]
            note = ""
            if "session_start_p50_ms" in r:
                note = f"session start p50 {r['session_start_p50_ms']:.1f} ms"
            print(f"{who + ' ' + key:<22}{r['cells_per_s']:>10.1f}{r['p50_ms']:>10.1f}"
                  f"{r['p95_ms']:>10.1f}   {note}")
        print(f"{'  ratio':<22}{res['ratio_' + key]:>10.1f}x")
    print(f"per-session memory: ours {res['ours_6cell']['session_memory_mb_median']} MB "
          f"(cgroup, median), baseline {res['baseline_session_memory_mb']:.0f} MB (peak RSS of "
          f"one interpreter)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
