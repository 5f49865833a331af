"""Isolation a cell must not get around with ctypes or the kernel's less-known interfaces (issue 13).

Each test names the layer that closes it. None of them opens an AF_VSOCK socket or any other
virtualization channel: the families the filter refuses are checked with harmless ones.
"""

import json
import os
import socket
import subprocess
import sys
import tempfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SYSCALL = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
           "libc.syscall.restype = ctypes.c_long\n"
           "def sc(nr, *args):\n"
           "    r = libc.syscall(nr, *args)\n"
           "    return 'ok' if r >= 0 else os.strerror(ctypes.get_errno())\n")

KEYRING_SCRIPT = r"""
import ctypes, json, os, sys
sys.path.insert(0, sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
# The trainer's own session keyring, holding a secret, as a trainer's credentials may be.
assert libc.syscall(250, 1, b"codedance-trainer") >= 0        # KEYCTL_JOIN_SESSION_KEYRING
secret = b"trainer-key-payload-91c2"
assert libc.syscall(248, b"user", b"codedance-test-key", secret, len(secret), -3) >= 0
from sandbox import SandboxPool
cell = '''
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
out = {}
kid = libc.syscall(249, b"user", b"codedance-test-key", None, 0)          # request_key
out["request_key"] = kid if kid >= 0 else os.strerror(ctypes.get_errno())
kid = libc.syscall(250, 10, -3, b"user", b"codedance-test-key", 0)        # KEYCTL_SEARCH
out["search"] = kid if kid >= 0 else os.strerror(ctypes.get_errno())
if isinstance(out["search"], int):
    buf = ctypes.create_string_buffer(256)
    n = libc.syscall(250, 11, out["search"], buf, 256)                    # KEYCTL_READ
    out["read"] = buf.raw[:max(n, 0)].decode(errors="replace")
for ring in (-3, -4):                                                     # session, user
    r = libc.syscall(248, b"user", b"left-by-a-cell", b"x", 1, ring)
    out[f"add_key {ring}"] = r if r >= 0 else os.strerror(ctypes.get_errno())
print(out)
'''
with SandboxPool(num_workers=1, timeout_s=10.0, memory_mb=256, spare_sessions=0) as pool:
    with pool.new_session() as s:
        r = s.execute(cell)
print(json.dumps({"status": r.status, "stdout": r.stdout, "stderr": r.stderr}))
"""


def test_kernel_keyrings_are_out_of_reach(pool):
    # Layers: seccomp (keyctl/add_key/request_key refused) and a fresh session keyring per
    # session and in the zygote (the trainer's keys are not possessed). A fresh process, because
    # the key must be in the keyring the pool is started from.
    p = subprocess.run([sys.executable, "-c", KEYRING_SCRIPT, REPO], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["status"] == "ok", r["stderr"]
    assert "trainer-key-payload" not in r["stdout"]
    out = eval(r["stdout"])  # a dict of str/int printed by the cell
    assert all(v == "Operation not permitted" for v in out.values()), out


DENIED = {"ptrace(TRACEME)": "sc(101, 0, 0, 0, 0)",
          "process_vm_readv": "sc(310, os.getppid(), 0, 0, 0, 0, 0)",
          "bpf": "sc(321, 0, 0, 0)",
          "perf_event_open": "sc(298, ctypes.create_string_buffer(128), 0, -1, -1, 0)",
          "userfaultfd": "sc(323, 0)",
          "io_uring_setup": "sc(425, 1, ctypes.create_string_buffer(120))",
          "unshare(CLONE_NEWUSER)": "sc(272, 0x10000000)",
          "unshare(CLONE_NEWNS)": "sc(272, 0x00020000)",
          "clone(CLONE_NEWUSER)": "sc(56, 0x10000000 | 17, 0, 0, 0, 0)",
          "setns": "sc(308, 0, 0)",
          "mount": "sc(165, b'none', b'/tmp/work', b'tmpfs', 0, None)",
          "keyctl": "sc(250, 0, -3, 0)"}


def test_seccomp_closes_kernel_interfaces(pool):
    if "seccomp" in pool.layers["missing"]:
        pytest.skip(f"seccomp is off here: {pool.layers['missing']['seccomp']}")
    code = SYSCALL + "res = {}\n" + "".join(f"res[{k!r}] = {v}\n" for k, v in DENIED.items())
    code += "print(repr(res))"
    with pool.new_session() as s:
        r = s.execute(code)
        assert r.status == "ok", r.stderr
        res = eval(r.stdout)
        assert res == {k: "Operation not permitted" for k in DENIED}, res
        # Socket families beyond unix, inet and route netlink: refused on the number alone.
        r = s.execute("import socket\nout = []\n"
                      "for fam, typ, proto in ((17, 3, 0), (38, 5, 0), (16, 2, 15), (15, 3, 2)):\n"
                      "    try:\n        socket.socket(fam, typ, proto).close(); out.append('ok')\n"
                      "    except OSError as e:\n        out.append(e.strerror)\n"
                      "a, b = socket.socketpair(); a.send(b'x'); print(out, b.recv(1))\n"
                      "import threading, subprocess\nt = threading.Thread(target=print, args=(1,))\n"
                      "t.start(); t.join()\nprint(subprocess.run(['true']).returncode)")
        assert r.status == "ok", r.stderr
        refused = ["Address family not supported by protocol"] * 4
        assert r.stdout == f"{refused} b'x'\n1\n0\n"


@pytest.fixture
def host_dir():
    # World-readable and world-writable things in a host directory that is not /tmp or /run.
    base = "/var/lib" if os.access("/var/lib", os.W_OK) else REPO
    d = tempfile.mkdtemp(prefix="codedance-i13-", dir=base)
    os.chmod(d, 0o755)
    yield d
    subprocess.run(["rm", "-rf", d])


def test_host_unix_socket_and_files_unreachable(pool, host_dir):
    # Layer: the session's own root (pivot_root); Landlock has no rule for connect() on a
    # pathname socket, nor for utime/setxattr.
    path = os.path.join(host_dir, "runtime.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    os.chmod(path, 0o777)
    srv.listen(1)
    target = os.path.join(host_dir, "shared.txt")
    with open(target, "w") as f:
        f.write("host")
    os.chmod(target, 0o666)
    mtime = os.stat(target).st_mtime_ns
    try:
        with pool.new_session() as s:
            r = s.execute(f"import socket, os\nout = []\ns = socket.socket(socket.AF_UNIX)\n"
                          f"s.settimeout(1)\n"
                          f"for op in (lambda: s.connect({path!r}), lambda: os.utime({target!r}, (1, 1)),"
                          f" lambda: os.setxattr({target!r}, 'user.x', b'1'),"
                          f" lambda: os.chmod({target!r}, 0o777)):\n"
                          f"    try:\n        op(); out.append('ok')\n"
                          f"    except OSError as e:\n        out.append(type(e).__name__)\n"
                          f"print(out)")
            assert r.status == "ok", r.stderr
            assert "ok" not in r.stdout, r.stdout
        assert os.stat(target).st_mtime_ns == mtime
        srv.settimeout(0.1)
        with pytest.raises(TimeoutError):
            srv.accept()
    finally:
        srv.close()


def test_mount_table_and_home_are_the_sessions_own(pool):
    from sandbox import isolation, rootfs

    allowed = set(rootfs.SYSTEM_TREES + rootfs.ETC_FILES + rootfs.DEVICES
                  + isolation.python_read_paths() + ["/", "/proc", "/tmp", "/dev/shm"])
    with pool.new_session() as s:
        r = s.execute("print([l.split()[4] for l in open('/proc/self/mountinfo')])")
        assert r.status == "ok", r.stderr
        points = eval(r.stdout)
        assert set(points) <= allowed, set(points) - allowed
        host = [line.split()[4] for line in open("/proc/self/mountinfo")]
        assert len(points) < len(host) or set(host) <= allowed
        home = os.environ.get("HOME", "/root")
        r = s.execute("import os\nprint(os.environ['HOME'])\nfor p in os.listdir('/proc'):\n"
                      "    if p.isdigit():\n        try: print(open(f'/proc/{p}/environ').read())\n"
                      "        except OSError: pass")
        assert r.status == "ok", r.stderr
        assert r.stdout.startswith("/tmp/work\n")
        assert f"HOME={home}\0" not in r.stdout and f"HOME={home}\n" not in r.stdout
