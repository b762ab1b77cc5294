"""The one check of every path a user gives, and what a writer may replace.

Every command-line flag and every Python argument that names a path goes through one of these before anything
is read or written:

    paths.given(path, "--model_dir")              # a path to read: a non-empty str or os.PathLike
    paths.output_dir(path, "--model_dir")         # a folder to write into: also not a link, not /, not the
                                                  #   working directory, home, or a folder above either
    paths.output_file(path, "--token_losses")     # a file to write: not a folder, not a link, a writable parent
    paths.replaceable_dir(path, "--export_dir", kind="export", overwrite=...)   # a folder to replace whole

`os.path.exists("")` is False and `os.path.abspath("")` is the working directory, so without the first check an
empty flag means "the current directory"; these refuse it in one line (a `PathError`, a `UserError`).

A folder replaced whole (a prepared dataset, an export, a preset, an average, a converted checkpoint) holds a
manifest, `MANIFEST`, written last by `staging.staged_dir(..., kind=...)`: the kind of output and the files the
writer put there. `replaceable_dir` replaces only a folder whose manifest names the same kind and which holds
nothing else; a folder with any other file (a user's NOTES.txt, the source a preparation reads) is refused in one
line naming those files. Folders written before manifests existed are recognised by the names their writer uses
(`LEGACY`), under the same rule: nothing but those names.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import stat
import tempfile
from collections.abc import Iterator

from txl_tf.base.errors import UserError

MANIFEST = ".txl_tf-manifest.json"  # {"written_by": "txl_tf", "kind": KIND, "files": [relative paths]}
MANIFEST_LIMIT = 16 << 20

# The files each kind of output had before manifests existed: (the file that shows the kind, fnmatch patterns of
# every relative path such a writer put there).
LEGACY = {
    "prepared dataset": ("metadata.json", ("metadata.json", "vocab.json", "*.tfrecord")),
    "export": ("saved_model.pb", ("saved_model.pb", "fingerprint.pb", "variables/*", "assets/*")),
    "preset": ("config.json", ("config.json", "model.weights.h5", "vocab.json")),
    "average": ("averaged.json", ("averaged.json", "checkpoint", "ckpt-*", "config.gin")),
    "converted checkpoint": ("model.gin", ("checkpoint", "ckpt-*", "model_config.json", "model.gin")),
}

class PathError(UserError):
    """A path given by the user that txl_tf will not use as asked."""


class OutputExistsError(PathError, FileExistsError):
    """The folder to write holds something this program may not replace (or may only with overwrite)."""


def given(path, name: str) -> str:
    """`path` as a str; an empty one (which would mean the working directory) or a non-path is one line."""
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
        raise PathError(f"{name} must be a path (a str); got {type(path).__name__} {path!r}")
    text = os.fspath(path)
    if not isinstance(text, str) or not text.strip():
        raise PathError(f"{name} is empty; give a path (an empty path would mean the working directory)")
    if "\0" in text:
        raise PathError(f"{name}={text!r} holds a NUL character; give a path")
    return text


def _protected() -> dict:
    """{absolute path: why} of the folders no command writes into or replaces."""
    protected = {}
    for start, why in ((os.getcwd(), "the working directory"), (os.path.expanduser("~"), "the home directory")):
        folder = os.path.abspath(start)
        protected.setdefault(folder, why)
        while True:
            parent = os.path.dirname(folder)
            if parent == folder:
                break
            folder = parent
            protected.setdefault(folder, f"a folder above {why}")
    protected[os.path.abspath(os.sep)] = "the root folder"
    return protected


def output_dir(path, name: str) -> str:
    """A folder to write into (created if missing): returned as given; refused in one line when empty, a link,
    a file, `/`, the working directory, the home directory or a folder above either, under a file, or with a name
    longer than its file system allows."""
    text = given(path, name)
    absolute = os.path.abspath(text)
    why = _protected().get(absolute) or _protected().get(os.path.realpath(text))
    if why:
        raise PathError(f"{name}={text} is {why} ({absolute}); give a folder of its own, e.g. "
                        f"{os.path.join(text, 'out')}")
    if os.path.islink(text):
        raise PathError(f"{name}={text} is a symbolic link (to {os.readlink(text)}); outputs never follow links: "
                        "give the folder itself")
    if os.path.lexists(text) and not os.path.isdir(text):
        raise PathError(f"{name}={text} is a file, not a folder; give a folder")
    _check_folders_above(text, name)
    return text


def _check_folders_above(text: str, name: str) -> None:
    """One line when a name in `text` is longer than its file system allows, or the nearest existing folder above
    it is a file (nothing could be made there)."""
    above = os.path.dirname(os.path.abspath(text))
    while not os.path.lexists(above):
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        raise PathError(f"{name}={text}: {above} is a file, not a folder; give a path in a folder")
    try:
        limit = os.pathconf(above, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    for part in os.path.abspath(text).split(os.sep):
        if len(os.fsencode(part)) > limit:
            raise PathError(f"{name}={text}: the name {part[:20]}... is {len(os.fsencode(part))} bytes long, more "
                            f"than the {limit} its file system allows; give a shorter name")


def output_file(path, name: str, example: str = "out") -> str:
    """A file to write (written beside and renamed into place): refused in one line when empty, a folder, a
    link, or in a folder that is a file or not writable."""
    text = given(path, name)
    if os.path.isdir(text):
        raise PathError(f"{name}={text} is a directory; give a file path, e.g. {os.path.join(text, example)}")
    if os.path.islink(text):
        raise PathError(f"{name}={text} is a symbolic link (to {os.readlink(text)}); outputs never follow links: "
                        "give another file name")
    parent = os.path.dirname(os.path.abspath(text))
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise PathError(f"{name}={text}: {parent} is a file, not a folder; give a path in a folder")
    if not os.access(parent, os.W_OK):
        raise PathError(f"{name}={text}: {parent} is not writable; give a path in a writable folder")
    return text


def inside(path: str, folder: str) -> bool:
    """True when `path` is `folder` or lies under it (links resolved)."""
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _files(directory: str) -> list:
    """Every entry under `directory` that is not a folder, as a sorted list of relative paths (links listed,
    never followed)."""
    found = []
    for root, dirs, files in os.walk(directory):
        for d in list(dirs):
            if os.path.islink(os.path.join(root, d)):
                dirs.remove(d)
                files.append(d)
        for f in files:
            found.append(os.path.relpath(os.path.join(root, f), directory))
    return sorted(found)


def write_manifest(directory: str, kind: str) -> None:
    """Records `kind` and every file under `directory` (written by this program) in its MANIFEST."""
    files = [f for f in _files(directory) if f != MANIFEST]
    with open(os.path.join(directory, MANIFEST), "w", encoding="utf-8") as f:
        json.dump({"written_by": "txl_tf", "kind": kind, "files": files}, f, indent=0)
        f.write("\n")


def read_manifest(directory: str) -> dict | None:
    """The manifest of `directory` ({"kind", "files"}), or None when it has none or an unreadable one."""
    from txl_tf.base import untrusted

    try:
        manifest = untrusted.load_json(os.path.join(directory, MANIFEST), max_bytes=MANIFEST_LIMIT,
                                       what="the output manifest")
    except (OSError, UserError):
        return None
    if not (isinstance(manifest, dict) and isinstance(manifest.get("kind"), str)
            and isinstance(manifest.get("files"), list) and all(isinstance(f, str) for f in manifest["files"])):
        return None
    return manifest


def foreign_files(directory: str, kind: str) -> list | None:
    """The files under `directory` that a `kind` writer did not put there, or None when nothing shows that a
    `kind` writer wrote the folder at all (no manifest of that kind, no legacy file of it)."""
    present = [f for f in _files(directory) if f != MANIFEST]
    manifest = read_manifest(directory)
    if manifest is not None:
        if manifest["kind"] != kind:
            return None
        own = set(manifest["files"])
        return [f for f in present if f not in own]
    signature, patterns = LEGACY.get(kind, (None, ()))
    if signature not in present:
        return None
    return [f for f in present if not any(fnmatch.fnmatchcase(f, p) for p in patterns)]


def _listing(files: list, limit: int = 5) -> str:
    shown = ", ".join(files[:limit])
    return shown + (f" and {len(files) - limit} more" if len(files) > limit else "")


def replaceable_dir(path, name: str, *, kind: str, overwrite: bool, overwrite_hint: str = "--overwrite") -> str:
    """A folder this program writes whole (see the module's docstring): returned as given when it does not exist,
    is empty, or holds only a `kind` this program wrote and `overwrite` is set; one line otherwise."""
    text = output_dir(path, name)
    if not os.path.lexists(text) or not os.listdir(text):
        return text
    foreign = foreign_files(text, kind)
    if foreign is None:
        raise OutputExistsError(f"{name}={text} exists and holds no {kind} written by txl_tf; it is never replaced, "
                        f"with or without {overwrite_hint}: choose another folder, or move it away yourself")
    if foreign:
        raise OutputExistsError(f"{name}={text} holds files txl_tf did not write there ({_listing(foreign)}); it is never "
                        f"replaced, with or without {overwrite_hint}: move them out or choose another folder")
    if not overwrite:
        raise OutputExistsError(f"{name}={text} already holds a {kind}; pass {overwrite_hint} to replace it, or choose "
                        "another folder")
    return text


@contextlib.contextmanager
def atomic_file(path, mode: str = "w", **open_args) -> Iterator:
    """Opens a new file beside `path` for writing; on normal exit it is flushed to disk and renamed onto `path`
    (which is never opened: a link there is replaced, not followed; a full disk or a kill leaves the old file
    whole). On an error the new file is removed."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, mode, **open_args) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if os.path.lexists(path):
            with contextlib.suppress(OSError):
                os.chmod(tmp, stat.S_IMODE(os.lstat(path).st_mode) if not os.path.islink(path) else 0o644)
        else:
            os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
