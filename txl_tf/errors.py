"""Expected user errors and the one way every command-line entry point reports them.

An expected error (a bad flag or gin binding, a damaged or missing file, a refused overwrite) is printed as one
line on stderr,

    error: <what went wrong, naming the file or value>; <how to fix it>

and the program exits with status 2. A full disk (OSError ENOSPC / EDQUOT, or TensorFlow's "No space left on
device") is reported the same way, naming the file, its filesystem's free space and the fix. Anything else is a
bug or an environment failure and keeps its traceback.

Every entry point runs through `errors.run(main)` (by way of `txl_tf.cli.run`) instead of `absl.app.run(main)`;
flag parsing errors get the same one-line form.
"""

from __future__ import annotations

import errno
import importlib
import io
import os
import re
import shutil
import sys
from collections.abc import Callable

EXIT_USER_ERROR = 2


class UserError(Exception):
    """An expected error whose message tells the user what to change (printed without a traceback)."""


class ConfigError(UserError, ValueError):
    """A gin binding, flag value or configuration field is unknown, of the wrong type or out of range."""


# Errors of the standard library that, raised by txl_tf code, name a path the user gave.
_EXPECTED = (UserError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError)


def require(module: str, needed_by: str, extra: str):
    """Imports and returns the optional dependency `module` (of the `txl_tf[extra]` extra in pyproject.toml);
    without it, a UserError naming the extra: `<needed_by> needs <module>: pip install 'txl_tf[<extra>]'`."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"{needed_by} needs {module}: pip install 'txl_tf[{extra}]'") from None


def one_line(error: BaseException) -> str:
    """The first line of an error's message (gin appends "In call to configurable ..." lines)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def is_expected(error: BaseException) -> bool:
    return isinstance(error, _EXPECTED)


# A full disk: the errnos of OSError and the texts TensorFlow's file errors carry ("<path>; No space left on device").
_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_DISK_FULL_TEXTS = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))
_DISK_FULL_PATH = re.compile(r"([^\s;{}]+); (?:" + "|".join(map(re.escape, _DISK_FULL_TEXTS)) + ")")


def _size(n: float) -> str:
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"


def _file_in_traceback(error: BaseException) -> str | None:
    """The name of an open file among the locals of the frames that raised `error`, innermost first (a plain
    `write` or `close` raises ENOSPC without a file name)."""
    frames, tb = [], error.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        for value in frame.f_locals.values():
            if isinstance(value, io.IOBase) and isinstance(getattr(value, "name", None), str):
                return value.name
    return None


def disk_full(error: BaseException) -> UserError | None:
    """A UserError naming the file, its filesystem's free space and the fix when `error` (or an error it was
    raised from) is a full disk or an exceeded quota; None otherwise."""
    seen = 0
    while error is not None and seen < 8:
        text = str(error)
        if isinstance(error, OSError) and error.errno in _DISK_FULL_ERRNOS:
            path = error.filename or _file_in_traceback(error)
            reason = os.strerror(error.errno)
            break
        if type(error).__module__.startswith("tensorflow") and any(t in text for t in _DISK_FULL_TEXTS):
            match = _DISK_FULL_PATH.search(text)
            path = match.group(1) if match else None
            reason = next(t for t in _DISK_FULL_TEXTS if t in text)
            break
        error, seen = error.__cause__ or error.__context__, seen + 1
    else:
        return None
    fix = ("free space there (or write elsewhere) and re-run the same command; it resumes (training from its last "
           "checkpoint)")
    if not path:
        return UserError(f"the disk is full ({reason}) and the file being written is unknown; {fix}")
    path = os.path.abspath(os.fsdecode(path))
    mount = os.path.dirname(path)
    while not os.path.isdir(mount):
        mount = os.path.dirname(mount)
    while not os.path.ismount(mount):
        mount = os.path.dirname(mount)
    try:
        usage = shutil.disk_usage(mount)
        space = f"{mount} has {_size(usage.free)} free now, of {_size(usage.total)}"
    except OSError:
        space = f"{mount} is full"
    return UserError(f"writing {path} failed ({reason}): {space}; {fix}")


def report(error: BaseException, stream=None) -> None:
    """Prints `error: <first line of the message>` on `stream` (stderr)."""
    print(f"error: {one_line(error)}", file=stream or sys.stderr, flush=True)


def _parse_flags(argv: list) -> list:
    from absl import flags

    try:
        return flags.FLAGS(argv)
    except flags.Error as error:
        report(ConfigError(f"{error}; see --helpshort"))
        sys.exit(EXIT_USER_ERROR)


def guard(main: Callable[[list], object]) -> Callable[[list], object]:
    """`main` wrapped so that expected errors print one line and exit with status 2."""

    def guarded(argv):
        try:
            return main(argv)
        except BaseException as error:  # noqa: BLE001  (re-raised unless expected)
            full = disk_full(error) if isinstance(error, Exception) and not is_expected(error) else None
            if not is_expected(error) and full is None:
                raise
            report(full or error)
            sys.exit(EXIT_USER_ERROR)

    return guarded


def check_output_file(path: str, flag: str, example: str = "out") -> None:
    """Raises UserError unless `path` can be written as a file (checked before the work that produces it): not a
    directory, and its nearest existing parent a writable directory (missing parents are created when written)."""
    if os.path.isdir(path):
        raise UserError(f"{flag}={path} is a directory; give a file path, e.g. {os.path.join(path, example)}")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UserError(f"{flag}={path}: {parent} is a file, not a directory; give a path in a directory")
    if not os.access(parent, os.W_OK):
        raise UserError(f"{flag}={path}: {parent} is not writable; give a path in a writable directory")


def run(main: Callable[[list], object]) -> None:
    """`absl.app.run(main)` with one-line reporting of expected errors and flag errors (exit status 2)."""
    from absl import app

    app.run(guard(main), flags_parser=_parse_flags)
