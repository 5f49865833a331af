"""Sandbox for model-written Python: stateful sessions, atomic cells, hostile code contained.

    from sandbox import SandboxPool, ExecResult
    with SandboxPool(num_workers=4, timeout_s=15.0, memory_mb=2048) as pool:
        session = pool.new_session(files={"image.png": png_bytes})
        result = session.execute("from PIL import Image; Image.open('image.png').show()")

Design: one warm zygote per pool (numpy, PIL, matplotlib/Agg, cv2 imported) forks sessions and
keeps a few set up ahead of demand (namespaces, cgroups, uid, Landlock, holder), so that
`new_session` only hands one over and writes its files; a session's holder process owns its
variables and forks one child per cell. A successful child
becomes the next holder; a failed one is discarded, so the namespace rolls back for free. Files
roll back from a mirror (sandbox.workdir). The supervisor of each session, outside the cell,
enforces the time limit and kills leftovers. Layout: pool.py (trainer side), zygote.py,
supervisor.py (session set-up and cell control), cell.py (holder and cell, untrusted),
owner.py (`PoolThread`: a pool kept in its own long-lived thread, for trainers and evaluators),
figures.py (image capture, disabled GUI/console calls), workdir.py, isolation.py, wire.py.

Protected against, and by what (several layers per threat where the kernel allows):
- network, loopback included: a new net namespace per session (only a down `lo`), and Landlock
  TCP bind/connect denial (ABI >= 4); abstract unix sockets are per net namespace.
- reading or writing outside the working directory: Landlock allows reads only of system and
  interpreter trees (/usr, /lib*, /bin, a few /etc files, the venv and Python prefix) and writes
  only to the session's own tmpfs at /tmp (cwd /tmp/work) and /dev/shm; the session runs as its own
  unprivileged uid, so root-only files (/etc/shadow, /root) are closed even without Landlock;
  /root is covered by an empty tmpfs with only the interpreter bound back read-only.
- other processes: a pid namespace per session with its own /proc (the trainer, the zygote and
  other sessions have no pid there, so they cannot be signalled or inspected); Landlock signal
  scoping (ABI >= 6); the supervisor is non-dumpable (no ptrace) and, as pid 1, ignores signals.
- host environment variables: the zygote starts with a scrubbed environment and cells see a fixed
  one, so neither os.environ nor /proc/self/environ carries the trainer's secrets.
- memory: a cgroup v1 memory limit per session (OOM kills the cell, preferred by
  oom_score_adj=1000) plus a soft RLIMIT_AS per cell, so big allocations fail fast as MemoryError.
- processes: pids cgroup and RLIMIT_NPROC (per-session uid); fork bombs fail with EAGAIN.
- disk and inodes: a size- and inode-limited tmpfs per session, RLIMIT_FSIZE; open files:
  RLIMIT_NOFILE; CPU: wall-clock limit, soft RLIMIT_CPU per cell, CFS quota per session.
- hangs: the limit is enforced by the supervisor with SIGKILL, so ignoring SIGALRM, C loops and
  blocked syscalls do not help; input(), cv2.imshow, plt.pause raise; stdin is /dev/null.
- leftovers: after every cell all processes of the session but the holder are killed; closing a
  session makes its anchor kill its pid-namespace init, which makes the kernel kill the rest
  (close returns once they are gone); the zygote dies when
  the trainer does (socket EOF, PDEATHSIG), taking every session with it.

NOT protected against / limits:
- kernel exploits: there is no seccomp filter and no VM (gVisor was too slow); the cell talks to
  the host kernel with the syscalls an unprivileged process has.
- reads of world-readable files outside the allowed trees when Landlock is missing (the pool
  logs this at start-up); CPU side channels; timing.
- a cell can break its *own* session (kill its holder, corrupt its interpreter through gc); that
  session then answers "crashed" with "session lost", others are unaffected.
- threads started by a successful cell keep running in the holder between cells (bounded by the
  session's CPU quota and pids limit), and /dev/shm is not rolled back.
- the pid, mount, ipc and uts namespaces are required (the pool refuses to start without them);
  missing net namespaces, Landlock or cgroups are reported once at start-up and skipped.
"""

from sandbox.owner import PoolThread
from sandbox.pool import SandboxError, SandboxPool, Session
from sandbox.result import ExecResult

__all__ = ["ExecResult", "PoolThread", "SandboxError", "SandboxPool", "Session"]
