"""How every launcher fails: `runner.run(main)` instead of `app.run(main)`.

- A user error exits with status 2 and one or two lines on stderr that name the file, field or
  flag, what is wrong and the fix; no traceback. User errors are `codedance_jax.errors.UserError`
  (raised by the library where it detects bad input) and the cases translated here: a bad flag
  (unknown, missing, wrong type), a config field that does not exist, a config file that does not
  load, a missing or unreadable path (a symlink loop included), a port in use, a full disk (also
  when it surfaces wrapped, as orbax reports it from its writer threads). Loaders read checkpoint
  files through `codedance_jax.input_files`, so truncated or pointer weights, configs that are not
  JSON and broken orbax checkpoints arrive here as `CheckpointError`. The 'Event loop is closed'
  reports that tensorstore's late callbacks print after such a failure are dropped.
- Anything else is a bug: the traceback is printed and the status is 1 (Python's default).
- `--verbose` (or `CODEDANCE_VERBOSE=1`) prints the traceback of user errors too.
- After an error in a training run, the last line says which checkpoint is intact and how to
  resume (`codedance_jax.train.run_record` knows the run's workdir).

A new launcher adopts all of it by ending with `runner.run(main)`.
"""

from __future__ import annotations

import errno
import gc
import os
import re
import sys
import traceback

from absl import app, flags

from codedance_jax.errors import UserError, disk_full
from sandbox.pool import SandboxUnavailable

flags.DEFINE_bool("verbose", False, "Show the traceback of user errors too (also: CODEDANCE_VERBOSE=1).")

VERBOSE_ENV = "CODEDANCE_VERBOSE"
EXIT_USER_ERROR = 2
# OSErrors that mean "the path or port you gave": everything else stays a bug.
_USER_ERRNOS = {errno.ENOENT, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.EROFS,
                errno.ENOSPC, errno.EDQUOT, errno.EADDRINUSE, errno.ELOOP}
_OS_FIXES = {
    errno.ENOENT: "check the path given on the command line or in the config",
    errno.EACCES: "choose a path you can read/write, or fix its permissions",
    errno.EPERM: "choose a path you can read/write, or fix its permissions",
    errno.ENOTDIR: "a parent of this path is a file, not a directory: choose another path",
    errno.EISDIR: "this path is a directory; give a file",
    errno.EEXIST: "this path exists and is in the way: choose another one or remove it",
    errno.EROFS: "the file system is read-only: choose a writable path",
    errno.ENOSPC: "free disk space or choose another workdir; re-run the same command to resume",
    errno.EDQUOT: "free disk space (your quota is used up) or choose another workdir; re-run the same command to resume",
    errno.ELOOP: "a symbolic link on this path resolves to itself: replace it with what it should point to",
    errno.EADDRINUSE: "another process holds this port: stop it or choose another port",
}


def _verbose(argv) -> bool:
    if os.environ.get(VERBOSE_ENV, "") not in ("", "0", "false", "False"):
        return True
    if flags.FLAGS.is_parsed():
        return flags.FLAGS.verbose
    return any(a in ("--verbose", "--verbose=true", "--verbose=True", "--verbose=1") for a in argv)


def _prog() -> str:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return spec.name if spec is not None and spec.name else os.path.basename(sys.argv[0])


def fail(message: str, fix: str = "", *, exc: BaseException | None = None, argv=()) -> None:
    """Print a user error (one or two lines) and exit with status 2."""
    if exc is not None and _verbose(argv or sys.argv):
        traceback.print_exception(exc, file=sys.stderr)
    lines = [f"{_prog()}: error: {message}"]
    if fix:
        lines.append(f"  fix: {fix}")
    hint = _resume_hint()
    if hint:
        lines.append(f"  {hint}")
    sys.stderr.write("\n".join(lines) + "\n")
    sys.stderr.flush()
    _exit(EXIT_USER_ERROR)


def _exit(code: int) -> None:
    # A failed run may leave non-daemon threads (a sandbox pool, an async checkpoint save) that would
    # keep the process alive after sys.exit; leaving at once loses nothing: a checkpoint is renamed
    # into place only when complete, and metrics.jsonl is flushed line by line.
    import threading

    others = [t for t in threading.enumerate() if t is not threading.current_thread() and not t.daemon and t.is_alive()]
    if others:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _resume_hint() -> str:
    if "codedance_jax.train.run_record" not in sys.modules:
        return ""
    from codedance_jax.train import run_record

    return run_record.resume_hint()


def _last_line(text: str) -> str:
    """The last line of a (formatted) exception, without its type: what a person needs to read."""
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else str(text)
    return re.sub(r"^[A-Za-z_.]*(Error|Exception): ", "", last)


def _config_flag_names() -> list[str]:
    from ml_collections.config_flags import config_flags

    fl = flags.FLAGS
    return [n for n in fl if isinstance(fl[n].parser, config_flags.ConfigFileFlagParser)]


def _unknown_field(e: BaseException, argv) -> tuple[str, str]:
    """A `--config.a.b=v` naming a field the config does not have (ml_collections raised KeyError or
    AttributeError while parsing flags) -> (message, fix)."""
    text = e.args[0] if e.args else str(e)
    text = str(text)
    key = re.search(r"[A-Za-z_]\w*", text)  # the field: the first name in "'\\'lrr\\'\\nDid you mean ..."
    key = key.group(0) if key else "?"
    hint = re.search(r'Did you mean "([^"]+)"', text)
    names = _config_flag_names()
    culprit = next((a.split("=", 1)[0] for a in argv if any(a.startswith(f"--{n}.") for n in names)
                    and key in a.split("=", 1)[0].split(".")), None)
    config_arg = next((a.split("=", 1)[1] for a in argv if any(a.startswith(f"--{n}=") for n in names)), "")
    where = f" in {config_arg}" if config_arg else ""
    msg = f"{culprit or '--config.' + key}: the config{where} has no field {key!r}"
    fix = f'did you mean "{hint.group(1)}"?' if hint else "see the config file for the fields it defines"
    return msg, fix


def _flags_error(e: flags.Error) -> tuple[str, str]:
    text = str(e)
    marker = ": Error whilst parsing config file"
    if marker in text:  # a config file's get_config raised: keep its last line
        flag = text.split(marker, 1)[0].removeprefix("flag ")
        return f"{flag}: {_last_line(text)}", "fix the config file or its argument (after the ':')"
    if text.startswith("flag --") and ": " in text:
        flag, why = text.split(": ", 1)
        flag = flag.removeprefix("flag ")
        name = flag.split("=", 1)[0]
        if "must have a value other than None" in why:
            return f"{name} is required", f"pass {name}=...; see --helpshort"
        if any(s in why for s in ("invalid literal", "could not convert", "Could not parse", "not a valid")):
            return f"{flag}: {_last_line(why)}", f"give {name} a value of its type; see --helpfull"
        return f"{flag}: {_last_line(why)}", "see --helpshort for the flags"
    return _last_line(text), "see --helpshort for the flags"


def parse_flags(argv):
    """absl's flag parsing, with every failure reported as a user error (status 2)."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        fail(*_flags_error(e), exc=e, argv=argv)
    except (KeyError, AttributeError) as e:  # ml_collections: an override of a field that does not exist
        fail(*_unknown_field(e, argv), exc=e, argv=argv)
    except (TypeError, ValueError) as e:
        fail(f"flags: {_last_line(str(e))}", "see --helpfull", exc=e, argv=argv)


def _check_config_flags() -> None:
    """ml_collections defers a missing config file until the config is first read: check it now."""
    for name in _config_flag_names():
        try:
            flags.FLAGS[name].value.keys()
        except OSError as e:
            path = str(getattr(flags.FLAGS[name], "config_filename", "") or "")
            if not os.path.isfile(path):
                fail(f"--{name}={path}: no such config file", "give one of the files under configs/ (see --helpshort)")
            fail(f"--{name}: {_last_line(str(e))}", "fix the config file")


def _translate(e: BaseException) -> tuple[str, str] | None:
    """A known user-error exception -> (message, fix); None for a bug."""
    if isinstance(e, UserError):
        return e.message, e.fix
    if isinstance(e, SandboxUnavailable):
        return str(e), e.fix
    if not isinstance(e, OSError) and disk_full(e):  # wrapped (orbax: a ValueError from a writer thread)
        path = re.search(r'"(/[^"]+)"', str(e))
        return (f"{path.group(1) + ': ' if path else ''}no space left on the device while writing",
                _OS_FIXES[errno.ENOSPC])
    if isinstance(e, OSError) and e.errno in _USER_ERRNOS:
        where = e.filename or ""
        what = e.strerror or str(e)
        if e.errno == errno.EADDRINUSE:
            return f"port in use: {what}{f' ({where})' if where else ''}", _OS_FIXES[e.errno]
        return f"{where}: {what}" if where else what, _OS_FIXES[e.errno]
    return None


def _quiet_late_callbacks(hook=sys.unraisablehook):
    """tensorstore calls back into orbax's event loop after a failed read or write has closed it,
    and each such call prints a 'RuntimeError: Event loop is closed' traceback: noise after the
    error that matters (a full disk, a damaged checkpoint), which the runner reports itself."""

    def quiet(u):
        if u.object is None and isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed":
            return
        hook(u)

    return quiet


def run(main, *, trains: bool = False) -> None:
    """`app.run(main)` with the user-error convention (see the module docstring).

    trains: the launcher runs training loops in its workdir; adds `--allow_config_change`.
    """
    if trains:
        flags.DEFINE_bool("allow_config_change", False,
                          "Continue in a workdir whose saved run config differs in fields that change the run.")

    def guarded(argv):
        _check_config_flags()
        if trains and flags.FLAGS.allow_config_change:
            from codedance_jax.train import run_record

            run_record.allow_config_change()
        try:
            return main(argv)
        except Exception as e:  # noqa: BLE001 -- sorted into user error (exit 2) or bug (re-raised)
            found = _translate(e)
            if found is None:
                hint = _resume_hint()
                if hint:
                    traceback.print_exception(e, file=sys.stderr)
                    sys.stderr.write(f"{hint}\n")
                    sys.stderr.flush()
                    _exit(1)
                raise
            fail(*found, exc=e)

    # Python's cyclic GC at its default thresholds (700, 10, 10) walks the whole heap (JAX, TF, the
    # tokenizer, compiled programs) hundreds of times a run: a warm-cache `launch.demo` mini run spent
    # 3.3 s of 48 s collecting (2,102 collections), 0.8 s with these (55). Timing only.
    gc.set_threshold(20_000, 20, 20)
    sys.unraisablehook = _quiet_late_callbacks()
    app.run(guarded, flags_parser=parse_flags)
