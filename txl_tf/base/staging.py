"""Directories written whole or not at all: built in a temporary sibling, then renamed into place.

    with staged_dir("exports/sample") as tmp:   # exports/sample.tmp-<pid>-xxxx/sample
        write_everything_into(tmp)
    # exports/sample now holds exactly what was written (a previous one is replaced whole)

The staging directories NAME.tmp-<pid>-xxxx (and NAME.old-<pid>-xxxx, which holds the previous NAME during the
swap) carry a marker file, MARKER, naming their writer (pid and host); what is written goes into a NAME folder
inside them, so only that folder is renamed into place and the marker never reaches the target. A process killed
at any moment leaves the target intact (or, killed between the two renames of a swap, inside a marked .old-
directory) plus marked staging directories; the next `staged_dir` of the same NAME removes those whose writer is
gone and puts a previous NAME back when the swap did not finish (`remove_stale`). A sibling without the marker
(a user's `data.old-2024`) is never touched.

Replace or refuse, in one step: a writer claims NAME for the whole write, from its check to its rename, with an
`fcntl.flock` on a lock file beside it, .NAME.txl_tf-lock (a note of the writer, like the staging directories'
marker; removed when the writer lets go; the kernel drops the lock of a killed writer, whose file stays until the
next writer of NAME removes it). Under the claim it checks what it may replace (`paths.replaceable_dir`), stages,
checks again and renames into place. A second writer of the same NAME is refused in one line at once; one that
comes after the first has finished finds the first one's output, which it replaces only as any existing output
(with overwrite, when the first is of its kind). What a refused writer staged is removed.

A NAME so long that NAME.tmp-<pid>-xxxx would not fit the file system's limit on names (255 bytes) gets siblings
named after a cut of it and a hash of the whole name (`stem`), so that every valid NAME can be written.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
import time
from collections.abc import Iterator

MARKER = ".txl_tf-staging"  # {"pid": ..., "host": ..., "target": NAME}, written when the directory is created
LOCK_SUFFIX = ".txl_tf-lock"  # the claim on NAME: .STEM.txl_tf-lock beside it, {"pid", "host", "since", "target"}
_ACTIVE: set = set()  # staging directories this process is writing (never stale, even for a reused pid)
_SIBLING_ROOM = 32  # bytes after the stem: ".tmp-<pid>-xxxxxxxx" or ".txl_tf-lock" and the leading dot
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


def stem(parent: str, base: str) -> str:
    """The start of the names of `base`'s staging siblings and lock file in `parent`: `base` itself, or, when those
    names would exceed the file system's limit on a name, a cut of `base` and a hash of all of it."""
    try:
        name_max = os.pathconf(parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    room = max(name_max - _SIBLING_ROOM, 24)
    raw = os.fsencode(base)
    if len(raw) <= room:
        return base
    return f"{os.fsdecode(raw[:room - 17])}~{hashlib.sha256(raw).hexdigest()[:16]}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _mark(path: str, base: str) -> None:
    with open(os.path.join(path, MARKER), "w") as f:
        json.dump({"pid": os.getpid(), "host": socket.gethostname(), "target": base, "written_by": "txl_tf.base.staging"},
                  f)
        f.write("\n")


def _writer_gone(path: str, pid_in_name: str) -> bool:
    """True when the writer named by `path`'s marker (or, if the marker is cut short, its name) has exited."""
    if path in _ACTIVE:
        return False
    try:
        with open(os.path.join(path, MARKER)) as f:
            owner = json.load(f)
        pid, host = int(owner["pid"]), owner["host"]
    except (OSError, ValueError, KeyError, TypeError):  # killed while writing the marker: the name has the pid
        pid, host = int(pid_in_name) if pid_in_name.isdigit() else None, socket.gethostname()
    if host != socket.gethostname():
        return False  # a writer on another machine sharing this folder: cannot tell, keep it
    return pid is None or pid == os.getpid() or not _alive(pid)  # our own pid here: a reused one (we are not writing)


def _discard(path: str) -> None:
    """Removes a staging directory, its marker last (a kill meanwhile leaves it marked, so still removable)."""
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(path):
            if name != MARKER:
                entry = os.path.join(path, name)
                if os.path.isdir(entry) and not os.path.islink(entry):
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        os.remove(entry)
        with contextlib.suppress(OSError):
            os.remove(os.path.join(path, MARKER))
        with contextlib.suppress(OSError):
            os.rmdir(path)


def remove_stale(target: str) -> list:
    """Removes the marked TARGET.tmp-* / TARGET.old-* siblings of writers that are gone; returns their paths.

    Only directories carrying MARKER (written by `staged_dir`) are removed, and only when their writer has exited
    (a writer running beside this one keeps its own); a TARGET that a killed swap left inside a TARGET.old-* is
    first put back. An unmarked sibling is removed only when it is empty and named exactly like ours with the
    pid of a process that is gone (a writer killed between creating it and marking it).
    """
    target = os.path.abspath(target)
    parent, base = os.path.dirname(target), os.path.basename(target)
    removed = []
    if not os.path.isdir(parent):
        return removed
    start = stem(parent, base)
    ours = re.compile(re.escape(start) + r"\.(tmp|old)-(\d+)-[a-z0-9_]{8}")  # tempfile.mkdtemp's names
    for name in sorted(os.listdir(parent)):
        kind = next((k for k in (".tmp-", ".old-") if name.startswith(start + k)), None)
        path = os.path.join(parent, name)
        if kind is None or os.path.islink(path) or not os.path.isdir(path):
            continue
        pid_in_name = name[len(start + kind):].partition("-")[0]
        if not os.path.exists(os.path.join(path, MARKER)):
            named = ours.fullmatch(name)
            if named and _writer_gone(path, named.group(2)) and not os.listdir(path):
                with contextlib.suppress(OSError):
                    os.rmdir(path)
                    removed.append(path)
            continue
        try:
            with open(os.path.join(path, MARKER)) as f:
                if json.load(f).get("target", base) != base:
                    continue  # the staging directory of another target whose name starts like ours
        except (OSError, ValueError, AttributeError):
            pass
        if not _writer_gone(path, pid_in_name):
            continue
        previous = os.path.join(path, base)
        if kind == ".old-" and os.path.lexists(previous) and not os.path.lexists(target):
            os.rename(previous, target)
            print(f"restored {target} from {path}, where a replacement killed halfway had moved it",
                  file=sys.stderr)
        _discard(path)
        removed.append(path)
    return removed


def _staging_dir(parent: str, base: str, kind: str) -> str:
    path = tempfile.mkdtemp(prefix=f"{stem(parent, base)}.{kind}-{os.getpid()}-", dir=parent)
    _ACTIVE.add(path)
    _mark(path, base)
    return path


# ---- the claim: one writer of a target at a time, from its check to its rename -----------------------------------
def _lock_path(parent: str, base: str) -> str:
    return os.path.join(parent, f".{stem(parent, base)}{LOCK_SUFFIX}")


def _note(fd: int) -> dict | None:
    """The lock file's note ({} when empty), or None when the file holds something else (not ours)."""
    data = os.pread(fd, 4096, 0)
    if not data.strip():
        return {}
    try:
        note = json.loads(data)
    except ValueError:
        return None
    return note if isinstance(note, dict) and note.get("written_by") == "txl_tf.base.staging" else None


class _Busy(Exception):
    def __init__(self, note: dict):
        super().__init__(note)
        self.note = note


def _try_lock(path: str, base: str) -> int | None:
    """An open descriptor of the lock file `path`, exclusively locked and still at `path`; None when the file
    is not one this program wrote. Raises _Busy when another process holds it, OSError when it cannot be made.

    A writer removes its lock file before it lets go, so a lock taken on a file no longer at `path` is dropped
    and taken again on the new one."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
        try:
            opened = os.fstat(fd)
            if not stat.S_ISREG(opened.st_mode):
                os.close(fd)
                return None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                if not _note(fd):
                    time.sleep(0.05)  # its holder is writing its note
                raise _Busy(_note(fd) or {}) from None
            try:
                now = os.lstat(path)
            except FileNotFoundError:
                now = None
            if now is None or (now.st_dev, now.st_ino) != (opened.st_dev, opened.st_ino):
                os.close(fd)  # its holder removed it while we waited on it: take the new one
                continue
            if _note(fd) is None:
                os.close(fd)
                return None
            note = {"pid": os.getpid(), "host": socket.gethostname(), "target": base, "written_by": "txl_tf.base.staging",
                    "since": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(note) + "\n").encode(), 0)
            return fd
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise


def _unlock(fd: int, path: str) -> None:
    """Removes the lock file (while still holding it, so that no one else holds the one removed), then lets go."""
    with contextlib.suppress(OSError):
        opened, now = os.fstat(fd), os.lstat(path)
        if (now.st_dev, now.st_ino) == (opened.st_dev, opened.st_ino):
            os.remove(path)
    os.close(fd)


def _cannot_write(error: OSError, name: str, text: str):
    """A one-line PathError for a write the system refused in the folder of `text` (else `error` itself)."""
    from txl_tf.base import errors, paths

    if error.errno in _NOT_WRITABLE:
        folder = errors.existing_folder(os.path.dirname(os.path.abspath(os.fsdecode(error.filename or text))))
        return paths.PathError(f"{name}={text} cannot be written: {folder} is not writable ({os.strerror(error.errno)});"
                               f" make {folder} writable, or give a folder in a writable place")
    return error


@contextlib.contextmanager
def _claim(parent: str, base: str, name: str, text: str) -> Iterator[None]:
    """Holds the lock on `text` (in `parent`) for the body; one line when another writer holds it."""
    from txl_tf.base import paths

    lock, fd, refused = _lock_path(parent, base), None, None
    try:
        fd = _try_lock(lock, base)
    except _Busy as busy:
        who = (f"pid {busy.note['pid']} on host {busy.note.get('host')} since {busy.note.get('since')}"
               if "pid" in busy.note else "another process")
        raise paths.OutputExistsError(
            f"{name}={text} is being written by another writer ({who}; lock {lock}), so this one wrote nothing "
            "there: wait for that one to finish (then its output is there), or choose another folder") from None
    except OSError as error:
        if error.errno in _NOT_WRITABLE:
            raise _cannot_write(error, name, text) from None
        if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):  # a folder, a link
            raise paths.PathError(f"{name}={text}: its lock file {lock} cannot be made ({error.strerror}); move "
                                  f"{lock} away, or choose another folder") from None
        refused = error.strerror  # a file system without flock
    if refused:
        print(f"warning: cannot lock {lock} ({refused}); writing {text} without a lock, so make sure no other "
              "writer uses it", file=sys.stderr, flush=True)
        yield
        return
    if fd is None:
        raise paths.PathError(f"{name}={text}: {lock}, where txl_tf keeps the lock of this output, is not a lock "
                              "file txl_tf wrote; move it away, or choose another folder")
    try:
        yield
    finally:
        _unlock(fd, lock)


@contextlib.contextmanager
def staged_dir(target: str, kind: str | None = None, *, name: str = "the output folder", overwrite: bool = False,
               overwrite_hint: str = "--overwrite") -> Iterator[str]:
    """Yields a new empty directory (usual permissions) inside a marked temporary sibling of `target`; on normal
    exit that directory replaces `target`, in one replace-or-refuse step (the module's docstring).

    With `kind`, `target` is checked with `paths.replaceable_dir(target, name, kind=kind, overwrite=overwrite)`
    under the claim, before anything is staged and again just before the rename, and the directory gets the
    manifest of its files (`paths.write_manifest`): what a later writer of that kind may replace. Without `kind`,
    whatever is there is replaced (but never the working directory, home, a folder above them or a link:
    `paths.output_dir` is checked here too). A refusal is one line (a `paths.PathError`); nothing staged stays."""
    from txl_tf.base import errors, paths

    text = paths.output_dir(target, name)
    target = os.path.abspath(text)
    parent, base = os.path.dirname(target), os.path.basename(target)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as error:
        raise _cannot_write(error, name, text) from None
    with _claim(parent, base, name, text):
        remove_stale(target)
        if kind is not None:
            paths.replaceable_dir(text, name, kind=kind, overwrite=overwrite, overwrite_hint=overwrite_hint)
        existed = os.path.lexists(target)  # what the check saw: only that is ever replaced
        try:
            tmp, old = _staging_dir(parent, base, "tmp"), None
        except OSError as error:
            raise _cannot_write(error, name, text) from None
        try:
            content = os.path.join(tmp, base)
            os.mkdir(content)  # usual permissions (mkdtemp's are private); only this folder is moved
            yield content
            if kind is not None:
                paths.write_manifest(content, kind)
                try:  # the claim keeps other txl_tf writers out; this also sees anyone else's meanwhile
                    paths.replaceable_dir(text, name, kind=kind, overwrite=overwrite, overwrite_hint=overwrite_hint)
                except paths.OutputExistsError as error:
                    raise paths.OutputExistsError(f"{errors.one_line(error)} (written meanwhile by another writer; "
                                                  "what this one staged was discarded)") from None
            if existed and os.path.lexists(target):
                old = _staging_dir(parent, base, "old")
                os.rename(target, os.path.join(old, base))
            try:
                os.rename(content, target)  # fails when a folder with files appeared at `target`: never replaced
            except OSError as error:
                if old is not None or error.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                raise paths.OutputExistsError(f"{name}={text} was written meanwhile by another writer, so what this "
                                              "one staged was discarded; choose another folder") from None
        except BaseException:
            if old and not os.path.lexists(target) and os.path.lexists(os.path.join(old, base)):
                os.rename(os.path.join(old, base), target)  # the swap failed: the previous target stays
            raise
        finally:
            for path in (old, tmp):
                if path:
                    _discard(path)
                    _ACTIVE.discard(path)
