"""Reads the corpus the authors' TF code prepared (`cache.pkl` + `corpus-info.json`) without running its code.

Their released pretrained models ship `data/cache.pkl` beside each checkpoint: a pickle (protocol 2, written by
Python 2.7 and NumPy 1.x) of their `data_utils.Corpus`, holding `.dataset`, `.vocab` (a `vocabulary.Vocab` whose
`idx2sym` lists the symbols in id order), `.train` / `.valid` / `.test` (int64 arrays of ids) and `.cutoffs`.
Those ids are the only record of the vocabulary order the models were trained with: `Counter.most_common` under
Python 2 ordered symbols of equal count by Python 2's dict order, which a Python 3 rebuild from the text cannot
reproduce. This module turns the cache into a normal prepared corpus (`corpora.PreparedCorpus`: a `Vocab` and each
split's ids exactly as stored).

A pickle can name any callable and call it. `RestrictedUnpickler.find_class` therefore admits only the globals
these files hold, each mapped to something inert:

    data_utils.Corpus, __main__.Corpus      -> OriginalCorpus (a plain holder of the attribute dict)
    vocabulary.Vocab                        -> OriginalVocab  (the same)
    collections.Counter, OrderedDict        -> the real classes (dicts)
    numpy.core.multiarray._reconstruct,     -> a stand-in that records the array's shape, integer dtype and
    numpy._core.multiarray._reconstruct,       raw little/big-endian bytes; NumPy itself is not called while
    numpy.ndarray, numpy.dtype                 unpickling, and only integer arrays are accepted
    _codecs.encode                          -> latin-1 text to bytes (how Python 3 pickles bytes at protocol 2)

and refuses every other global with one line naming it, before anything is called. (`__main__.Corpus`: their
README prepares data by running `python data_utils.py`, so the class is pickled under `__main__`.) Python 2
`str` objects are read as bytes (`encoding="bytes"`) and decoded as UTF-8 here, so Python 2 and Python 3 caches
give the same symbols.

Character datasets: enwik8 symbols are byte values written as decimal strings (`"101"`); text8 symbols are the
letters with `_` for the space. Both become byte values of a char-level `Vocab`. lm1b's cache keeps the training
split as a list of file paths (their code encoded it shard by shard): only its valid and test splits are ids.
"""

from __future__ import annotations

import collections
import hashlib
import io
import json
import os
import pickle
import re
from typing import Optional, Union

import numpy as np

from txl_tf.base.errors import UserError
from txl_tf.data.vocab import Vocab

CORPUS_INFO = "corpus-info.json"
SPLITS = ("train", "valid", "test")
CHAR_DATASETS = ("enwik8", "text8")
NEWLINE = 10


class OriginalCacheError(UserError, ValueError):
    """The file is not a cache.pkl of the authors' code, or holds something this reader refuses."""


# ---- inert stand-ins for the pickled globals ---------------------------------------------------------------
def _text(value: Union[str, bytes], what: str) -> str:
    """Python 2 `str` (bytes here) -> str, decoded as UTF-8; Python 3 / Python 2 `unicode` stay as they are."""
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise OriginalCacheError(f"{what} {value[:40]!r} is not UTF-8") from None
    if isinstance(value, str):
        return value
    raise OriginalCacheError(f"{what} should be a string, got {type(value).__name__}")


class _AttributeHolder:
    """One of the authors' objects: its attribute dictionary only (no methods of theirs exist here)."""

    attributes: dict

    def __setstate__(self, state) -> None:
        if not isinstance(state, dict):
            raise pickle.UnpicklingError(f"{type(self).__name__}: expected an attribute dict, got "
                                         f"{type(state).__name__}")
        self.attributes = {_text(key, "attribute name"): value for key, value in state.items()}

    def get(self, name: str, default=None):
        return getattr(self, "attributes", {}).get(name, default)


class OriginalCorpus(_AttributeHolder):
    """Stands for their `data_utils.Corpus`."""


class OriginalVocab(_AttributeHolder):
    """Stands for their `vocabulary.Vocab`."""


_NDARRAY = object()  # stands for numpy.ndarray: only ever passed to _reconstruct, not callable
_INT_DTYPE = re.compile(r"[iu][1248]")


class _DtypeState:
    """Stands for `numpy.dtype(name, align, copy)` + its pickled state; integer dtypes only."""

    def __init__(self, name, align=False, copy=False):
        del align, copy
        self.name = _text(name, "dtype")
        if not _INT_DTYPE.fullmatch(self.name):
            raise pickle.UnpicklingError(f"array dtype {self.name!r} refused: a cache.pkl holds integer ids only")
        self.byteorder = "<"

    def __setstate__(self, state) -> None:
        if not isinstance(state, tuple) or len(state) < 2:
            raise pickle.UnpicklingError(f"unexpected dtype state {state!r}")
        order = _text(state[1], "dtype byte order")
        if order not in ("<", ">", "|", "="):
            raise pickle.UnpicklingError(f"unexpected dtype byte order {order!r}")
        self.byteorder = order

    def numpy(self) -> np.dtype:
        order = {"|": "<", "=": "="}.get(self.byteorder, self.byteorder)
        return np.dtype(order + self.name)


class _ArrayState:
    """Stands for an ndarray being unpickled: `array` is built from raw bytes once its state arrives."""

    array: Optional[np.ndarray] = None

    def __setstate__(self, state) -> None:
        if not isinstance(state, tuple) or len(state) not in (4, 5):
            raise pickle.UnpicklingError("unexpected ndarray state")
        shape, dtype, fortran, raw = state[-4:]
        if not isinstance(dtype, _DtypeState):
            raise pickle.UnpicklingError("ndarray state without an integer dtype")
        if isinstance(raw, str):  # read with encoding="latin1": the text is the bytes
            raw = raw.encode("latin-1")
        if not isinstance(raw, bytes):  # a list here would be an object array: pickled objects, refused
            raise pickle.UnpicklingError(f"ndarray data should be raw bytes, got {type(raw).__name__}")
        if not isinstance(shape, tuple) or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise pickle.UnpicklingError(f"unexpected ndarray shape {shape!r}")
        values = np.frombuffer(raw, dtype.numpy())
        if values.size != int(np.prod(shape, dtype=np.int64)):
            raise pickle.UnpicklingError(f"ndarray of shape {shape} has {values.size} values")
        self.array = values.reshape(shape, order="F" if fortran else "C").astype(np.int64)


def _reconstruct(cls, shape, typecode) -> _ArrayState:
    del shape, typecode
    if cls is not _NDARRAY:
        raise pickle.UnpicklingError("_reconstruct is only accepted for numpy.ndarray")
    return _ArrayState()


def _latin1_encode(text, encoding="utf-8") -> bytes:
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"_codecs.encode is only accepted for latin-1 text, got {encoding!r}")
    return text.encode("latin-1")


ALLOWED_GLOBALS = {
    ("data_utils", "Corpus"): OriginalCorpus,
    ("__main__", "Corpus"): OriginalCorpus,
    ("vocabulary", "Vocab"): OriginalVocab,
    ("collections", "Counter"): collections.Counter,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy", "ndarray"): _NDARRAY,
    ("numpy", "dtype"): _DtypeState,
    ("_codecs", "encode"): _latin1_encode,
}


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles the authors' cache.pkl and nothing else: see ALLOWED_GLOBALS."""

    def find_class(self, module: str, name: str):
        allowed = ALLOWED_GLOBALS.get((module, name))
        if allowed is None:
            raise OriginalCacheError(f"refused global {module}.{name}: an original cache.pkl holds only "
                                     f"{', '.join(sorted({m + '.' + n for m, n in ALLOWED_GLOBALS}))}; "
                                     "nothing in the file was run")
        return allowed


def load_cache(path: str) -> OriginalCorpus:
    """Unpickles `path` with `RestrictedUnpickler`; returns the corpus holder."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        corpus = RestrictedUnpickler(io.BytesIO(data), encoding="bytes").load()
    except OriginalCacheError as err:
        raise OriginalCacheError(f"{path}: {err}") from None
    except (pickle.UnpicklingError, EOFError, TypeError, ValueError, AttributeError, IndexError, KeyError) as err:
        raise OriginalCacheError(f"{path} is not a readable cache.pkl of the authors' code "
                                 f"({type(err).__name__}: {err})") from None
    if not isinstance(corpus, OriginalCorpus) or not isinstance(corpus.get("vocab"), OriginalVocab):
        raise OriginalCacheError(f"{path} does not hold their data_utils.Corpus with a vocabulary.Vocab "
                                 f"(found {type(corpus).__name__})")
    return corpus


# ---- cache -> Vocab + ids ---------------------------------------------------------------------------------
def read_corpus_info(cache_path: str) -> dict:
    """corpus-info.json beside the cache ({} when absent)."""
    path = os.path.join(os.path.dirname(os.path.abspath(cache_path)), CORPUS_INFO)
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _char_symbol(symbol: str, dataset: str) -> int:
    """enwik8: decimal byte values ("101"); text8: the letter itself, "_" for the space."""
    if dataset == "enwik8" and symbol.isdigit() and int(symbol) < 256:
        return int(symbol)
    if dataset == "text8" and len(symbol.encode("utf-8")) == 1:
        return 32 if symbol == "_" else ord(symbol)
    raise OriginalCacheError(f"{dataset} symbol {symbol!r} is not a byte "
                             + ("value written in decimal" if dataset == "enwik8" else "character"))


def vocab_of(original: OriginalVocab, dataset: str) -> Vocab:
    """Their Vocab as a txl_tf `Vocab` with the same ids (`idx2sym` in order)."""
    idx2sym = original.get("idx2sym")
    if not isinstance(idx2sym, list) or not idx2sym:
        raise OriginalCacheError("the vocabulary has no idx2sym list")
    symbols = [_text(s, "symbol") for s in idx2sym]
    if dataset in CHAR_DATASETS:
        values = [_char_symbol(s, dataset) for s in symbols]
        drop = (NEWLINE,) if dataset == "enwik8" and NEWLINE not in values else ()  # lines had no end symbol
        return Vocab(values, "char", drop=drop)
    if dataset == "lm1b":
        return Vocab(symbols, "word", bos="<S>", eos="<S>", unk="<UNK>")
    unk_idx = original.get("unk_idx")
    unk = symbols[unk_idx] if isinstance(unk_idx, int) and 0 <= unk_idx < len(symbols) else (
        "<unk>" if "<unk>" in symbols else None)
    return Vocab(symbols, "word", eos="<eos>" if "<eos>" in symbols else None, unk=unk)


def split_ids(corpus: OriginalCorpus, split: str) -> Optional[np.ndarray]:
    """A split's ids as stored (int64 [N]); None where the cache holds no ids (lm1b's train: file paths)."""
    value = corpus.get(split)
    if isinstance(value, list) and all(isinstance(v, (str, bytes)) for v in value):
        return None
    if not isinstance(value, _ArrayState) or value.array is None or value.array.ndim != 1:
        raise OriginalCacheError(f"split {split!r} is not a 1-D array of ids")
    return value.array


def describe_ids(ids: np.ndarray, first: int = 20) -> dict:
    """num_tokens, SHA-256 of the ids as little-endian int64, first ids (the fields of the fixture's expected.json)."""
    data = np.ascontiguousarray(ids, "<i8")
    return {"num_tokens": int(data.size), "sha256_int64": hashlib.sha256(data.tobytes()).hexdigest(),
            "first_ids": data[:first].tolist()}


def dataset_of(cache_path: str, corpus: Optional[OriginalCorpus] = None) -> str:
    """The dataset named by corpus-info.json beside the cache, else by the pickle; they must agree.

    Without `corpus` a corpus-info.json answers alone (the pickle of a large corpus is not read twice).
    """
    from_info = read_corpus_info(cache_path).get("dataset")
    if corpus is None and from_info:
        return from_info
    corpus = corpus or load_cache(cache_path)
    stored = corpus.get("dataset")
    from_pickle = _text(stored, "dataset") if stored is not None else None
    if from_pickle and from_info and from_pickle != from_info:
        raise OriginalCacheError(f"{cache_path} says dataset {from_pickle!r}, {CORPUS_INFO} beside it says "
                                 f"{from_info!r}")
    dataset = from_info or from_pickle
    if not dataset:
        raise OriginalCacheError(f"{cache_path}: no dataset in the pickle and no {CORPUS_INFO} beside it")
    return dataset


def read_original_cache(cache_path: str) -> tuple[str, Vocab, dict, dict]:
    """(dataset, Vocab, {split: int64 ids}, details for the metadata) of a cache.pkl, ids exactly as stored."""
    corpus = load_cache(cache_path)
    dataset = dataset_of(cache_path, corpus)
    vocab = vocab_of(corpus.get("vocab"), dataset)
    splits, skipped = {}, []
    for split in SPLITS:
        ids = split_ids(corpus, split)
        if ids is None:
            skipped.append(split)
            continue
        if ids.size == 0 or ids.min() < 0 or ids.max() >= len(vocab):
            raise OriginalCacheError(f"split {split!r} has ids outside [0, {len(vocab)}) or is empty")
        splits[split] = ids
    info = read_corpus_info(cache_path)
    if info.get("vocab_size", len(vocab)) != len(vocab):
        raise OriginalCacheError(f"{CORPUS_INFO} says vocab_size {info['vocab_size']}, the cache has "
                                 f"{len(vocab)} symbols")
    cutoffs = corpus.get("cutoffs")
    digest = hashlib.sha256()
    with open(cache_path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    details = {"original_cutoffs": list(cutoffs) if isinstance(cutoffs, list) else None,
               "splits_without_ids": skipped, "corpus_info": info,
               "cache_pkl": {"bytes": os.path.getsize(cache_path), "sha256": digest.hexdigest()}}
    return dataset, vocab, splits, details


def summary(data_dir: str, meta: dict) -> str:
    """What a prepared data_dir holds, read back from its files: the vocabulary (size, SHA-256 of its symbols as
    a JSON list, first symbols) and per split the fields of `describe_ids`, to compare with the original."""
    from txl_tf.data import records

    symbols = Vocab.load(os.path.join(data_dir, meta.get("vocab_file", "vocab.json"))).symbols
    digest = hashlib.sha256(json.dumps(symbols, ensure_ascii=False).encode("utf-8")).hexdigest()
    lines = [f"vocabulary: {len(symbols):,} symbols, sha256(JSON list) {digest}, first {symbols[:8]}"]
    for split in SPLITS:
        if split in meta["splits"]:
            found = describe_ids(records.read_split_records(data_dir, meta, split))
            lines.append(f"{split}: {found['num_tokens']:,} tokens, sha256(int64 LE ids) {found['sha256_int64']}, "
                         f"first ids {found['first_ids'][:10]}")
    skipped = meta.get("options", {}).get("splits_without_ids") or []
    if skipped:
        lines.append(f"not in the cache as ids (file paths): {', '.join(skipped)}")
    return "\n".join(lines)
