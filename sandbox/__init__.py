"""Sandbox for model-written Python: stateful sessions, atomic cells, hostile code contained.

    from sandbox import SandboxPool, ExecResult
    with SandboxPool(num_workers=4, timeout_s=15.0, memory_mb=2048) as pool:
        session = pool.new_session(files={"image.png": png_bytes})
        result = session.execute("from PIL import Image; Image.open('image.png').show()")

Design: one warm zygote per pool (numpy, PIL, matplotlib/Agg, cv2 imported) forks sessions and
keeps a few set up ahead of demand (namespaces, root, cgroups, uid, Landlock, seccomp, holder), so
that `new_session` only hands one over and writes its files; a session's holder process owns its
variables and forks one child per cell. A successful child becomes the next holder; a failed one
is discarded, so the namespace rolls back for free. Files roll back from a mirror
(sandbox.workdir). The supervisor of each session, outside the cell, enforces the time limit and
kills leftovers. Layout: pool.py (trainer side), zygote.py, supervisor.py (session set-up and cell
control), rootfs.py (the session's filesystem), seccomp.py (the syscall filter), cell.py (holder
and cell, untrusted), owner.py (`PoolThread`: a pool in its own long-lived thread), figures.py (image capture, disabled GUI/console calls), workdir.py,
isolation.py, wire.py. Speed: a cell costs a fork and an exit of its holder (tens of MB of page
tables' worth of imported libraries), so the zygote moves its memory to 2 MB pages once after the
warm-up and holders fork cells with fork(2) itself; processes are named sbx-zygote, sbx-anchor,
sbx-supervisor, sbx-holder and sbx-cell (ps, top, perf).

Protected against, and by what (several layers per threat where the kernel allows):
- kernel attack surface a cell has no use for: a seccomp filter on the holder and every cell
  refuses keyctl/add_key/request_key, ptrace, process_vm_*, pidfd_getfd, bpf, perf_event_open,
  userfaultfd, io_uring, unshare/setns/clone with namespace flags, mount and the new mount API,
  pivot_root/chroot, module and kexec loading, and socket families other than unix, inet, inet6
  and route netlink (refused on the number, never opened); other ABIs (int 0x80, x32) kill.
- the trainer's kernel keys: the zygote and every session join a fresh session keyring (and
  seccomp closes the keyring calls); session uids are reused least-recently-freed first.
- network, loopback included: a new net namespace per session (only a down `lo`), and Landlock
  TCP bind/connect denial (ABI >= 4); abstract unix sockets are per net namespace.
- the host's files: the session's root is a fresh read-only tmpfs (pivot_root) holding only the
  system and interpreter trees, a few /etc files, four device nodes, /proc and a CPU part of /sys,
  all bound read-only; so host UNIX sockets, world-writable host files (utime, setxattr, chmod)
  and the host's mount table (/proc/self/mountinfo) are simply absent. On top, Landlock allows
  reads only of those trees and writes only to the session's own tmpfs at /tmp (cwd /tmp/work),
  /dev/shm and the session's /proc; the session runs as its own unprivileged uid.
- other processes: a pid namespace per session with its own /proc (the trainer, the zygote and
  other sessions have no pid there, so they cannot be signalled or inspected); Landlock signal
  scoping (ABI >= 6); the supervisor is non-dumpable (no ptrace) and, as pid 1, ignores signals.
- host environment variables: the zygote starts with a scrubbed environment (no HOME either) and
  cells see a fixed one, so neither os.environ nor /proc/*/environ carries the trainer's.
- memory: a cgroup v1 memory limit per session plus a soft RLIMIT_AS per cell, so big allocations
  fail fast as MemoryError; oom_score_adj is 1000 for a cell and 300 for the holder (the
  supervisor keeps 0), so an OOM kills the cell, not the state or the supervisor.
- processes: pids cgroup and RLIMIT_NPROC (per-session uid); fork bombs fail with EAGAIN.
- disk and inodes: a size- and inode-limited tmpfs per session, RLIMIT_FSIZE; open files:
  RLIMIT_NOFILE; CPU: wall-clock limit, soft RLIMIT_CPU per cell, CFS quota per session.
- hangs: the limit is enforced by the supervisor with SIGKILL, so ignoring SIGALRM, C loops and
  blocked syscalls do not help; input(), cv2.imshow, plt.pause raise; stdin is /dev/null; a
  stopped holder is continued (SIGCONT) before every cell.
- hostile output: everything the cell side writes is data behind an exception barrier: frames
  are size-capped JSON (deep nesting, odd types and huge numbers are rejected, never raised), any
  failure in the supervisor still answers the trainer (the session is then reported lost); images
  travel one per frame and raw to the trainer, and only PNGs that PIL decodes completely within
  max_image_pixels leave the session, re-encoded; figures beyond max_images are counted, not
  rendered; image files larger than 16x max_image_pixels are refused before decoding.
- state a cell leaves behind: a successful cell must end its threads (non-daemon ones are joined,
  any other thread fails the cell); timers, signal handlers and the signal mask are reset before
  it becomes the holder; every cell gets fresh sys.stdout/stderr/stdin; all RNGs (random, numpy,
  cv2) are reseeded per session, and within a session their state carries over between cells and
  rolls back with a failed one, like any other state (cells are forked with fork(2) itself, without
  CPython's at-fork handlers, one of which reseeded `random` in every cell).
- its own files: the snapshot walks by directory descriptor (no PATH_MAX limit), copes with any
  mode a cell sets on its directories, keeps hard links and holes, and restores files in place
  (same inode), so held file objects and MAP_SHARED mappings see the rolled-back contents; each
  cell gets its own open file description (same flags and offset) for every regular file the
  holder has open, so a failed cell's reads, writes and seeks leave the holder's offsets as they
  were.
- shared memory a failed cell wrote: holder and cell share the pages of every MAP_SHARED mapping,
  so such a write outlives the discarded cell. Mappings of the session's files roll back with the
  files (restored in place, above); anonymous shared memory is refused instead: seccomp fails
  mmap with MAP_SHARED|MAP_ANONYMOUS, shmget/shmat and memfd_create with EPERM (so
  `mmap.mmap(-1, n)`, MAP_SHARED by default, raises PermissionError; `flags=mmap.MAP_PRIVATE`
  works), and Landlock opens /dev/zero read-only. Not rolled back instead because the holder
  would have to list its mappings before every cell (/proc/self/maps: ~1.2 ms here, against
  ~2.7 ms for a whole trivial cell) and copy them, and nothing cells use needs it
  (multiprocessing keeps its shared memory in /dev/shm files).
- leftovers: after every cell all processes of the session but the holder are killed; closing a
  session, or dropping it without close() (the pool holds sessions weakly), makes its anchor kill
  its pid-namespace init, which makes the kernel kill the rest; the zygote dies when the trainer
  does (socket EOF, PDEATHSIG), taking every session with it.

NOT protected against / limits:
- kernel exploits through the syscalls that remain allowed (there is no VM: gVisor was too slow).
- reads of world-readable files inside the bound system and interpreter trees; CPU side channels;
  timing.
- a cell can break its *own* session (kill its holder, forge a result frame and keep running,
  corrupt its interpreter through gc); that session then answers "crashed"/"timeout" or "session
  lost", others are unaffected.
- a file the failed cell deleted or replaced comes back as a new inode (a held object keeps the
  old one); xattrs and /dev/shm (its files and their shared mappings) are not rolled back. File offsets are the cell's own (each cell
  reopens the holder's regular files, see below) except for a file whose mode no longer lets it be
  opened so, and for pipes and sockets; flock() locks stay with the holder's descriptions.
- the pid, mount, ipc and uts namespaces are required (the pool refuses to start without them);
  missing net namespaces, Landlock, seccomp (only x86-64 has a syscall table) or cgroups are
  reported once at start-up and skipped.
"""

from sandbox.owner import PoolThread
from sandbox.pool import SandboxError, SandboxPool, SandboxUnavailable, Session
from sandbox.result import ExecResult

__all__ = ["ExecResult", "PoolThread", "SandboxError", "SandboxPool", "SandboxUnavailable", "Session"]
