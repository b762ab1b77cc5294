"""GraphTokenizer: the Keras tokenizer layer gives Vocab's ids and text, eagerly, in tf.function and in
tf.data, with unknown symbols as the vocabulary says, and its config round-trips."""

import doctest
import os
import random

import keras
import numpy as np
import pytest
import tensorflow as tf
from layer_test_case import LayerHolder

from txl_tf.base.errors import ConfigError
from txl_tf.data import records
from txl_tf.data.vocab import VOCAB_FILE, Vocab, char_vocab_from_bytes
from txl_tf.lm import tokenizer as tokenizer_module
from txl_tf.lm.tokenizer import GraphTokenizer

WORDS = Vocab(["<eos>", "the", "cat", "<unk>", "sat", "on", "mat"], "word", eos="<eos>", unk="<unk>")
SENTENCES = Vocab(["<S>", "</S>", "<UNK>", "a", "b"], "word", bos="<S>", eos="<S>", unk="<UNK>")  # lm1b style
BRACKETS = Vocab(["<s>", "</s>", "a", "b"], "word", bos="<s>", eos="</s>")  # no unk: unknown words fail
WORD_TEXTS = ["the cat sat\non the mat\n", "the  dog\n\n sat ", "", "\n", "cat\n  ", "mat on\tthe\r\ncat"]
CHAR_TEXTS = ["Zürich\n<page> 12", "", "a\n\nb", "naïve café ☕"]
CHARS = char_vocab_from_bytes([np.frombuffer("".join(CHAR_TEXTS).encode("utf-8"), np.uint8)], drop=[10])


def _texts(strings):
    return [s.decode("utf-8") for s in strings.numpy().tolist()]


@pytest.mark.parametrize("vocab", [WORDS, SENTENCES], ids=["eos_unk", "sentences"])
def test_word_ids_equal_vocab_encode(vocab):
    tokenizer = GraphTokenizer(vocab)
    ids = tokenizer(WORD_TEXTS)
    assert isinstance(ids, tf.RaggedTensor) and ids.dtype == tf.int32
    assert ids.to_list() == [vocab.encode(t) for t in WORD_TEXTS]
    one = tokenizer.tokenize(WORD_TEXTS[0])  # a scalar string: dense ids [T]
    assert isinstance(one, tf.Tensor) and one.numpy().tolist() == vocab.encode(WORD_TEXTS[0])


def test_char_ids_equal_vocab_encode_and_round_trip():
    tokenizer = GraphTokenizer(CHARS)
    ids = tokenizer(CHAR_TEXTS)
    assert ids.to_list() == [CHARS.encode(t) for t in CHAR_TEXTS]
    # The newline byte is dropped by this vocabulary (enwik8's convention), the rest comes back exactly.
    assert _texts(tokenizer.detokenize(ids)) == [t.replace("\n", "") for t in CHAR_TEXTS]
    assert tokenizer.detokenize(tokenizer("Zürich")).numpy().decode("utf-8") == "Zürich"


def test_char_detokenize_replaces_invalid_utf8_as_vocab_decode():
    vocab = Vocab(list(range(256)), "char")
    tokenizer = GraphTokenizer(vocab)
    rows = [list(b"a\xc3"), list(b"\xff\xfe"), list(b"\xe2\x82("), list(b"\xed\xa0\x80"), list("Zü".encode())]
    assert _texts(tokenizer.detokenize(tf.ragged.constant(rows))) == [vocab.decode(r) for r in rows]


# brackets: slow (~20 s: its tables' first build), CI's slow phase
@pytest.mark.parametrize("vocab", [WORDS, SENTENCES, pytest.param(BRACKETS, marks=pytest.mark.slow)],
                         ids=["eos_unk", "sentences", "brackets"])
def test_word_detokenize_equals_vocab_decode(vocab):
    tokenizer = GraphTokenizer(vocab)
    rng = random.Random(0)
    rows = [[rng.randrange(len(vocab)) for _ in range(rng.randrange(12))] for _ in range(200)]
    rows += [[0] * k for k in range(5)]  # runs of the start/end symbol (lm1b: they alternate open and close)
    assert _texts(tokenizer.detokenize(tf.ragged.constant(rows, tf.int32))) == [vocab.decode(r) for r in rows]
    known = [t for t in WORD_TEXTS if "dog" not in t] if vocab is WORDS else ["a b\n\nb a", "b\n", "a  b\n a"]
    assert _texts(tokenizer.detokenize(tokenizer(known))) == [vocab.decode(vocab.encode(t)) for t in known]
    assert tokenizer.detokenize(vocab.encode(known[0])).numpy().decode() == vocab.decode(vocab.encode(known[0]))


def test_unknown_symbols_as_the_vocabulary_says():
    assert GraphTokenizer(WORDS)("the dog").numpy().tolist() == [1, 3]  # dog -> <unk>
    with pytest.raises(tf.errors.InvalidArgumentError, match="not in the vocabulary"):
        GraphTokenizer(BRACKETS)(["a c"])  # no unknown-word symbol
    with pytest.raises(tf.errors.InvalidArgumentError, match="not in the vocabulary"):
        GraphTokenizer(CHARS)(["q"])  # a byte the char vocabulary never saw
    with pytest.raises(tf.errors.InvalidArgumentError, match="out of range for the vocabulary of 7 symbols"):
        GraphTokenizer(WORDS).detokenize([[1, 7]])


def test_token_lookups():
    words = GraphTokenizer(WORDS)
    assert words.vocabulary_size() == 7 and words.get_vocabulary() == WORDS.symbols
    assert words.id_to_token(2) == "cat" and words.token_to_id("cat") == 2
    assert words.token_to_id("dog") == 3  # unk
    with pytest.raises(ConfigError, match="'c' is not in the word-level vocabulary"):
        GraphTokenizer(BRACKETS).token_to_id("c")
    with pytest.raises(ConfigError, match="id 7 is out of range"):
        words.id_to_token(7)
    chars = GraphTokenizer(CHARS)
    z = chars.token_to_id("Z")
    assert chars.id_to_token(z) == ord("Z") and chars.token_to_id(ord("Z")) == z == chars("Z").numpy()[0]
    with pytest.raises(ConfigError, match="'ü' is 2 bytes"):
        chars.token_to_id("ü")


def test_in_tf_data_and_tf_function():
    tokenizer = GraphTokenizer(WORDS)
    texts = [t for t in WORD_TEXTS if t]
    per_text = tf.data.Dataset.from_tensor_slices(texts).map(tokenizer)
    assert [x.numpy().tolist() for x in per_text] == [WORDS.encode(t) for t in texts]
    batched = tf.data.Dataset.from_tensor_slices(texts).batch(3).map(tokenizer).map(tokenizer.detokenize)
    assert sum((_texts(x) for x in batched), []) == [WORDS.decode(WORDS.encode(t)) for t in texts]

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string)])
    def round_trip(strings):
        return tokenizer.detokenize(tokenizer(strings))

    assert _texts(round_trip(tf.constant(texts))) == [WORDS.decode(WORDS.encode(t)) for t in texts]


def test_config_round_trip_and_keras_file(tmp_path):
    for vocab in (SENTENCES, CHARS):
        layer = GraphTokenizer(vocab, dtype="int64", name="tok")
        config = layer.get_config()
        clone = GraphTokenizer.from_config(config)
        assert clone.vocab == vocab and clone.get_config() == config
        restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer))
        assert type(restored) is GraphTokenizer and restored.get_config() == config
        text = ["a b\nb"] if vocab is SENTENCES else ["Zürich"]
        assert restored(text).dtype == tf.int64 and restored(text).to_list() == layer(text).to_list()
    path = str(tmp_path / "tokenizer.keras")
    LayerHolder(GraphTokenizer(WORDS)).save(path)
    assert keras.models.load_model(path).layer.vocab == WORDS


def test_saved_model_keeps_the_tables(tmp_path):
    module = tf.Module()
    module.tokenizer = GraphTokenizer(SENTENCES)
    module.encode = tf.function(lambda s: module.tokenizer(s), input_signature=[tf.TensorSpec([None], tf.string)])
    tf.saved_model.save(module, str(tmp_path))
    loaded = tf.saved_model.load(str(tmp_path))
    assert loaded.encode(tf.constant(["a b\nb"])).to_list() == [SENTENCES.encode("a b\nb")]


def test_constructors_from_files(tmp_path):
    path = str(tmp_path / VOCAB_FILE)
    WORDS.save(path)
    assert GraphTokenizer.from_vocab_file(path).vocab == WORDS
    assert GraphTokenizer.from_vocab(WORDS).vocab == WORDS
    data_dir = str(tmp_path / "data")
    records.write_prepared(data_dir, dataset="tiny", vocab=WORDS, source={}, options={},
                           splits={"train": np.asarray(WORDS.encode("the cat sat\n"), np.int32)})
    assert GraphTokenizer.from_data_dir(data_dir).vocab == WORDS
    with pytest.raises(FileNotFoundError, match="prepare"):
        GraphTokenizer.from_vocab_file(os.path.join(str(tmp_path), "missing.json"))
    with pytest.raises(ConfigError, match="vocabulary must be a txl_tf Vocab"):
        GraphTokenizer(["the", "cat"])
    with pytest.raises(ConfigError, match="dtype must be int32 or int64"):
        GraphTokenizer(WORDS, dtype="float32")


def test_docstring_example_runs():
    result = doctest.testmod(tokenizer_module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
