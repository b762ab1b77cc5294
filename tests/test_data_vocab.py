"""Vocabulary: frequency order, JSON storage, text round trips, the in-graph tokenizer's equal ids, and a vocab.json
that is no vocabulary (or cannot be read safely) in one line."""

import collections
import json
import os
import re

import numpy as np
import pytest
import tensorflow as tf

from txl_tf.base.errors import UserError
from txl_tf.data.tf_tokenize import TFTokenizer
from txl_tf.data.vocab import Vocab, char_vocab_from_bytes, frequency_order

WORDS = Vocab(["<eos>", "the", "cat", "<unk>", "sat", "on", "mat"], "word", eos="<eos>", unk="<unk>")
SENTENCES = Vocab(["<S>", "</S>", "<UNK>", "a", "b"], "word", bos="<S>", eos="<S>", unk="<UNK>")
TEXTS = ["the cat sat\non the mat\n", "the  dog\n\n sat ", "", "\n", "cat\n  ", "mat on\tthe\r\ncat"]


def test_frequency_order_ties_by_first_appearance():
    counts = collections.Counter("b a c a b d".split())
    assert frequency_order(counts) == ["b", "a", "c", "d"]
    assert frequency_order(counts, exclude=["a"]) == ["b", "c", "d"]
    data = np.frombuffer(b"zzyxxw\nq", np.uint8)
    vocab = char_vocab_from_bytes([data[:4], data[4:]], drop=[10])
    assert vocab.symbols == [ord(c) for c in "zxywq"]  # z, x twice (z seen first), then by first sight


def test_word_round_trip_and_line_symbols():
    text = "the cat sat\non the mat\n\nsat"
    ids = WORDS.encode(text)
    assert ids == [1, 2, 4, 0, 5, 1, 6, 0, 0, 4]  # <eos> ends each complete line, none after "sat"
    assert WORDS.decode(ids) == text
    assert WORDS.encode("the dog") == [1, 3]  # unknown word -> <unk>
    assert SENTENCES.encode("a b\nb") == [0, 3, 4, 0, 0, 4]
    assert SENTENCES.decode(SENTENCES.encode("a b\n\nb a")) == "a b\n\nb a"


def test_unknown_symbols_raise_without_unk():
    vocab = Vocab(["<eos>", "x"], "word", eos="<eos>")
    with pytest.raises(KeyError, match="'y' is not in the word-level vocabulary"):
        vocab.encode("x y")
    chars = Vocab([97, 98], "char")
    with pytest.raises(ValueError, match="byte 99"):
        chars.encode("abc")
    with pytest.raises(ValueError, match="id 7 is out of range"):
        chars.decode([0, 7])


def test_char_round_trip_drops_newlines_when_asked():
    text = "Zürich\n<page> 12"
    data = np.frombuffer(text.encode("utf-8"), np.uint8)
    keep = char_vocab_from_bytes([data])
    assert keep.decode(keep.encode(text)) == text
    drop = char_vocab_from_bytes([data], drop=[10])
    assert 10 not in drop.symbols and len(drop) == len(keep) - 1
    assert drop.decode(drop.encode(text)) == text.replace("\n", "")


def test_json_storage(tmp_path):
    for vocab in (WORDS, SENTENCES, char_vocab_from_bytes([np.frombuffer(b"abca\n", np.uint8)], drop=[10])):
        path = str(tmp_path / "vocab.json")
        vocab.save(path)
        assert Vocab.load(path) == vocab
    (tmp_path / "bad.json").write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match="bad.json: not a txl_tf.vocab"):
        Vocab.load(str(tmp_path / "bad.json"))


@pytest.mark.parametrize("vocab", [WORDS, SENTENCES], ids=["eos", "sentences"])
def test_tf_tokenizer_matches_encode_words(vocab):
    got = TFTokenizer(vocab)(TEXTS)
    assert got.dtype == tf.int32
    assert got.to_list() == [vocab.encode(t) for t in TEXTS]


def test_tf_tokenizer_matches_encode_chars():
    texts = ["Zürich\n<page>", "", "a\n\nb"]
    vocab = char_vocab_from_bytes([np.frombuffer("".join(texts).encode("utf-8"), np.uint8)], drop=[10])
    tokenizer = TFTokenizer(vocab)
    assert tokenizer(texts).to_list() == [vocab.encode(t) for t in texts]
    with pytest.raises(tf.errors.InvalidArgumentError, match="not in the vocabulary"):
        tokenizer(["q"])


# ---- issue 34: a vocab.json is untrusted input: schema-checked, bounded, one line --------------------------------
def _vocab_json(**changes) -> dict:
    return {**Vocab([10, 97, 98], "char").to_json(), **changes}


@pytest.mark.parametrize("content,message", [
    (_vocab_json(symbols=[None, [1], {"a": 1}], size=3),
     r"char-level symbols must be byte values 0\.\.255, got e\.g\. \[None, \[1\], \{'a': 1\}\]"),
    (_vocab_json(symbols=[True, 97], size=2), r"char-level symbols must be byte values 0\.\.255, got e\.g\. \[True\]"),
    (_vocab_json(level="word", symbols=["<eos>", 7, ["x"]], size=3, eos="<eos>", drop=[]),
     r"word-level symbols must be strings, got e\.g\. \[7, \['x'\]\]"),
    (_vocab_json(level="word", symbols=["<eos>", "x"], size=2, eos=["<eos>"], drop=[]),
     r"the eos symbol must be a string or None, got \['<eos>'\]"),
    (_vocab_json(drop="ab"), r"drop must be a list of byte values 0\.\.255, got 'ab'"),
    (_vocab_json(level=["char"]), r"vocabulary level must be one of \('char', 'word'\), got \['char'\]"),
    (_vocab_json(symbols="abc"), r"'symbols' must be a list, got str"),
    (_vocab_json(size="3"), r"says size '3' but lists 3 symbols"),
    ([1, 2, 3], r"not a txl_tf\.vocab v1 file \(a JSON list\)"),
], ids=["unhashable_symbols", "bool_symbol", "word_symbols", "eos_list", "drop_str", "level_list", "symbols_str",
        "size_str", "json_list"])
def test_a_vocab_json_that_is_no_vocabulary_is_one_line(tmp_path, content, message):
    path = tmp_path / "vocab.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: {message}; re-run `python -m txl_tf.data.prepare` "
                                         "with --overwrite \\(or save the preset again\\)$") as raised:
        Vocab.load(str(path))
    assert isinstance(raised.value, UserError)  # one `error:` line from every command


@pytest.mark.parametrize("kind,message", [
    ("device", "is not a regular file \\(a device, FIFO or socket\\)"),
    ("deep", "nests deeper than 64 levels"),
    ("large", "holds 300\\.0 MiB, more than the 256\\.0 MiB such a file may hold"),
    ("infinity", "is not valid JSON \\(Infinity is not a finite number\\)"),
])
def test_a_vocab_json_that_cannot_be_read_safely_is_one_line(tmp_path, kind, message):
    path = tmp_path / "vocab.json"
    if kind == "device":
        os.symlink("/dev/zero", path)
    elif kind == "deep":
        path.write_text("[" * 200_000 + "]" * 200_000)
    elif kind == "large":
        with open(path, "wb") as f:
            f.truncate(300 << 20)  # sparse: no disk space used
    else:
        path.write_text(json.dumps(_vocab_json(drop=[10])).replace("[10]", "[Infinity]"))
    with pytest.raises(ValueError, match=f"^vocabulary file {re.escape(str(path))} {message}") as raised:
        Vocab.load(str(path))
    assert isinstance(raised.value, UserError) and "\n" not in str(raised.value)
