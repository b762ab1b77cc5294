"""Reading files someone else may have made: regular files only, a size limit per kind, strict JSON.

Everything txl_tf reads from disk (a preset's config.json and vocab.json, the autotune cache's choices.json, a
run's config.gin and the gin files it includes) is untrusted input. A link to /dev/zero, a FIFO, a 3 GB file or
JSON nested 200,000 levels deep must end in one line naming the file, not in a hung or exhausted machine:

    data = untrusted.read_bytes(path, max_bytes=untrusted.JSON_LIMIT, what="the preset's config.json")
    config = untrusted.load_json(path, max_bytes=untrusted.JSON_LIMIT, what="the preset's config.json")

`load_json` refuses NaN, Infinity and numbers that overflow to them (every number it returns is finite) and
nesting deeper than `MAX_DEPTH`. Its errors are `UntrustedFileError` (a `UserError`: one line, exit status 2).
A file that a library opens itself (Keras' weights, a TensorFlow checkpoint) is checked first with
`check_regular(path, max_bytes=...)`: a regular file within the limit, without reading it.

Sizes that come from such input (a model's sizes in a config, a corpus given to prepare) are bounded by the memory
of the machine: `machine_memory()` (the physical memory, or the container's limit where that is lower) and
`corpus_limit()` (the largest corpus file read whole).
"""

from __future__ import annotations

import functools
import json
import math
import os
import pathlib
import stat

from txl_tf.base.errors import UserError

MIB = 1 << 20
JSON_LIMIT = 4 * MIB  # config.json, choices.json, metadata.json, a study's records
VOCAB_LIMIT = 256 * MIB  # vocab.json: a word vocabulary of a few million entries
GIN_LIMIT = 4 * MIB  # a gin file (a run's config.gin is a few KiB)
MAX_DEPTH = 64  # JSON nesting: txl_tf's own files nest at most 4 levels


class UntrustedFileError(UserError):
    """A file read from disk is not a regular file, is too large, or does not parse as what it must be."""


def _size(n: int) -> str:
    return f"{n / MIB:.1f} MiB" if n >= MIB else f"{n:,} bytes"


def size_text(n: int) -> str:
    """A byte count for a message: bytes, MiB, GiB or TiB."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", MIB)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,} bytes"


def _cgroup_limit() -> int | None:
    """The memory limit of this process's cgroup (v2, else v1), or None without one."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read(64).strip()
        except OSError:
            continue
        if text.isdigit():
            return int(text)
    return None


@functools.lru_cache(maxsize=1)
def machine_memory() -> int:
    """Bytes of memory this process can use: the physical memory, or its container's limit where that is lower."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # a platform without these names
        physical = 1 << 40
    limit = _cgroup_limit()
    return min(physical, limit) if limit else physical


def _kib_field(path: str, name: str) -> int | None:
    """The bytes of the `name:  N kB` line of a /proc file (/proc/meminfo, /proc/self/status), or None."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_free() -> int | None:
    """The bytes this process's cgroup (v2, else v1) may still take (its limit less its usage), or None."""
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                          "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit) as f, open(usage) as g:
                cap, used = f.read(64).strip(), g.read(64).strip()
        except OSError:
            continue
        if cap.isdigit() and used.isdigit():
            return max(int(cap) - int(used), 0)
    return None


def available_memory() -> int:
    """Bytes this process can still allocate now: the least of the machine's available memory (MemAvailable of
    /proc/meminfo, else SC_AVPHYS_PAGES), what its container's limit leaves, and what the address-space limit
    (RLIMIT_AS, `ulimit -v`) leaves beside what the process maps already. Read afresh at each call."""
    import resource

    sizes = [_kib_field("/proc/meminfo", "MemAvailable")]
    if sizes[0] is None:
        try:
            sizes[0] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            sizes[0] = machine_memory()
    sizes.append(_cgroup_free())
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        sizes.append(max(soft - (_kib_field("/proc/self/status", "VmSize") or 0), 0))
    return min(size for size in sizes if size is not None)


CORPUS_FACTOR = 6  # a corpus read whole is held with its int32 ids (4 bytes a byte at char level) and a copy


def corpus_limit() -> int:
    """The largest corpus file `python -m txl_tf.data.prepare` reads whole: a sixth of `machine_memory()` (the
    bytes, their int32 ids and a copy must fit)."""
    return machine_memory() // CORPUS_FACTOR


def _open_checked(path: str, max_bytes: int, what: str) -> int:
    """A descriptor of the regular file `path` of at most `max_bytes` bytes (UntrustedFileError otherwise; a missing
    file is FileNotFoundError). Opened without blocking (a FIFO must not hang) and checked through the descriptor."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)  # a FIFO must not block
    fd = os.open(path, flags)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file (a device, FIFO or socket)"
            raise UntrustedFileError(f"{what} {path} is {kind}; give a regular file")
        if info.st_size > max_bytes:
            raise UntrustedFileError(f"{what} {path} holds {_size(info.st_size)}, more than the {_size(max_bytes)} "
                                     "such a file may hold; give the right file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_regular(path, *, max_bytes: int, what: str = "the file") -> int:
    """The size of the regular file `path` (a link to one is followed) of at most `max_bytes` bytes, for a file that
    a library then opens itself (Keras' weights, a TensorFlow checkpoint): a device, FIFO, socket or directory, or
    a file over the limit, is an UntrustedFileError naming it (a FIFO never blocks the check); a missing file is
    FileNotFoundError."""
    path = os.fspath(path)
    fd = _open_checked(path, max_bytes, what)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def read_bytes(path, *, max_bytes: int, what: str = "the file") -> bytes:
    """The content of the regular file `path` (a link to one is followed), at most `max_bytes` bytes.

    A device, FIFO, socket or directory, or a file over the limit, is an UntrustedFileError naming the file; a
    missing file is FileNotFoundError (callers that expect one catch it). The file is opened first and then
    checked through its descriptor, so what is read is what was checked.
    """
    path = os.fspath(path)
    fd = _open_checked(path, max_bytes, what)
    try:
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(MIB, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:  # it grew while being read
                raise UntrustedFileError(f"{what} {path} holds more than the {_size(max_bytes)} such a file may "
                                         "hold; give the right file")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_text(path, *, max_bytes: int, what: str = "the file") -> str:
    """`read_bytes` decoded as UTF-8 (an undecodable file is one UntrustedFileError)."""
    data = read_bytes(path, max_bytes=max_bytes, what=what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UntrustedFileError(f"{what} {os.fspath(path)} is not UTF-8 text (byte {error.start}); give the "
                                 "right file") from None


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text} is not finite")
    return value


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a finite number")


def _depth(value, limit: int) -> int:
    """The nesting depth of a parsed JSON value (iterative, stops past `limit`)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def parse_json(text: str, *, what: str = "the JSON text", max_depth: int = MAX_DEPTH, finite: bool = True):
    """Strict JSON: finite numbers only (unless `finite=False`: a record whose NaN means "undefined"), nesting at
    most `max_depth`; UntrustedFileError otherwise."""
    strict = dict(parse_float=_finite_float, parse_constant=_refuse_constant) if finite else {}
    try:
        value = json.loads(text, **strict)
    except RecursionError:
        raise UntrustedFileError(f"{what} nests deeper than {max_depth} levels; give the right file") from None
    except ValueError as error:
        raise UntrustedFileError(f"{what} is not valid JSON ({str(error).splitlines()[0]}); give the right "
                                 "file") from None
    if _depth(value, max_depth) > max_depth:
        raise UntrustedFileError(f"{what} nests deeper than {max_depth} levels; give the right file")
    return value


def load_json(path, *, max_bytes: int = JSON_LIMIT, what: str = "the file", max_depth: int = MAX_DEPTH,
              finite: bool = True):
    """The JSON value in the regular file `path` (see `read_bytes` and `parse_json`)."""
    text = read_text(path, max_bytes=max_bytes, what=what)
    return parse_json(text, what=f"{what} {os.fspath(path)}", max_depth=max_depth, finite=finite)


# ---- who may have written a cached file: the training path's cache (txl_tf.training.autotune), the fused kernels' ----
def owner_problem(info: os.stat_result, uid: int | None = None) -> str | None:
    """Why a cached file or one of its folders, of this `os.stat` result, may hold what this user did not write, or
    None: it belongs to another user than `uid` (default: this process's) or the group or others may write it."""
    uid = os.getuid() if uid is None else uid
    if info.st_uid != uid:
        return f"owned by uid {info.st_uid}, not {uid}"
    writers = [who for who, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if info.st_mode & bit]
    if writers:
        return f"writable by {' and '.join(writers)} (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def untrusted_path(path) -> str | None:
    """Why another user could have put or could swap what is at the existing `path` (a cached file or folder), or
    None. `path` itself must be this user's and nobody else's to write (`owner_problem`); every folder above it, up
    to the root, must belong to this user or to root and be writable by nobody else, except a sticky folder
    (like /tmp) above one that passed: others may not rename or delete what is not theirs in it. Links in `path`
    are resolved first (the caller then uses `os.path.realpath(path)`, whose folders are these)."""
    if not hasattr(os, "getuid"):  # no POSIX owners to check (Windows)
        return None
    uid = os.getuid()
    current = os.path.realpath(path)
    info = os.lstat(current)
    reason = "a symbolic link" if stat.S_ISLNK(info.st_mode) else owner_problem(info, uid)
    if reason:
        return f"{current} is {reason}"
    while True:
        parent = os.path.dirname(current)
        if parent == current:
            return None
        current, info = parent, os.lstat(parent)
        if stat.S_ISLNK(info.st_mode):  # swapped for a link since realpath
            return f"{current} is a symbolic link"
        if info.st_uid not in (uid, 0):
            return f"{current} is owned by uid {info.st_uid}, not {uid} or root"
        shared = stat.S_IMODE(info.st_mode) & (stat.S_IWGRP | stat.S_IWOTH)
        if shared and not info.st_mode & stat.S_ISVTX:  # sticky: what is below passed, and only its owner moves it
            writers = " and ".join(w for w, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if shared & bit)
            return f"{current} is writable by {writers} (mode {stat.S_IMODE(info.st_mode):o})"


def make_private_dirs(path) -> None:
    """Creates the folder `path` and each missing folder above it readable and writable by this user only (a
    plain `mkdir -p` gives the parents the umask's mode, which may let the group write them)."""
    path = pathlib.Path(path)
    missing = []
    while not path.is_dir():
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for folder in reversed(missing):
        folder.mkdir(mode=0o700, exist_ok=True)
