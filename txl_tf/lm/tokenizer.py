"""`GraphTokenizer`: a model's vocabulary as a Keras layer (text -> ids -> text inside TensorFlow), the layer inside
the keras-hub tokenizer `txl_tf.TransformerXLTokenizer` (`txl_tf.lm.hub`) and beside the SavedModel's.

A thin Keras face over `txl_tf.data.tf_tokenize.TFTokenizer`, the in-graph tokenizer the SavedModel already
uses, so ids equal `Vocab.encode`'s and text equals `Vocab.decode`'s. It works eagerly, inside `tf.function` and
inside `tf.data.Dataset.map`. Unknown symbols are handled as the vocabulary says: a word-level vocabulary with an
unknown-word symbol maps unknown words to it; one without (and every char-level vocabulary, whose symbols are the
bytes seen in the training data) fails with InvalidArgumentError naming the vocabulary.

    tokenizer = GraphTokenizer.from_data_dir("data/wt103")
    ids = tokenizer(["the cat sat\\n", "on the"])  # tf.RaggedTensor int32 [2, (T)]
    tokenizer.detokenize(ids)                      # tf.Tensor string [2]: b"the cat sat\\n", b"on the"
    dataset = tf.data.Dataset.from_tensor_slices(texts).map(tokenizer)

The layer's config holds the whole vocabulary (`Vocab.to_json()`), so `get_config`/`from_config` and `.keras`
files round-trip without the data directory.
"""

from __future__ import annotations

from typing import Union

import keras
import tensorflow as tf

from txl_tf.base.errors import ConfigError
from txl_tf.data.tf_tokenize import TFTokenizer
from txl_tf.data.vocab import Vocab


def _as_strings(inputs):
    """A string tensor from a str, bytes, list of them or a tensor (tensors pass through)."""
    if tf.is_tensor(inputs) or isinstance(inputs, keras.KerasTensor):
        return inputs
    try:
        return tf.convert_to_tensor(inputs, tf.string)
    except (TypeError, ValueError):
        raise ConfigError(f"the tokenizer takes a string or a list of strings, got {type(inputs).__name__}: "
                          f"{str(inputs)[:60]!r}; pass text") from None


def _as_ids(inputs):
    """An integer tensor or ragged tensor from ids (a list, a list of lists of different lengths, an array)."""
    if tf.is_tensor(inputs):
        return inputs
    try:
        return tf.convert_to_tensor(inputs)
    except (TypeError, ValueError):
        return tf.ragged.constant(inputs)


# Registered under its earlier name, so that .keras files holding it load.
@keras.saving.register_keras_serializable(package="txl_tf", name="TransformerXLTokenizer")
class GraphTokenizer(keras.layers.Layer):
    """Text <-> token ids of a Transformer-XL vocabulary (char or word level), in the TensorFlow graph.

    `call` (the layer's `__call__`) is `tokenize`. A scalar string gives a dense int tensor [T]; a batch of
    strings [N] gives a `tf.RaggedTensor` [N, (T)]. `detokenize` is the inverse: ids [T] give a scalar string,
    ids [N, (T)] (ragged, or dense without padding) give strings [N].

    Args:
      vocabulary: a `txl_tf.data.vocab.Vocab`, or its `to_json()` dict (the form `get_config` stores).
      dtype: the ids' integer dtype ("int32", the default, or "int64").
      **kwargs: Keras layer arguments (name, ...).

    Example:

    >>> from txl_tf.data.vocab import Vocab
    >>> vocab = Vocab(["<eos>", "the", "cat", "<unk>"], "word", eos="<eos>", unk="<unk>")
    >>> tokenizer = GraphTokenizer(vocab)
    >>> tokenizer(["the cat\\n", "the dog"]).to_list()
    [[1, 2, 0], [1, 3]]
    >>> tokenizer.detokenize([[1, 2, 0], [1, 3]]).numpy().tolist()
    [b'the cat\\n', b'the <unk>']
    """

    def __init__(self, vocabulary: Union[Vocab, dict], dtype="int32", **kwargs):
        if isinstance(vocabulary, dict):
            vocabulary = Vocab.from_json(vocabulary, where="the tokenizer's vocabulary")
        if not isinstance(vocabulary, Vocab):
            raise ConfigError(f"vocabulary must be a txl_tf Vocab or its to_json() dict, got "
                              f"{type(vocabulary).__name__}; use GraphTokenizer.from_data_dir(DIR) or "
                              "from_vocab_file(PATH)")
        super().__init__(dtype=dtype, **kwargs)
        if self.compute_dtype not in ("int32", "int64"):
            raise ConfigError(f"the tokenizer's dtype must be int32 or int64, got {self.compute_dtype}; "
                              "leave dtype out for int32")
        self._vocab = vocabulary
        self._tokenizer = TFTokenizer(vocabulary)
        self.built = True  # no weights: the lookup tables come from the vocabulary

    # ---- constructors ---------------------------------------------------------------------------------
    @classmethod
    def from_vocab(cls, vocab: Vocab, **kwargs) -> GraphTokenizer:
        """The tokenizer of a `Vocab`."""
        return cls(vocab, **kwargs)

    @classmethod
    def from_vocab_file(cls, path: str, **kwargs) -> GraphTokenizer:
        """The tokenizer of a vocabulary file (`vocab.json`, as `python -m txl_tf.data.prepare` writes it)."""
        return cls(Vocab.load(path), **kwargs)

    @classmethod
    def from_data_dir(cls, data_dir: str, **kwargs) -> GraphTokenizer:
        """The tokenizer of a prepared data directory (its vocabulary, checked against its metadata)."""
        from txl_tf.data.pipeline import load_vocab

        return cls(load_vocab(data_dir), **kwargs)

    # ---- the vocabulary -------------------------------------------------------------------------------
    @property
    def vocab(self) -> Vocab:
        """The `Vocab` (its Python `encode`/`decode` give the same ids and text as this layer)."""
        return self._vocab

    @property
    def level(self) -> str:
        """The vocabulary's level: "char" or "word"."""
        return self._vocab.level

    def vocabulary_size(self) -> int:
        """The number of ids."""
        return len(self._vocab)

    def get_vocabulary(self) -> list:
        """Every token in id order (words, or byte values 0..255 at char level)."""
        return list(self._vocab.symbols)

    def id_to_token(self, id: int) -> Union[str, int]:
        """The token of one id: a word, or at char level its byte value (0..255)."""
        if not 0 <= int(id) < len(self._vocab):
            raise ConfigError(f"id {id} is out of range for the {self.level}-level vocabulary of "
                              f"{len(self._vocab)} symbols; give an id in [0, {len(self._vocab)})")
        return self._vocab.symbols[int(id)]

    def token_to_id(self, token: Union[str, bytes, int]) -> int:
        """The id of one token: a word (the unknown-word id if the vocabulary has one), or at char level a byte
        value or a one-byte string."""
        if self.level == "char" and isinstance(token, (str, bytes)):
            data = token.encode("utf-8") if isinstance(token, str) else token
            if len(data) != 1:
                raise ConfigError(f"token {token!r} is {len(data)} bytes in UTF-8; a char-level vocabulary's "
                                  "tokens are single bytes: give one byte or a byte value 0..255")
            token = data[0]
        try:
            return self._vocab.id_of(token)
        except KeyError as error:
            raise ConfigError(f"{error.args[0]}; give a token of get_vocabulary()") from None

    # ---- text <-> ids ---------------------------------------------------------------------------------
    def tokenize(self, inputs):
        """Text -> ids: a string -> int [T]; strings [N] -> `tf.RaggedTensor` int [N, (T)].

        Equal to `Vocab.encode` of each string. An unknown symbol in a vocabulary without an unknown-word
        symbol raises InvalidArgumentError.
        """
        strings = _as_strings(inputs)
        rank = strings.shape.rank
        if rank == 0:
            ids = self._tokenizer.tf_encode(tf.reshape(strings, [1]))[0]
        elif rank in (1, None):
            ids = self._tokenizer.tf_encode(strings)
        else:
            raise ConfigError(f"tokenize takes a string or a batch of strings [N], got shape {strings.shape}; "
                              "flatten the batch first")
        return tf.cast(ids, self.compute_dtype)

    def detokenize(self, inputs):
        """Ids -> text: ids [T] -> a string; ids [N, (T)] (ragged, or dense without padding) -> strings [N].

        Equal to `Vocab.decode` of each row (its UTF-8 bytes). An id outside the vocabulary raises
        InvalidArgumentError.
        """
        ids = _as_ids(inputs)
        if isinstance(ids, tf.RaggedTensor):
            if ids.shape.rank != 2:
                raise ConfigError(f"detokenize takes ids [T] or [N, (T)], got a ragged tensor of shape {ids.shape}")
            return self._tokenizer.tf_decode(ids)
        if not ids.dtype.is_integer:
            raise ConfigError(f"detokenize takes integer ids, got {ids.dtype.name}; pass token ids")
        if ids.shape.rank == 1:
            return self._tokenizer.tf_decode(tf.RaggedTensor.from_tensor(ids[tf.newaxis]))[0]
        if ids.shape.rank == 2:
            return self._tokenizer.tf_decode(tf.RaggedTensor.from_tensor(ids))
        raise ConfigError(f"detokenize takes ids [T] or [N, (T)], got shape {ids.shape}")

    # ---- the Keras layer contract ---------------------------------------------------------------------
    def __call__(self, inputs, *args, **kwargs):
        # Keras takes only tensors positionally: text (str, list) becomes a string tensor first.
        return super().__call__(_as_strings(inputs), *args, **kwargs)

    def call(self, inputs):
        return self.tokenize(inputs)

    def get_config(self) -> dict:
        return {**super().get_config(), "vocabulary": self._vocab.to_json()}
