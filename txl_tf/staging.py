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
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterator

MARKER = ".txl_tf-staging"  # {"pid": ..., "host": ..., "target": NAME}, written when the directory is created
_ACTIVE: set = set()  # staging directories this process is writing (never stale, even for a reused pid)


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
        json.dump({"pid": os.getpid(), "host": socket.gethostname(), "target": base, "written_by": "txl_tf.staging"},
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
    ours = re.compile(re.escape(base) + r"\.(tmp|old)-(\d+)-[a-z0-9_]{8}")  # tempfile.mkdtemp's names
    removed = []
    if not os.path.isdir(parent):
        return removed
    for name in sorted(os.listdir(parent)):
        kind = next((k for k in (".tmp-", ".old-") if name.startswith(base + k)), None)
        path = os.path.join(parent, name)
        if kind is None or os.path.islink(path) or not os.path.isdir(path):
            continue
        pid_in_name = name[len(base + kind):].partition("-")[0]
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
    path = tempfile.mkdtemp(prefix=f"{base}.{kind}-{os.getpid()}-", dir=parent)
    _ACTIVE.add(path)
    _mark(path, base)
    return path


@contextlib.contextmanager
def staged_dir(target: str, kind: str | None = None) -> Iterator[str]:
    """Yields a new empty directory (usual permissions) inside a marked temporary sibling of `target`; on normal
    exit that directory replaces `target`. With `kind`, the directory gets the manifest of its files
    (`paths.write_manifest`) just before the swap: what `paths.replaceable_dir` lets a later writer replace.
    Check `target` with `paths.replaceable_dir` first: this replaces whatever is there (but never the working
    directory, home, a folder above them or a link: `paths.output_dir` is checked here too)."""
    from txl_tf import paths

    target = os.path.abspath(paths.output_dir(target, "the output folder"))
    parent, base = os.path.dirname(target), os.path.basename(target)
    os.makedirs(parent, exist_ok=True)
    remove_stale(target)
    tmp, old = _staging_dir(parent, base, "tmp"), None
    try:
        content = os.path.join(tmp, base)
        os.mkdir(content)  # usual permissions (mkdtemp's are private); only this folder is moved
        yield content
        if kind is not None:
            paths.write_manifest(content, kind)
        if os.path.lexists(target):
            old = _staging_dir(parent, base, "old")
            os.rename(target, os.path.join(old, base))
        os.rename(content, target)
    except BaseException:
        if old and not os.path.lexists(target) and os.path.lexists(os.path.join(old, base)):
            os.rename(os.path.join(old, base), target)  # the swap failed: the previous target stays
        raise
    finally:
        for path in (old, tmp):
            if path:
                _discard(path)
                _ACTIVE.discard(path)
