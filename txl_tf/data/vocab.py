"""Vocabularies: character (byte) level and word level, stored as JSON, never pickle.

Character level: every symbol is one byte value (0..255) of the UTF-8 text, as in the authors' enwik8/text8
preparation, where each byte is one token. Bytes listed in `drop` (the newline byte for enwik8 by default,
because the original encodes lines without an end symbol) are removed before encoding.

Word level: whitespace tokens. A complete line (ended by "\\n") becomes `[bos] + words + [eos]`, so `<eos>` stands
for the newline (WikiText, PTB) and lm1b's `<S>` brackets every sentence. A final line without a newline gets
no end symbol (a prompt to be continued). Unknown words map to `unk` when the vocabulary has one (PTB `<unk>`,
lm1b `<UNK>`), otherwise encoding raises.

A vocab.json is untrusted input (a preset or a prepared folder someone sends): `Vocab.load` reads a regular file
of at most `untrusted.VOCAB_LIMIT` bytes as strict JSON and checks its schema (byte values or strings, the
special symbols among them); a file that is not a vocabulary is one `VocabError` line naming it.

`txl_tf.data.tf_tokenize.TFTokenizer(vocab)` gives the same ids inside a TensorFlow graph (tensorflow-text
`WhitespaceTokenizer` and a `tf.lookup.StaticHashTable` for words, a byte lookup table for characters), so a
SavedModel can take strings. This module does not import TensorFlow.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
from collections.abc import Iterable, Sequence
from typing import Optional, Union

import numpy as np

from txl_tf.base import untrusted
from txl_tf.base.errors import ConfigError, UserError, one_line

VOCAB_FILE = "vocab.json"
VOCAB_FORMAT = "txl_tf.vocab"
VOCAB_VERSION = 1
LEVELS = ("char", "word")


class VocabError(UserError, ValueError):
    """A vocabulary (a vocab.json or a symbol table) that is not one: one line naming the file and what is wrong."""


def _byte(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and 0 <= value < 256


def _examples(values: list) -> str:
    """Up to 5 values, each repr clipped to 20 characters."""
    return "[" + ", ".join(r if len(r := repr(v)) <= 20 else r[:17] + "..." for v in values[:5]) + "]"


class Vocab:
    """A fixed symbol table: id i is `symbols[i]`.

    Args:
      symbols: for `level="char"` byte values 0..255; for `level="word"` strings.
      level: "char" or "word".
      eos: word level: symbol appended to every complete line (None: none).
      bos: word level: symbol put in front of every line (None: none).
      unk: word level: symbol for words not in the table (None: unknown words raise).
      drop: char level: byte values removed before encoding (e.g. (10,) drops newlines).
    """

    def __init__(
        self,
        symbols: Sequence[Union[int, str]],
        level: str,
        *,
        eos: Optional[str] = None,
        bos: Optional[str] = None,
        unk: Optional[str] = None,
        drop: Sequence[int] = (),
    ):
        if not isinstance(level, str) or level not in LEVELS:
            raise VocabError(f"vocabulary level must be one of {LEVELS}, got {_examples([level])[1:-1]}")
        self.level = level
        self.symbols = list(symbols)
        # The types first: a list or a dict among the symbols is unhashable, None or a number is no word.
        if level == "char":
            bad = [s for s in self.symbols if not _byte(s)]
            if bad:
                raise VocabError(f"char-level symbols must be byte values 0..255, got e.g. {_examples(bad)}")
        else:
            bad = [s for s in self.symbols if not isinstance(s, str)]
            if bad:
                raise VocabError(f"word-level symbols must be strings, got e.g. {_examples(bad)}")
        for name, sym in (("eos", eos), ("bos", bos), ("unk", unk)):
            if sym is not None and not isinstance(sym, str):
                raise VocabError(f"the {name} symbol must be a string or None, got {_examples([sym])[1:-1]}")
        drops = list(drop) if isinstance(drop, Iterable) and not isinstance(drop, (str, bytes, dict)) else None
        if drops is None or not all(_byte(b) for b in drops):
            raise VocabError(f"drop must be a list of byte values 0..255, got {_examples([drop])[1:-1]}")
        self.eos, self.bos, self.unk = eos, bos, unk
        self.drop = tuple(sorted(int(b) for b in drops))
        if len(set(self.symbols)) != len(self.symbols):
            dup = [s for s, c in collections.Counter(self.symbols).items() if c > 1][:5]
            raise VocabError(f"vocabulary has duplicate symbols, e.g. {_examples(dup)}")
        if level == "char":
            if eos or bos or unk:
                raise VocabError("eos/bos/unk are word-level options")
            self.symbols = [int(s) for s in self.symbols]
            self._byte_to_id = np.full(256, -1, np.int64)
            self._byte_to_id[self.symbols] = np.arange(len(self.symbols))
            self._byte_to_id[list(self.drop)] = -2  # removed before lookup
        else:
            if drops:
                raise VocabError("drop is a char-level option")
            for name, sym in (("eos", eos), ("bos", bos), ("unk", unk)):
                if sym is not None and sym not in self.symbols:
                    raise VocabError(f"{name} symbol {_examples([sym])[1:-1]} is not in the vocabulary")
        self._index = {s: i for i, s in enumerate(self.symbols)}

    def __len__(self) -> int:
        return len(self.symbols)

    def __eq__(self, other) -> bool:
        return isinstance(other, Vocab) and self.to_json() == other.to_json()

    def __repr__(self) -> str:
        return f"Vocab(level={self.level!r}, size={len(self)})"

    def id_of(self, symbol: Union[int, str]) -> int:
        """The id of one symbol (a byte value at char level, a word at word level)."""
        if symbol in self._index:
            return self._index[symbol]
        if self.level == "word" and self.unk is not None:
            return self._index[self.unk]
        raise KeyError(f"symbol {symbol!r} is not in the {self.level}-level vocabulary of {len(self)} symbols"
                       + (" (it has no unknown-word symbol)" if self.level == "word" else ""))

    # ---- encoding -------------------------------------------------------------------------------------
    def encode(self, text: Union[str, bytes]) -> list[int]:
        """Text -> ids (see the module docstring for the line convention)."""
        return self.encode_array(text).tolist()

    def encode_prompt(self, text, what: str, not_text: str) -> list[int]:
        """A prompt a user gave -> ids, refusing in one line what is not text of this vocabulary: a TypeError
        (`not_text`, then what `text` is) for anything but a str, a ConfigError naming `what` for a symbol outside
        the vocabulary or text that encodes to no tokens."""
        if not isinstance(text, str):
            raise TypeError(f"{not_text}; got {type(text).__name__}"
                            + ("; decode it first, e.g. prompt.decode('utf-8')" if isinstance(text, bytes) else ""))
        try:
            ids = self.encode(text)
        except (KeyError, ValueError) as error:
            raise ConfigError(f"{what} has a symbol outside the {self.level}-level vocabulary "
                              f"({one_line(error).strip(chr(34))}); change the prompt") from None
        if not ids:
            raise ConfigError(f"{what} encodes to no tokens; give some text")
        return ids

    def encode_array(self, text: Union[str, bytes]) -> np.ndarray:
        """Like `encode`, as an int32 array (vectorised for char level)."""
        if self.level == "char":
            data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
            return self.encode_bytes(np.frombuffer(data, np.uint8))
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        lines = text.split("\n")
        tokens = self.line_tokens(lines[:-1])
        last = lines[-1].split()
        if last:  # an unterminated last line: no end symbol
            tokens += ([self.bos] if self.bos else []) + last
        return self.words_to_ids(tokens)

    def encode_bytes(self, data: np.ndarray) -> np.ndarray:
        """Char level: uint8 array of bytes -> int32 ids, dropping `drop` bytes; raises on unknown bytes."""
        data = np.asarray(data, np.uint8)
        for byte in self.drop:
            data = data[data != byte]
        ids = self._byte_to_id.astype(np.int32)[data]  # dropped bytes are gone; -1 marks unknown ones
        if ids.size and ids.min() < 0:
            pos = int(np.argmax(ids < 0))
            raise ValueError(f"byte {int(data[pos])} (at position {pos} after dropping {list(self.drop)}) is "
                             f"not in the char-level vocabulary of {len(self)} symbols")
        return ids

    def line_tokens(self, lines: Iterable[str]) -> list[str]:
        """Word level: complete lines -> tokens with the line's bos/eos symbols (the corpus convention)."""
        tokens: list[str] = []
        head = [self.bos] if self.bos else []
        tail = [self.eos] if self.eos else []
        for line in lines:
            tokens += head
            tokens += line.split()
            tokens += tail
        return tokens

    def words_to_ids(self, tokens: Sequence[str]) -> np.ndarray:
        """Word level: tokens -> int32 ids (unknown words -> unk, or KeyError naming the word)."""
        if self.unk is not None:
            ids = map(self._index.get, tokens, itertools.repeat(self._index[self.unk]))
            return np.fromiter(ids, np.int32, count=len(tokens))
        try:
            return np.fromiter(map(self._index.__getitem__, tokens), np.int32, count=len(tokens))
        except KeyError as err:
            raise KeyError(f"word {err.args[0]!r} is not in the word-level vocabulary of {len(self)} symbols "
                           "and the vocabulary has no unknown-word symbol") from None

    # ---- decoding -------------------------------------------------------------------------------------
    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text. Char level: bytes decoded as UTF-8 (invalid sequences replaced).

        Word level: words joined by single spaces, the end symbol becomes a newline, a line's start symbol is
        dropped (for lm1b, where start and end are both `<S>`, the first `<S>` of a line opens it).
        """
        if self.level == "char":
            return self.decode_bytes(ids).decode("utf-8", errors="replace")
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < len(self)]
        if bad:
            raise ValueError(f"id {bad[0]} is out of range for a vocabulary of {len(self)} symbols")
        out, line, line_open = [], [], False
        for i in ids:
            sym = self.symbols[i]
            if sym == self.bos and not line_open:
                line_open = True
            elif sym == self.eos:
                out.append(" ".join(line) + "\n")
                line, line_open = [], False
            else:
                line.append(sym)
                line_open = True
        return "".join(out) + " ".join(line)

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Char level: ids -> the exact bytes (no UTF-8 decoding)."""
        if self.level != "char":
            raise ValueError("decode_bytes is for char-level vocabularies; use decode")
        ids = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids, np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self)):
            bad = int(ids[(ids < 0) | (ids >= len(self))][0])
            raise ValueError(f"id {bad} is out of range for a vocabulary of {len(self)} symbols")
        return np.asarray(self.symbols, np.uint8)[ids].tobytes()

    # ---- storage --------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "format": VOCAB_FORMAT,
            "version": VOCAB_VERSION,
            "level": self.level,
            "size": len(self),
            "eos": self.eos,
            "bos": self.bos,
            "unk": self.unk,
            "drop": list(self.drop),
            "symbols": self.symbols,
        }

    @classmethod
    def from_json(cls, obj: dict, where: str = "vocabulary") -> Vocab:
        """The vocabulary of a `to_json()` dict, its schema checked: VocabError naming `where` otherwise."""
        fix = "re-run `python -m txl_tf.data.prepare` with --overwrite (or save the preset again)"
        if not isinstance(obj, dict) or obj.get("format") != VOCAB_FORMAT or obj.get("version") != VOCAB_VERSION:
            found = (f"format={_examples([obj.get('format')])[1:-1]}, version={_examples([obj.get('version')])[1:-1]}"
                     if isinstance(obj, dict) else f"a JSON {type(obj).__name__}")
            raise VocabError(f"{where}: not a {VOCAB_FORMAT} v{VOCAB_VERSION} file ({found}); {fix}")
        if not isinstance(obj.get("symbols"), list):
            raise VocabError(f"{where}: 'symbols' must be a list, got {type(obj.get('symbols')).__name__}; {fix}")
        try:
            vocab = cls(obj["symbols"], obj.get("level"), eos=obj.get("eos"), bos=obj.get("bos"),
                        unk=obj.get("unk"), drop=obj.get("drop", ()))
        except ValueError as error:
            raise VocabError(f"{where}: {error}; {fix}") from None
        if obj.get("size") != len(vocab):
            raise VocabError(f"{where}: says size {_examples([obj.get('size')])[1:-1]} but lists {len(vocab)} "
                             f"symbols; {fix}")
        return vocab

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, ensure_ascii=False)
            f.write("\n")

    @classmethod
    def load(cls, path: str) -> Vocab:
        """The vocabulary in the file `path`: a regular file of at most `untrusted.VOCAB_LIMIT` bytes, strict JSON,
        its schema checked (`from_json`). FileNotFoundError when it is missing, VocabError otherwise."""
        if not os.path.exists(path):
            raise FileNotFoundError(f"vocabulary file {path} not found; prepare the data with "
                                    "`python -m txl_tf.data.prepare --dataset=NAME --data_dir=DIR`")
        try:
            obj = untrusted.load_json(path, max_bytes=untrusted.VOCAB_LIMIT, what="vocabulary file")
        except untrusted.UntrustedFileError as error:
            raise VocabError(f"{error}".replace("; give the right file", "; re-run prepare with --overwrite")) \
                from None
        return cls.from_json(obj, where=path)


def frequency_order(counts: collections.Counter, exclude: Iterable = ()) -> list:
    """Symbols by decreasing count; ties keep first-seen order (a Counter remembers insertion order)."""
    skip = set(exclude)
    items = [(s, c) for s, c in counts.items() if s not in skip]
    items.sort(key=lambda sc: -sc[1])  # stable: equal counts stay in first-seen order
    return [s for s, _ in items]


def char_vocab_from_bytes(splits: Sequence[np.ndarray], drop: Sequence[int] = ()) -> Vocab:
    """Byte vocabulary from uint8 arrays: most frequent first, ties by first occurrence (vectorised)."""
    unseen = np.iinfo(np.int64).max
    counts = np.zeros(256, np.int64)
    first = np.full(256, unseen)
    offset = 0
    for data in splits:
        for start in range(0, data.size, 1 << 22):
            chunk = data[start:start + (1 << 22)]
            chunk_counts = np.bincount(chunk, minlength=256)
            for value in np.flatnonzero((chunk_counts > 0) & (first == unseen)):  # first sightings only
                first[value] = offset + start + int(np.argmax(chunk == value))
            counts += chunk_counts
        offset += data.size
    counts[list(drop)] = 0
    present = np.flatnonzero(counts)
    order = np.lexsort((first[present], -counts[present]))
    return Vocab(present[order].tolist(), "char", drop=drop)

