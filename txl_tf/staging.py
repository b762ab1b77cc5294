"""Directories written whole or not at all: built in a temporary sibling, then renamed into place.

    with staged_dir("exports/sample") as tmp:   # exports/sample.tmp-<pid>-xxxx
        write_everything_into(tmp)
    # exports/sample now holds exactly what was written (a previous one is replaced whole)

A process killed while writing leaves NAME.tmp-<pid>-* (or NAME.old-<pid>-* during the swap); the next
`staged_dir` of the same NAME removes those whose process is gone (`remove_stale`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale(target: str) -> list:
    """Removes TARGET.tmp-* / TARGET.old-* siblings left by killed writers; returns their paths.

    Names carry the writer's pid (NAME.tmp-<pid>-xxxx): those of another live process are kept (a writer running
    beside this one); names without a pid come from older versions and are removed.
    """
    target = os.path.abspath(target)
    parent, base = os.path.dirname(target), os.path.basename(target)
    removed = []
    if not os.path.isdir(parent):
        return removed
    for name in sorted(os.listdir(parent)):
        for kind in (".tmp-", ".old-"):
            if not name.startswith(base + kind):
                continue
            pid, sep, _ = name[len(base + kind):].partition("-")
            if sep and pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid)):
                continue
            path = os.path.join(parent, name)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


@contextlib.contextmanager
def staged_dir(target: str) -> Iterator[str]:
    """Yields a temporary sibling directory of `target` (usual permissions); on normal exit it replaces `target`."""
    target = os.path.abspath(target)
    parent, base = os.path.dirname(target), os.path.basename(target)
    os.makedirs(parent, exist_ok=True)
    remove_stale(target)
    tmp = tempfile.mkdtemp(prefix=f"{base}.tmp-{os.getpid()}-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the target gets the usual permissions
    try:
        yield tmp
        old = None
        if os.path.exists(target):
            old = tempfile.mkdtemp(prefix=f"{base}.old-{os.getpid()}-", dir=parent)
            os.rename(target, os.path.join(old, base))
        os.rename(tmp, target)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
