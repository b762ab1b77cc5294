"""Vocabulary: frequency order, JSON storage, text round trips and the in-graph tokenizer's equal ids."""

import collections

import numpy as np
import pytest
import tensorflow as tf

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
