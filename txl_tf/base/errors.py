"""Expected user errors and the one way every command-line entry point reports them.

An expected error (a bad flag or gin binding, a damaged or missing file, a refused overwrite) is printed as one
line on stderr,

    error: <what went wrong, naming the file or value>; <how to fix it>

and the program exits with status 2. A full disk (OSError ENOSPC / EDQUOT, or TensorFlow's "No space left on
device") is reported the same way, naming the file, its filesystem's free space and the fix; so is a write the
system refuses (OSError EROFS / EACCES / EPERM naming a file in a folder that cannot be written: a read-only file
system, no write permission), naming the folder and the reason. Anything else is a bug or an environment failure
and keeps its traceback. Nothing is printed after the error line (TensorFlow's logger is quieted first: objects
deleted at exit would warn about checkpoint values a failed restore left unread).

Every entry point runs through `errors.run(main)` (by way of `txl_tf.base.cli.run`) instead of `absl.app.run(main)`;
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
import tempfile
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


# A write the system refuses: a read-only file system, a folder or file without write permission, an immutable one.
_NOT_WRITABLE_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)
_NOT_WRITABLE_TEXTS = tuple(os.strerror(e) for e in _NOT_WRITABLE_ERRNOS)
_NOT_WRITABLE_PATH = re.compile(r"([^\s;{}]+); (?:" + "|".join(map(re.escape, _NOT_WRITABLE_TEXTS)) + ")")


def existing_folder(path: str) -> str:
    """`path` when it is a folder, else its nearest existing parent folder (absolute)."""
    folder = os.path.abspath(os.fsdecode(path))
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    return folder


def not_writable_reason(path) -> str | None:
    """Why no file can be created in the folder `path` (its nearest existing parent folder when it is missing or a
    file), as the system says it ("Read-only file system", "Permission denied", ...); None when one can. Tried
    with an unnamed temporary file (O_TMPFILE where the system has it), so nothing is left behind."""
    try:
        with tempfile.TemporaryFile(dir=existing_folder(path)):
            return None
    except OSError as error:
        return error.strerror or type(error).__name__


def not_writable(error: BaseException) -> UserError | None:
    """A UserError naming the folder and the reason when `error` (or an error it was raised from) is a write the
    system refused: an OSError EROFS, EACCES or EPERM that names a file, or TensorFlow's "<path>; Read-only file
    system" / "Permission denied", where that file's folder (or the existing file itself) cannot be written.
    None otherwise: a refusal without a file name, or one where the folder can be written (a read that was
    refused, or an operation other than writing), is a bug and keeps its traceback."""
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, OSError) and error.errno in _NOT_WRITABLE_ERRNOS and error.filename:
            path, reason = os.fsdecode(error.filename), os.strerror(error.errno)
            break
        text = str(error)
        if type(error).__module__.startswith("tensorflow") and any(t in text for t in _NOT_WRITABLE_TEXTS):
            match = _NOT_WRITABLE_PATH.search(text)
            if match:
                path, reason = match.group(1), next(t for t in _NOT_WRITABLE_TEXTS if t in text)
                break
        error, seen = error.__cause__ or error.__context__, seen + 1
    else:
        return None
    path = os.path.abspath(path)
    if os.path.isfile(path) and not os.access(path, os.R_OK):
        return None  # a file that cannot be read: not a refused write
    folder = existing_folder(path)
    file_refused = os.path.isfile(path) and not os.access(path, os.W_OK)
    if reason != os.strerror(errno.EROFS) and not file_refused and not_writable_reason(folder) is None:
        return None
    where = path if file_refused else folder
    return UserError(f"{where} is not writable ({reason}): writing {path} failed; make it writable, or give the "
                     "command a folder that is (e.g. another --model_dir or --output_dir) and re-run")


def _quiet_tensorflow() -> None:
    """Nothing follows an error line: TensorFlow's logger reports only errors from here on (a restore that failed
    leaves objects that, deleted at exit, warn about every checkpoint value they did not read)."""
    if "tensorflow" in sys.modules:
        import logging

        logging.getLogger("tensorflow").setLevel(logging.ERROR)


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
            known = None
            if isinstance(error, Exception) and not is_expected(error):
                known = disk_full(error) or not_writable(error)
            if not is_expected(error) and known is None:
                raise
            report(known or error)
            _quiet_tensorflow()
            sys.exit(EXIT_USER_ERROR)

    return guarded


def run(main: Callable[[list], object]) -> None:
    """`absl.app.run(main)` with one-line reporting of expected errors and flag errors (exit status 2)."""
    from absl import app

    app.run(guard(main), flags_parser=_parse_flags)
