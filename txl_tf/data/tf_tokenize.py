"""Tokenisation inside TensorFlow, giving the same ids as `Vocab.encode` (so a SavedModel can take text).

Word level: lines split on "\\n" (`tf.strings.split`), words by tensorflow-text's `WhitespaceTokenizer`, ids by a
`tf.lookup.StaticHashTable`; start/end symbols added per line with ragged ops. Char level: bytes split with
`tf.strings.bytes_split` and mapped through a 256-entry lookup table.

Decoding (`tf_decode`, equal to `Vocab.decode`) gathers each id's symbol and joins a row with
`tf.strings.reduce_join`: char level bytes, then invalid UTF-8 replaced by U+FFFD as Python's
`decode(errors="replace")` does; word level the line convention undone with vectorised ragged ops (see
`_decode_words`).
"""

from __future__ import annotations

import tensorflow as tf

from txl_tf.data.vocab import Vocab

_UNKNOWN = -1
_DROPPED = -2


class TFTokenizer(tf.Module):
    """`tf_encode(strings [N]) -> tf.RaggedTensor int32 [N, (T)]`, equal to `[vocab.encode(s) for s in strings]`.

    Unknown symbols (where the vocabulary has no unk) raise InvalidArgumentError. The lookup tables are tracked,
    so the tokenizer can live inside a SavedModel. `tf_decode(ids [N, (T)]) -> strings [N]` is the inverse, equal
    to `[vocab.decode(row) for row in ids]`; `txl_tf.lm.tokenizer.TransformerXLTokenizer` is the Keras layer around
    both.

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
            self._symbol_strings = tf.constant([bytes([b]) for b in vocab.symbols], tf.string)  # id -> its byte
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
            self._symbol_strings = tf.constant(vocab.symbols, tf.string)  # id -> word

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string)], autograph=False)
    def tf_encode(self, strings: tf.Tensor) -> tf.RaggedTensor:
        """strings [N] -> ids [N, (T)] int32."""
        ids = self._encode_chars(strings) if self.level == "char" else self._encode_words(strings)
        tf.debugging.assert_non_negative(
            ids.flat_values, message="text has a symbol that is not in the vocabulary (and it has no unk)")
        return ids

    def __call__(self, strings) -> tf.RaggedTensor:
        return self.tf_encode(tf.convert_to_tensor(strings, tf.string))

    def tf_decode(self, ids: tf.RaggedTensor) -> tf.Tensor:
        """ids [N, (T)] (any integer type) -> strings [N], equal to `[vocab.decode(row) for row in ids]`.

        Graph ops only (usable in tf.function and tf.data). An id outside the vocabulary raises
        InvalidArgumentError.
        """
        wide = tf.cast(ids.flat_values, tf.int64)
        message = f"an id is out of range for the vocabulary of {self.vocab_size} symbols"
        checks = [tf.debugging.assert_non_negative(wide, message=message),
                  tf.debugging.assert_less(wide, tf.constant(self.vocab_size, tf.int64), message=message)]
        with tf.control_dependencies(checks):  # before the gather, whose own error names no vocabulary
            flat = tf.cast(wide, tf.int32)
        ids = ids.with_flat_values(flat)
        if self.level == "char":
            text = tf.strings.reduce_join(ids.with_flat_values(tf.gather(self._symbol_strings, flat)), axis=1)
            return tf.strings.unicode_transcode(text, "UTF-8", "UTF-8", errors="replace", replacement_char=0xFFFD,
                                                replace_control_characters=False)
        return tf.strings.reduce_join(self._decode_words(ids), axis=1)

    def _decode_words(self, ids):
        """ids [N, (T)] -> pieces [N, (T)] whose concatenation per row is `Vocab.decode`'s text.

        A token is an opener (a start symbol while its line is empty: dropped), a closer (the end symbol: "\\n")
        or a word (its text, after a space when the token before it in the row is a word). When start and end
        are one symbol (lm1b's `<S>`), a run of them alternates opener and closer, starting with a closer when
        a word comes before the run and with an opener at the start of a row.
        """
        flat = ids.flat_values
        col = tf.ragged.range(ids.row_lengths(), dtype=ids.row_splits.dtype).flat_values  # position in its row
        first = tf.equal(col, 0)

        def before(x, fill):  # the value of the previous token of the same row; `fill` at a row's start
            return tf.where(first, fill, tf.concat([[fill], x[:-1]], 0))

        none = tf.zeros_like(flat, tf.bool)
        is_bos = tf.equal(flat, self._bos) if self._bos is not None else none
        is_eos = tf.equal(flat, self._eos) if self._eos is not None else none
        if self._bos is not None and self._bos == self._eos:
            prev_s = before(is_eos, False)
            run_start = tf.logical_and(is_eos, tf.logical_not(prev_s))
            starts_col = tf.boolean_mask(col, run_start)  # [runs] column of each run's first token
            run = tf.maximum(tf.cumsum(tf.cast(run_start, tf.int32)) - 1, 0)
            start_col = tf.gather(tf.concat([starts_col, [0]], 0), run)  # (padded: no run at all)
            offset = tf.cast(start_col > 0, col.dtype)  # 1: a word comes before the run
            closer = tf.logical_and(is_eos, tf.equal((col - start_col + offset) % 2, 1))
            opener = tf.logical_and(is_eos, tf.logical_not(closer))
        else:
            open_before = tf.logical_not(tf.logical_or(first, before(is_eos, False)))
            opener = tf.logical_and(is_bos, tf.logical_not(open_before))
            closer = is_eos
        word = tf.logical_not(tf.logical_or(opener, closer))
        text = tf.gather(self._symbol_strings, flat)
        text = tf.where(before(word, False), tf.strings.join([" ", text]), text)
        pieces = tf.where(closer, "\n", tf.where(opener, "", text))
        return ids.with_flat_values(pieces)

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
