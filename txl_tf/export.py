"""Export a trained TransformerXL as a SavedModel whose signatures carry the memory.

    python -m txl_tf.export --model_dir=runs/sample --export_dir=exports/sample

The SavedModel is a `tf.Module` holding the Keras model, the in-graph tokenizer (tensorflow-text for words,
a byte table for characters) and the vocabulary file as an asset (`assets/vocab.json`). It loads with
`tf.saved_model.load(dir)` in a process that imports only `tensorflow` and `tensorflow_text`.

Signatures (n_layer layers, B batch, L tokens, M = the exported mem_len, D = d_model, V = vocabulary size;
`mems` is always float32 [n_layer, B, M, D]; start from `initial_mems` or zeros):

    score              tokens int32 [B, L], targets int32 [B, L], mems -> nll float32 [B, L], new_mems
    next_token_logits  tokens int32 [B, L], mems -> logits float32 [B, V] (log-probabilities of the token
                       after the last position), new_mems
    score_text         text string [B], mems -> tokens int32 [B, T] (0-padded), lengths int32 [B],
                       nll float32 [B, T - 1] (nll[b, t] of tokens[b, t + 1]; 0 past the row's length),
                       new_mems (meaningful for rows of full length T)
    initial_mems       batch_size int32 [] -> mems float32 [n_layer, B, M, D] (zeros)

The evaluation protocol (mem_len, clamp_len, same_length of EvalConfig) is baked in at export time; override
it with --gin_param, e.g. --gin_param='EvalConfig.mem_len=800'.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import tensorflow as tf  # noqa: E402

SIGNATURES = ("score", "next_token_logits", "score_text", "initial_mems")


class TransformerXLServing(tf.Module):
    """A tf.Module with the serving functions of a TransformerXL (see the module docstring).

    Args:
      model: a built TransformerXL (weights restored).
      mem_len, clamp_len, same_length: the attention protocol fixed into the exported functions.
      tokenizer: an optional tf.Module with `tf_encode(strings [N]) -> ragged int32 [N, (T)]` (score_text).
      vocab_file: an optional vocabulary file stored as an asset.
    """

    def __init__(self, model, *, mem_len: int, clamp_len: int = -1, same_length: bool = False,
                 tokenizer=None, vocab_file: str | None = None):
        super().__init__(name="transformer_xl_serving")
        self.model = model
        model.mem_len, model.clamp_len, model.same_length = int(mem_len), int(clamp_len), bool(same_length)
        self.mem_len = int(mem_len)
        self.n_layer = int(model.n_layer)
        self.d_model = int(model.d_model)
        self.tokenizer = tokenizer
        self.vocab_asset = tf.saved_model.Asset(vocab_file) if vocab_file else None
        tokens = tf.TensorSpec([None, None], tf.int32, name="tokens")
        mems = tf.TensorSpec([self.n_layer, None, self.mem_len, self.d_model], tf.float32, name="mems")
        self.score = tf.function(self._score, input_signature=[
            tokens, tf.TensorSpec([None, None], tf.int32, name="targets"), mems])
        self.next_token_logits = tf.function(self._next_token_logits, input_signature=[tokens, mems])
        self.initial_mems = tf.function(self._initial_mems, input_signature=[
            tf.TensorSpec([], tf.int32, name="batch_size")])
        if tokenizer is not None:
            self.score_text = tf.function(self._score_text, input_signature=[
                tf.TensorSpec([None], tf.string, name="text"), mems])

    def _forward(self, tokens, mems):
        mems = tf.cast(mems, self.model.compute_dtype)
        hidden, new_mems = self.model(tokens, mems=mems, training=False)  # [B, L, D]
        new_mems = tf.ensure_shape(tf.cast(new_mems, tf.float32), [self.n_layer, None, self.mem_len, self.d_model])
        return hidden, new_mems

    def _score(self, tokens, targets, mems):
        hidden, new_mems = self._forward(tokens, mems)
        return {"nll": tf.cast(self.model.nll(hidden, targets), tf.float32), "new_mems": new_mems}

    def _next_token_logits(self, tokens, mems):
        hidden, new_mems = self._forward(tokens, mems)
        logits = self.model.log_probs(hidden[:, -1:])[:, 0]  # [B, V]
        return {"logits": tf.cast(logits, tf.float32), "new_mems": new_mems}

    def _initial_mems(self, batch_size):
        return {"mems": tf.zeros([self.n_layer, batch_size, self.mem_len, self.d_model], tf.float32)}

    def _score_text(self, text, mems):
        ragged = self.tokenizer.tf_encode(text)  # [B, (T)]
        lengths = tf.cast(ragged.row_lengths(), tf.int32)  # [B]
        tokens = ragged.to_tensor(default_value=0)  # [B, T]
        tf.debugging.assert_greater(tf.shape(tokens)[1], 1,
                                    message="score_text needs texts of at least two tokens")
        hidden, new_mems = self._forward(tokens[:, :-1], mems)
        nll = tf.cast(self.model.nll(hidden, tokens[:, 1:]), tf.float32)  # [B, T - 1]
        valid = tf.sequence_mask(lengths - 1, tf.shape(nll)[1], dtype=tf.float32)
        return {"tokens": tokens, "lengths": lengths, "nll": nll * valid, "new_mems": new_mems}

    def signatures(self) -> dict:
        names = SIGNATURES if self.tokenizer is not None else tuple(s for s in SIGNATURES if s != "score_text")
        return {name: getattr(self, name).get_concrete_function() for name in names}


def export_model(model, export_dir: str, *, mem_len: int, clamp_len: int = -1, same_length: bool = False,
                 vocab=None, vocab_file: str | None = None) -> TransformerXLServing:
    """Writes the SavedModel; `vocab` (a txl_tf Vocab) adds the in-graph tokenizer and `score_text`."""
    tokenizer = None
    if vocab is not None:
        from txl_tf.data.vocab import tf_tokenizer

        tokenizer = tf_tokenizer(vocab)
    module = TransformerXLServing(model, mem_len=mem_len, clamp_len=clamp_len, same_length=same_length,
                                  tokenizer=tokenizer, vocab_file=vocab_file)
    signatures = module.signatures()
    tf.saved_model.save(module, export_dir, signatures=signatures)
    return module


def check_export_dir(export_dir: str, overwrite: bool) -> None:
    """Refuses an existing non-empty `export_dir` unless `overwrite`, and always one that holds no export."""
    if not os.path.exists(export_dir) or (os.path.isdir(export_dir) and not os.listdir(export_dir)):
        return
    if not os.path.isdir(export_dir):
        raise FileExistsError(f"--export_dir={export_dir} is a file, not a directory; choose another --export_dir")
    if not os.path.exists(os.path.join(export_dir, "saved_model.pb")):
        raise FileExistsError(f"--export_dir={export_dir} exists and holds no SavedModel (no saved_model.pb); it "
                              "is not replaced, even with --overwrite: choose another --export_dir")
    if not overwrite:
        raise FileExistsError(f"--export_dir={export_dir} already holds a SavedModel; pass --overwrite to replace "
                              "it or choose another --export_dir")


def write_export(module_fn, export_dir: str) -> None:
    """Writes the SavedModel with `module_fn(tmp_dir)` into a sibling directory, then swaps it in (no mixing)."""
    from txl_tf.staging import staged_dir

    with staged_dir(export_dir) as tmp:
        module_fn(tmp)


def _main(argv):
    from absl import flags

    from txl_tf import restore
    from txl_tf.data.pipeline import load_vocab
    from txl_tf.data.vocab import VOCAB_FILE
    from txl_tf.errors import ConfigError

    if len(argv) > 1:
        raise ConfigError(f"unexpected arguments {argv[1:]}; see --helpshort")
    cfg = flags.FLAGS
    check_export_dir(cfg.export_dir, cfg.overwrite)  # before the model is loaded
    model, configs, prefix = restore.load_model_from_flags(cfg)
    protocol = configs.eval
    vocab, vocab_file = None, None
    data_dir = configs.data.data_dir
    if data_dir and os.path.exists(os.path.join(data_dir, VOCAB_FILE)):
        vocab, vocab_file = load_vocab(data_dir), os.path.join(data_dir, VOCAB_FILE)
    else:
        print(f"warning: no vocabulary at {data_dir!r}; exporting without score_text")
    write_export(lambda directory: export_model(
        model, directory, mem_len=protocol.mem_len, clamp_len=protocol.clamp_len,
        same_length=protocol.same_length, vocab=vocab, vocab_file=vocab_file), cfg.export_dir)
    print(f"exported {prefix} to {cfg.export_dir} (mem_len={protocol.mem_len}, clamp_len={protocol.clamp_len}, "
          f"same_length={protocol.same_length}); inspect with: saved_model_cli show --all --dir {cfg.export_dir}")


def main():
    from absl import flags

    from txl_tf import errors, restore

    restore.define_model_flags()
    flags.DEFINE_string("export_dir", None, "Where to write the SavedModel (a new or empty directory, or one "
                        "holding an export with --overwrite).")
    flags.DEFINE_bool("overwrite", False, "Replace an existing export in --export_dir (never another directory).")
    flags.mark_flag_as_required("export_dir")
    errors.run(_main)


if __name__ == "__main__":
    main()
