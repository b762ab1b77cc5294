"""Corpus sources that are not what they claim (issue 52, items 9 and 15): an archive or binary data given as the
plain text of `--dataset=text` is one line naming the file and the fix; a zip or bzip2 bomb where a corpus of known
size belongs is refused before it is inflated (bounded by the expected size, whatever the archive declares)."""

import bz2
import gzip
import io
import lzma
import os
import subprocess
import sys
import tarfile
import tracemalloc
import zipfile

import pytest

from txl_tf.data import corpora, sources
from txl_tf.data import prepare as prep
from txl_tf.data.sources import SourceError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = b"".join(b"line %d of a plain text that repeats itself, now and then\n" % i for i in range(200))


def local(tmp_path, **kw):
    return corpora.PrepareSettings(cache_dir=str(tmp_path / "cache"), verify=False, **kw)


def tarred(text: bytes, mode: str = "w") -> bytes:
    """`text` as the member corpus.txt of a tar archive (`mode` "w:gz": gzipped)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode=mode) as tf:
        info = tarfile.TarInfo("corpus.txt")
        info.size = len(text)
        tf.addfile(info, io.BytesIO(text))
    return buffer.getvalue()


def tar_gz(text: bytes) -> bytes:
    return tarred(text, "w:gz")


def plain_tar(text: bytes) -> bytes:
    return tarred(text)


def zipped(text: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("corpus.txt", text)
    return buffer.getvalue()


ZSTD_FRAME = bytes.fromhex("28b52ffd") + bytes(range(60))  # a zstd frame's magic number (no zstd module needed)
ARCHIVES = {
    "gzip": lambda: gzip.compress(TEXT),
    "tar.gz": lambda: tar_gz(TEXT),
    "bzip2": lambda: bz2.compress(TEXT),
    "xz": lambda: lzma.compress(TEXT),
    "zip": lambda: zipped(TEXT),
    "tar": lambda: plain_tar(TEXT),
    "zstd": lambda: ZSTD_FRAME,
}
KIND = {"gzip": "gzip", "tar.gz": "gzip", "bzip2": "bzip2", "xz": "xz", "zip": "zip", "tar": "tar", "zstd": "zstd"}


@pytest.mark.parametrize("archive", sorted(ARCHIVES))
@pytest.mark.parametrize("level", ["char", "word"])
def test_an_archive_as_plain_text_is_refused_naming_it(tmp_path, archive, level):
    source = tmp_path / f"corpus.{archive}"
    source.write_bytes(ARCHIVES[archive]())
    with pytest.raises(SourceError) as raised:
        prep.prepare("text", str(tmp_path / "d"), local(tmp_path, source=str(source), level=level))
    assert str(raised.value).startswith(f"{source} is a {KIND[archive]} file, not plain text, and --dataset=text "
                                        "reads text as it is; decompress or unpack it first")
    assert not (tmp_path / "d").exists()


def test_binary_data_and_an_archive_in_a_folder_are_refused(tmp_path):
    garbage = tmp_path / "garbage.txt"
    garbage.write_bytes(TEXT[:500] + bytes(range(256)) * 8)
    with pytest.raises(SourceError, match=rf"^{garbage} holds a NUL byte \(at byte 500\): binary data, not the plain "
                                          "text --dataset=text reads; give a text file"):
        prep.prepare("text", str(tmp_path / "d"), local(tmp_path, source=str(garbage)))
    folder = tmp_path / "splits"
    folder.mkdir()
    (folder / "train.txt").write_bytes(TEXT)
    (folder / "valid.txt").write_bytes(gzip.compress(TEXT))
    (folder / "test.txt").write_bytes(TEXT[:100])
    with pytest.raises(SourceError, match=f"^{folder / 'valid.txt'} is a gzip file, not plain text"):
        prep.prepare("text", str(tmp_path / "f"), local(tmp_path, source=str(folder)))


def test_text_that_merely_looks_like_a_magic_number_is_prepared(tmp_path):
    """"BZh" and "PK" starting a text file, non-UTF-8 bytes at char level: still text."""
    for i, head in enumerate((b"BZh91 is not a bzip2 stream\n", b"PK is a pair of letters\n",
                              b"caf\xe9 in Latin-1\n")):
        source = tmp_path / f"look-alike-{i}.txt"
        source.write_bytes(head + TEXT)
        meta = prep.prepare("text", str(tmp_path / f"d{i}"), local(tmp_path, source=str(source)))
        assert sum(meta["token_counts"].values()) == len(head + TEXT)
    assert sources.archive_format(b"BZh91AY&SY" + bytes(10)) == "bzip2"
    assert sources.archive_format(b"BZh9 plain") is None


def test_the_command_on_a_tar_gz_is_one_line(tmp_path):
    source = tmp_path / "corpus.tar.gz"
    source.write_bytes(tar_gz(TEXT * 5))
    env = {**os.environ, "PYTHONPATH": REPO, "TXL_TF_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "txl_tf.data.prepare", "--dataset=text", f"--source={source}",
                           f"--data_dir={tmp_path / 'd'}"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {source} is a gzip file, not plain text"), proc.stderr
    assert not (tmp_path / "d").exists()


# ---- bombs: a corpus of known size bounds what is inflated -----------------------------------------------------
def peak_bytes(function) -> tuple[int, BaseException | None]:
    """The peak of Python's allocations while `function` runs (bytes objects included), and what it raised."""
    tracemalloc.start()
    try:
        function()
        raised = None
    except BaseException as error:  # returned to the test
        raised = error
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak, raised


BOMB = 64 << 20  # 64 MiB of zeros: about 64 KB deflated


def test_a_zip_bomb_as_the_networkx_wheel_is_refused_before_it_is_inflated(tmp_path):
    wheel = tmp_path / "networkx-3.7-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("networkx/__init__.py", "import networkx\n")
        zf.writestr("networkx/bomb.py", bytes(BOMB))
    assert wheel.stat().st_size < 200_000
    peak, raised = peak_bytes(lambda: prep.prepare("networkx_code", str(tmp_path / "d"), corpora.PrepareSettings(
        source=str(wheel), cache_dir=str(tmp_path / "cache"))))
    assert isinstance(raised, SourceError), raised
    declared = len(b"# file: networkx/__init__.py\nimport networkx\n") + len(b"# file: networkx/bomb.py\n") + BOMB
    assert str(raised).startswith(f"the .py files of {wheel} hold {declared:,} bytes as its directory declares "
                                  f"them, more than the {corpora.NETWORKX_SIZE:,} bytes of networkx==3.7's sources; "
                                  "not the expected source (refused before any was inflated)"), raised
    assert peak < 8 << 20, f"{peak:,} bytes allocated: the member was inflated"
    assert not (tmp_path / "d").exists()


def test_a_zip_bomb_as_enwik8_is_refused_before_it_is_inflated(tmp_path):
    archive = tmp_path / "enwik8.zip"
    size = corpora.EXPECTED["enwik8"]["bytes"] + 1  # one byte more than the official 100,000,000
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf, zf.open("enwik8", "w") as member:
        block = bytes(1 << 24)
        for start in range(0, size, len(block)):
            member.write(block[:size - start])
    peak, raised = peak_bytes(lambda: prep.prepare("enwik8", str(tmp_path / "d"), corpora.PrepareSettings(
        source=str(archive), cache_dir=str(tmp_path / "cache"))))
    assert isinstance(raised, SourceError), raised
    assert str(raised).startswith(f"{archive}: enwik8 holds 100,000,001 bytes, more than the 100,000,000 bytes of the "
                                  "official enwik8; not the expected source (refused before it was inflated"), raised
    assert peak < 8 << 20, f"{peak:,} bytes allocated: the member was inflated"


def test_a_bzip2_bomb_as_the_wikipedia_sample_stops_at_its_expected_size(tmp_path):
    source = tmp_path / "enwiki-sample.xml.bz2"
    source.write_bytes(bz2.compress(b"<page>a bomb</page>\n" * ((24 << 20) // 20)))  # 24 MiB of XML: 3 KB
    peak, raised = peak_bytes(lambda: prep.prepare("enwik8_sample", str(tmp_path / "d"), corpora.PrepareSettings(
        source=str(source), cache_dir=str(tmp_path / "cache"))))
    assert isinstance(raised, SourceError), raised
    assert str(raised).startswith(f"{source} decompresses to more than the {corpora.ENWIKI_SIZE:,} bytes of the "
                                  "expected Wikipedia sample (decompression stopped there); not the expected "
                                  "source"), raised
    assert peak < 16 << 20, f"{peak:,} bytes allocated: the stream was decompressed whole"
