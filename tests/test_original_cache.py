"""The authors' cache.pkl as a prepared corpus: exactly their ids, and a pickle that tries to run code is refused.

The fixture (`original_cache_wt103_small`) was written by the authors' own data code under Python 3; the
released files were written by Python 2.7, which `_py2_cache` imitates opcode by opcode (Python 2 `str`
objects, `numpy.core.multiarray._reconstruct`, no `_codecs.encode`).
"""

import json
import os
import pickle
import struct
import subprocess
import sys

import numpy as np
import pytest
from conftest import SHARED

from txl_tf.base import errors
from txl_tf.data import corpora, original_cache, prepare, records
from txl_tf.data.vocab import Vocab

CACHE_DIR = SHARED / "fixtures" / "original_cache_wt103_small"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def cache_dir():
    if not (CACHE_DIR / "cache.pkl").exists():
        pytest.skip(f"fixture not found at {CACHE_DIR} (set TXL_SHARED_DIR to the shared/ folder)")
    return CACHE_DIR


def _prepare(cache_path, data_dir):
    settings = corpora.PrepareSettings(original_cache=str(cache_path))
    return prepare.prepare(original_cache.dataset_of(str(cache_path)), str(data_dir), settings)


def test_prepared_data_dir_reproduces_expected_json(cache_dir, tmp_path):
    expected = json.loads((cache_dir / "expected.json").read_text())
    meta = _prepare(cache_dir / "cache.pkl", tmp_path / "wt103")
    assert meta["dataset"] == expected["dataset"] == "wt103"
    vocab = Vocab.load(str(tmp_path / "wt103" / "vocab.json"))
    assert vocab.symbols == expected["idx2sym"]
    assert (vocab.level, vocab.eos, vocab.unk) == ("word", "<eos>", "<unk>")
    assert meta["options"]["original_cutoffs"] == expected["cutoffs"]
    assert sorted(meta["splits"]) == sorted(expected["splits"])
    for split, want in expected["splits"].items():
        ids = records.read_split_records(str(tmp_path / "wt103"), meta, split)
        assert original_cache.describe_ids(ids) == want, split
    again = _prepare(cache_dir / "cache.pkl", tmp_path / "wt103")  # the same request: reused as is
    assert again == meta


def test_command_prints_the_expected_digests(cache_dir, tmp_path):
    expected = json.loads((cache_dir / "expected.json").read_text())
    proc = subprocess.run(
        [sys.executable, "-m", "txl_tf.data.prepare", f"--from_original_cache={cache_dir / 'cache.pkl'}",
         f"--data_dir={tmp_path / 'data'}"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for split, want in expected["splits"].items():
        assert f"{split}: {want['num_tokens']:,} tokens, sha256(int64 LE ids) {want['sha256_int64']}" in proc.stdout
    assert Vocab.load(str(tmp_path / "data" / "vocab.json")).symbols == expected["idx2sym"]


# ---- Python 2.7 pickles, opcode by opcode ------------------------------------------------------------------
def _str2(data: bytes) -> bytes:
    """A Python 2 `str` (protocol 2)."""
    if len(data) < 256:
        return pickle.SHORT_BINSTRING + bytes([len(data)]) + data
    return pickle.BINSTRING + struct.pack("<i", len(data)) + data


def _global(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def _int(value: int) -> bytes:
    return pickle.BININT + struct.pack("<i", value)


def _array2(ids, dtype="i8") -> bytes:
    """numpy 1.x on Python 2: _reconstruct(ndarray, (0,), 'b') + (1, shape, dtype, False, raw str)."""
    values = np.asarray(ids, "<" + dtype)
    dtype_obj = (_global("numpy", "dtype") + _str2(dtype.encode()) + _int(0) + _int(1) + pickle.TUPLE3
                 + pickle.REDUCE + pickle.MARK + _int(3) + _str2(b"<") + pickle.NONE * 3 + _int(-1) + _int(-1)
                 + _int(0) + pickle.TUPLE + pickle.BUILD)
    return (_global("numpy.core.multiarray", "_reconstruct") + _global("numpy", "ndarray") + _int(0)
            + pickle.TUPLE1 + _str2(b"b") + pickle.TUPLE3 + pickle.REDUCE
            + pickle.MARK + _int(1) + _int(values.size) + pickle.TUPLE1 + dtype_obj + pickle.NEWFALSE
            + _str2(values.tobytes()) + pickle.TUPLE + pickle.BUILD)


def _object2(module: str, name: str, attributes: dict) -> bytes:
    """A new-style instance: NEWOBJ, then BUILD with its __dict__ (attribute values already pickled)."""
    body = b"".join(_str2(key.encode()) + value for key, value in attributes.items())
    return (_global(module, name) + pickle.EMPTY_TUPLE + pickle.NEWOBJ + pickle.EMPTY_DICT + pickle.MARK + body
            + pickle.SETITEMS + pickle.BUILD)


def _py2_cache(dataset: str, symbols: list, splits: dict, corpus_module: str = "__main__",
               extra: bytes = b"") -> bytes:
    idx2sym = pickle.EMPTY_LIST + pickle.MARK + b"".join(_str2(s.encode("utf-8")) for s in symbols) + pickle.APPENDS
    vocab = _object2("vocabulary", "Vocab", {"idx2sym": idx2sym, "special": pickle.EMPTY_LIST})
    attributes = {"dataset": _str2(dataset.encode()), "vocab": vocab,
                  **{split: _array2(ids) for split, ids in splits.items()},
                  "cutoffs": pickle.EMPTY_LIST}
    return pickle.PROTO + b"\x02" + _object2(corpus_module, "Corpus", attributes)[:-2] + extra + b"ub."


def test_python2_word_cache_decodes_utf8_symbols(tmp_path):
    symbols = ["<eos>", "the", "café", "<unk>", "Ω"]
    splits = {"train": [1, 2, 0, 4, 0], "valid": [3, 0], "test": [2, 1, 0]}
    path = tmp_path / "cache.pkl"
    path.write_bytes(_py2_cache("wt103", symbols, splits))
    dataset, vocab, ids, details = original_cache.read_original_cache(str(path))
    assert dataset == "wt103" and vocab.symbols == symbols and vocab.unk == "<unk>"
    for split, want in splits.items():
        np.testing.assert_array_equal(ids[split], want)
        assert ids[split].dtype == np.int64
    assert details["splits_without_ids"] == []


def test_python2_enwik8_cache_gives_byte_symbols(tmp_path):
    symbols = ["32", "101", "116", "9", "195"]  # their enwik8 text: byte values written in decimal
    path = tmp_path / "cache.pkl"
    path.write_bytes(_py2_cache("enwik8", symbols, {"train": [0, 1, 2, 3], "valid": [4, 0], "test": [1, 0]}))
    (tmp_path / "corpus-info.json").write_text('{"vocab_size": 5, "cutoffs": [], "dataset": "enwik8"}')
    meta = _prepare(path, tmp_path / "data")
    vocab = Vocab.load(str(tmp_path / "data" / "vocab.json"))
    assert (vocab.level, vocab.symbols, vocab.drop) == ("char", [32, 101, 116, 9, 195], (10,))
    assert meta["dataset"] == "enwik8"
    np.testing.assert_array_equal(records.read_split_records(str(tmp_path / "data"), meta, "train"), [0, 1, 2, 3])


def test_disagreeing_corpus_info_is_named(tmp_path):
    path = tmp_path / "cache.pkl"
    path.write_bytes(_py2_cache("wt103", ["<eos>", "a"], {"train": [1, 0], "valid": [1], "test": [0]}))
    (tmp_path / "corpus-info.json").write_text('{"vocab_size": 2, "cutoffs": [], "dataset": "wt2"}')
    with pytest.raises(ValueError, match="says dataset 'wt103', corpus-info.json beside it says 'wt2'"):
        original_cache.read_original_cache(str(path))


# ---- pickles that try to run code --------------------------------------------------------------------------
class _System:
    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


class _Eval:
    def __init__(self, source):
        self.source = source

    def __reduce__(self):
        return eval, (self.source,)


def _malicious(kind: str, marker) -> bytes:
    command = f"touch {marker}"
    if kind == "os.system":
        return pickle.dumps(_System(command), protocol=2)
    if kind == "builtins.eval (protocol 4)":
        return pickle.dumps(_Eval(f"open({str(marker)!r}, 'w')"), protocol=4)
    if kind == "inside a corpus":  # a valid-looking Corpus whose last attribute calls os.system
        call = _global("posix", "system") + _str2(command.encode()) + pickle.TUPLE1 + pickle.REDUCE
        return _py2_cache("wt103", ["<eos>", "a"], {"train": [1, 0]}, extra=_str2(b"hook") + call)
    if kind == "object array":  # dtype 'O' would unpickle arbitrary objects as elements
        return _py2_cache("wt103", ["<eos>"], {})[:-3] + _str2(b"train") + _array2([0]).replace(
            _str2(b"i8"), _str2(b"O8")) + b"ub."
    raise ValueError(kind)


@pytest.mark.parametrize("kind, refused", [
    ("os.system", "refused global posix.system"),
    ("builtins.eval (protocol 4)", "refused global builtins.eval"),
    ("inside a corpus", "refused global posix.system"),
    ("object array", "array dtype 'O8' refused"),
])
def test_malicious_pickle_is_refused_and_nothing_runs(tmp_path, kind, refused):
    marker = tmp_path / "ran"
    path = tmp_path / "cache.pkl"
    path.write_bytes(_malicious(kind, marker))
    with pytest.raises(original_cache.OriginalCacheError, match=refused) as err:
        original_cache.load_cache(str(path))
    assert "\n" not in str(err.value)
    assert not marker.exists()


def test_command_refuses_os_system_with_one_line(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "cache.pkl"
    path.write_bytes(_malicious("os.system", marker))
    (tmp_path / "corpus-info.json").write_text('{"vocab_size": 1, "cutoffs": [], "dataset": "wt103"}')
    proc = subprocess.run(
        [sys.executable, "-m", "txl_tf.data.prepare", f"--from_original_cache={path}",
         f"--data_dir={tmp_path / 'data'}"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == errors.EXIT_USER_ERROR, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "refused global posix.system" in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not marker.exists() and not (tmp_path / "data").exists()
