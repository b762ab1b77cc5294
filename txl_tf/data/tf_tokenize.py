"""Tokenisation inside TensorFlow, giving the same ids as `Vocab.encode` (so a SavedModel can take text).

Word level: lines split on "\\n" (`tf.strings.split`), words by tensorflow-text's `WhitespaceTokenizer`, ids by a
`tf.lookup.StaticHashTable`; start/end symbols added per line with ragged ops. Char level: bytes split with
`tf.strings.bytes_split` and mapped through a 256-entry lookup table.
"""

from __future__ import annotations

import tensorflow as tf

from txl_tf.data.vocab import Vocab

_UNKNOWN = -1
_DROPPED = -2


class TFTokenizer(tf.Module):
    """`tf_encode(strings [N]) -> tf.RaggedTensor int32 [N, (T)]`, equal to `[vocab.encode(s) for s in strings]`.

    Unknown symbols (where the vocabulary has no unk) raise InvalidArgumentError. The lookup tables are tracked,
    so the tokenizer can live inside a SavedModel.

    Args:
      vocab: the `Vocab` to reproduce.
    """

    def __init__(self, vocab: Vocab, name: str = "tokenizer"):
        super().__init__(name=name)
        self.level = vocab.level
        self.vocab_size = len(vocab)
        if vocab.level == "char":
            table = vocab._byte_to_id  # -1 unknown, -2 dropped
            self._byte_table = tf.constant(table, tf.int32)  # [256]
        else:
            import tensorflow_text as tf_text

            self._words = tf_text.WhitespaceTokenizer()
            default = vocab.id_of(vocab.unk) if vocab.unk is not None else _UNKNOWN
            init = tf.lookup.KeyValueTensorInitializer(
                tf.constant(vocab.symbols, tf.string), tf.range(len(vocab), dtype=tf.int64)
            )
            self._table = tf.lookup.StaticHashTable(init, default_value=tf.constant(default, tf.int64))
            self._bos = vocab.id_of(vocab.bos) if vocab.bos is not None else None
            self._eos = vocab.id_of(vocab.eos) if vocab.eos is not None else None

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string)], autograph=False)
    def tf_encode(self, strings: tf.Tensor) -> tf.RaggedTensor:
        """strings [N] -> ids [N, (T)] int32."""
        ids = self._encode_chars(strings) if self.level == "char" else self._encode_words(strings)
        tf.debugging.assert_non_negative(
            ids.flat_values, message="text has a symbol that is not in the vocabulary (and it has no unk)")
        return ids

    def __call__(self, strings) -> tf.RaggedTensor:
        return self.tf_encode(tf.convert_to_tensor(strings, tf.string))

    def _encode_chars(self, strings):
        chars = tf.strings.bytes_split(strings)  # [N, (T)] one-byte strings
        byte_values = tf.reshape(tf.io.decode_raw(chars.flat_values, tf.uint8), [-1])  # [sum T]
        ids = chars.with_flat_values(tf.gather(self._byte_table, tf.cast(byte_values, tf.int32)))
        return tf.ragged.boolean_mask(ids, tf.not_equal(ids, _DROPPED))

    def _encode_words(self, strings):
        lines = tf.strings.split(strings, sep="\n")  # [N, (lines)]
        words = self._words.tokenize(lines)  # [N, (lines), (W)]
        ids = tf.ragged.map_flat_values(
            lambda w: tf.cast(self._table.lookup(w), tf.int32), words)  # [N, (lines), (W)]
        # Every line but the last is complete: it gets bos and eos. The last gets bos only if it has words.
        n_lines = lines.row_lengths()  # [N]
        line_pos = tf.ragged.range(n_lines)  # [N, (lines)]
        is_last = tf.equal(line_pos, tf.expand_dims(n_lines - 1, 1))
        has_words = tf.ragged.map_flat_values(tf.greater, words.row_lengths(axis=2), 0)
        pieces, keep = [], []
        line_ones = tf.ragged.map_flat_values(lambda x: tf.ones_like(x, tf.int32), line_pos)  # [N, (lines)]

        def column(value):  # [N, (lines), 1] filled with `value`
            return tf.expand_dims(line_ones * value, axis=2)

        def flag(mask):  # bool [N, (lines)] -> [N, (lines), 1]
            return tf.expand_dims(mask, axis=2)

        if self._bos is not None:
            pieces.append(column(self._bos))
            keep.append(flag(tf.logical_or(tf.logical_not(is_last), has_words)))
        pieces.append(ids)
        keep.append(tf.ragged.map_flat_values(lambda x: tf.ones_like(x, tf.bool), ids))
        if self._eos is not None:
            pieces.append(column(self._eos))
            keep.append(flag(tf.logical_not(is_last)))
        tokens = tf.concat(pieces, axis=2).merge_dims(1, 2)  # [N, (T')]
        mask = tf.concat(keep, axis=2).merge_dims(1, 2)
        return tf.ragged.boolean_mask(tokens, mask)
