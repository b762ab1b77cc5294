"""Export a trained TransformerXL as a SavedModel whose signatures carry the memory.

    python -m txl_tf.export --model_dir=runs/sample --export_dir=exports/sample

The SavedModel is a `tf.Module` holding the Keras model, the in-graph tokenizer (tensorflow-text for words,
a byte table for characters) and the vocabulary file as an asset (`assets/vocab.json`). It loads with
`tf.saved_model.load(dir)` in a process that imports only `tensorflow` and `tensorflow_text`.

The model's recurrent state travels through the signatures as named tensors: the keys/values cache (`keys`,
`values` [n_layer, N, B, M, D] and, for attn_type xl and shaw, `position_keys` [n_layer, N, P, D]), or for the
models a cache cannot serve (pre_lnorm with vaswani / al_rfou) the hidden memory `mems` [n_layer, B, M, d]. Take
the state from `initial_state`, pass each tensor back by its name and replace it with the output of the same
name. It is in the model's compute dtype (float32, or bfloat16 for a mixed_bfloat16 export). In Python these are
the `named()` tensors of a `txl_tf.model.state` value (`txl_tf.model.state.from_named` turns them back). Shapes: B batch,
L tokens (at most `max_len`, the exported EvalConfig.tgt_len), M = mem_len, V = vocabulary size.

    initial_state      batch_size int32 [] -> the state of a zero memory
    next_token_logits  tokens int32 [B, L], lengths int32 [B], state -> logits float32 [B, V] (log-probabilities
                       of the token after position lengths[b] - 1 of each row), state. Positions past a row's
                       length are padding: they do not enter its state (prompts of different lengths). Every
                       length is in [1, L]: a row has at least one token.
    generate           token_ids int32 [B, T], padding_mask int32 [B, T] (1 over each row's prompt, then 0: right
                       padding; every row >= 1 token), seed int32 [], temperature float32 [] (finite, >= 0; 0:
                       greedy), top_k int32 [] (0 to V; 0: all), top_p float32 [] (in (0, 1]; 1: all) ->
                       token_ids int32 [B, T]: each prompt followed by sampled tokens up to T. No state in or out:
                       `txl_tf.lm.generation.Generator` (keras-hub's loop over the prompt's state), the function
                       Python and `python -m txl_tf.generate` run: the same seed gives the same tokens.
    score              tokens int32 [B, L], targets int32 [B, L], state -> nll float32 [B, L], state
    score_text         text string [B], state -> tokens int32 [B, T] (0-padded), lengths int32 [B],
                       nll float32 [B, T - 1] (nll[b, t] of tokens[b, t + 1]; 0 past the row's length), state
                       (each row's own: padding never enters it). Any T >= 2: scored in segments of max_len.

Token ids (tokens, targets) are in [0, V), and the state's batch is that of the first argument (take it from
initial_state(B)). A call outside these ranges fails with tf.errors.InvalidArgumentError naming the argument
(e.g. "lengths: the count of each row must be in [1, L]"), on every device (a GPU's gather would not refuse an id).

Plain attributes: `mem_len`, `clamp_len`, `same_length`, `max_len` (tf.Variables, read with .numpy()).

The evaluation protocol (mem_len, clamp_len, same_length of EvalConfig) and max_len (EvalConfig.tgt_len) are
fixed at export time; override them with --gin_param, e.g. --gin_param='EvalConfig.mem_len=800'.
"""

from __future__ import annotations

import os

# First: txl_tf.base.cli quiets TensorFlow's start-up (it must come before TensorFlow's import).
from txl_tf.base import cli

# isort: split
import tensorflow as tf
from absl import flags

from txl_tf.base import paths
from txl_tf.configs import architecture
from txl_tf.lm import generation
from txl_tf.model.inference import Recurrent
from txl_tf.model.protocol import Protocol
from txl_tf.model.state import from_named
from txl_tf.runs import loading, run_dir

SIGNATURES = ("initial_state", "next_token_logits", "generate", "score", "score_text")


class TransformerXLServing(tf.Module):
    """A tf.Module with the serving functions of a TransformerXL (see the module docstring).

    Args:
      model: a built TransformerXL (weights restored). It is not changed.
      protocol: the attention lengths fixed into the exported functions.
      max_len: the longest segment a call may pass (score_text cuts texts into segments of it).
      tokenizer: an optional tf.Module with `tf_encode(strings [N]) -> ragged int32 [N, (T)]` (score_text).
      vocab_file: an optional vocabulary file stored as an asset.
    """

    def __init__(self, model, *, protocol: Protocol, max_len: int, tokenizer=None, vocab_file: str | None = None):
        super().__init__(name="transformer_xl_serving")
        self.model = model
        self.recurrent = Recurrent(model, protocol, max_len=max_len)
        self.mem_len = tf.Variable(protocol.mem_len, trainable=False, name="mem_len")
        self.clamp_len = tf.Variable(protocol.clamp_len, trainable=False, name="clamp_len")
        self.same_length = tf.Variable(protocol.same_length, trainable=False, name="same_length")
        self.max_len = tf.Variable(int(max_len), trainable=False, name="max_len")
        self.tokenizer = tokenizer
        self.vocab_asset = tf.saved_model.Asset(vocab_file) if vocab_file else None
        state_specs = self.recurrent.initial_state(1).named_specs()  # any batch size
        self.state_names = tuple(state_specs)
        tokens = tf.TensorSpec([None, None], tf.int32, name="tokens")
        lengths = tf.TensorSpec([None], tf.int32, name="lengths")
        self.initial_state = tf.function(self._initial_state, input_signature=[
            tf.TensorSpec([], tf.int32, name="batch_size")])
        # Keyword-only state arguments: tf.function signatures of one dict argument would name its tensors
        # state, state_1, ...; a wrapper per signature keeps the names "keys", "values", ...
        self.next_token_logits = tf.function(
            self._with_state(self._next_token_logits, 2, "tokens"),
            input_signature=[tokens, lengths, *state_specs.values()])
        scalar = lambda dtype, name: tf.TensorSpec([], dtype, name=name)  # noqa: E731
        self.generator = generation.generator(model, protocol, max_len)
        self.generate = tf.function(self._generate, input_signature=[
            tf.TensorSpec([None, None], tf.int32, name="token_ids"),
            tf.TensorSpec([None, None], tf.int32, name="padding_mask"), scalar(tf.int32, "seed"),
            scalar(tf.float32, "temperature"), scalar(tf.int32, "top_k"), scalar(tf.float32, "top_p")])
        self.score = tf.function(self._with_state(self._score, 2, "tokens"), input_signature=[
            tokens, tf.TensorSpec([None, None], tf.int32, name="targets"), *state_specs.values()])
        if tokenizer is not None:
            self.score_text = tf.function(self._with_state(self._score_text, 1, "text"), input_signature=[
                tf.TensorSpec([None], tf.string, name="text"), *state_specs.values()])

    def _with_state(self, fn, leading: int, batch_from: str):
        """fn(*leading args, state) -> outputs dict, as a function of positional tensors (signature order).

        The state's batch must be that of the first argument (named `batch_from`): a state of another batch size
        would otherwise fail deep in the model (ConcatOp ...).
        """
        names = self.state_names

        def wrapped(*args):
            state = from_named(dict(zip(names, args[leading:], strict=True)))
            batch = tf.shape(args[0])[0]
            checks = [tf.debugging.assert_equal(
                size, batch,
                message=f"state {name}: its batch axis must match the batch size of {batch_from} (pass the state of "
                        f"initial_state(batch_size=B) or of an earlier call with the same B rows)")
                for name, size in state.named_batch_sizes().items()]
            inputs, state = _after(checks, args[:leading], state)
            outputs, new_state = fn(*inputs, state)
            return {**outputs, **new_state.named()}

        return wrapped

    def _check_ids(self, ids, name: str) -> list:
        """Assertions that every id of `ids` is in the vocabulary: a CPU gather refuses another id but a GPU's
        returns zeros (and the loss of a GPU a NaN), silently."""
        n_token = self.model.n_token
        message = f"{name}: every token id must be in [0, n_token) = [0, {n_token})"
        return [tf.debugging.assert_non_negative(ids, message=message),
                tf.debugging.assert_less(ids, tf.constant(n_token, ids.dtype), message=message)]

    def _initial_state(self, batch_size):
        return self.recurrent.initial_state(batch_size).named()

    # The uncompiled forms of Recurrent's calls: each signature is then one flat graph, with no nested function
    # call to instantiate for every token.
    def _next_token_logits(self, tokens, lengths, state):
        # A length outside [1, L] would pick the logits of a padding position (lengths 0 or less: position 0).
        checks = self._check_ids(tokens, "tokens") + [
            tf.debugging.assert_equal(tf.shape(lengths)[0], tf.shape(tokens)[0],
                                      message="lengths: one count per row of tokens (shape [B])"),
            tf.debugging.assert_positive(lengths, message="lengths: the count of each row must be in [1, L] "
                                         "(L = tokens.shape[1]); a row needs at least one token"),
            tf.debugging.assert_less_equal(lengths, tf.shape(tokens)[1], message="lengths: the count of each row "
                                           "must be in [1, L] (L = tokens.shape[1])")]
        tokens, lengths = _after(checks, tokens, lengths)
        log_probs, state = self.recurrent.next_log_probs.python_function(tokens, state, lengths)  # [B, V]
        return {"logits": tf.cast(log_probs, tf.float32)}, state

    def _generate(self, token_ids, padding_mask, seed, temperature, top_k, top_p):
        return {"token_ids": self.generator.generate(token_ids, padding_mask, seed, temperature, top_k, top_p)}

    def _score(self, tokens, targets, state):
        checks = self._check_ids(tokens, "tokens") + self._check_ids(targets, "targets") + [
            tf.debugging.assert_equal(tf.shape(targets), tf.shape(tokens),
                                      message="targets: must have the shape of tokens [B, L]")]
        tokens, targets = _after(checks, tokens, targets)
        nll, state = self.recurrent.score.python_function(tokens, targets, state)
        return {"nll": tf.cast(nll, tf.float32)}, state

    def _score_text(self, text, state):
        ragged = self.tokenizer.tf_encode(text)  # [B, (T)]
        lengths = tf.cast(ragged.row_lengths(), tf.int32)  # [B]
        tokens = ragged.to_tensor(default_value=0)  # [B, T]
        # Checked before anything reads the tokens: with fewer than two, the segment loop fails first, in
        # TensorFlow's words.
        checks = self._check_ids(tokens, "text (the ids of its tokens)") + [tf.debugging.assert_greater(
            tf.shape(tokens)[1], 1, message="text: score_text needs texts of at least two tokens (the longest "
                                            "text of the batch has fewer)")]
        tokens, lengths, state = _after(checks, tokens, lengths, state)
        predictions = tf.shape(tokens)[1] - 1  # T - 1
        segment = tf.cast(self.max_len, tf.int32)
        pieces = tf.TensorArray(tf.float32, size=0, dynamic_size=True, infer_shape=False,
                                element_shape=tf.TensorShape([None, None]))
        for index in tf.range((predictions + segment - 1) // segment):
            start = index * segment
            end = tf.minimum(start + segment, predictions)
            counts = tf.clip_by_value(lengths - 1 - start, 0, end - start)  # each row's predictions in it
            hidden, state = self.recurrent.forward(tokens[:, start:end], state, counts)
            nll = self.model.nll(hidden, tokens[:, start + 1:end + 1])  # [B, l]
            pieces = pieces.write(index, tf.transpose(tf.cast(nll, tf.float32)))  # [l, B]
        nll = tf.transpose(pieces.concat())  # [B, T - 1]
        valid = tf.sequence_mask(lengths - 1, predictions, dtype=tf.float32)
        return {"tokens": tokens, "lengths": lengths, "nll": nll * valid}, state

    def signatures(self) -> dict:
        names = SIGNATURES if self.tokenizer is not None else tuple(s for s in SIGNATURES if s != "score_text")
        return {name: getattr(self, name).get_concrete_function() for name in names}


def _after(checks, *structures):
    """The tensors of `structures` (tensors, tuples, dicts) behind the assertions `checks`: no op that reads them
    runs before every check has passed. tf.function runs an assertion but not before the ops beside it."""
    with tf.control_dependencies(checks):
        return tf.nest.map_structure(tf.identity, structures if len(structures) > 1 else structures[0])


def export_model(model, export_dir: str, *, protocol: Protocol, max_len: int, vocab=None,
                 vocab_file: str | None = None) -> TransformerXLServing:
    """Writes the SavedModel into `export_dir` (a new or empty folder; `write_export` replaces one whole); `vocab`
    (a txl_tf Vocab) adds the in-graph tokenizer and `score_text`."""
    export_dir = check_export_dir(export_dir, overwrite=False)
    tokenizer = None
    if vocab is not None:
        from txl_tf.data.tf_tokenize import TFTokenizer

        tokenizer = TFTokenizer(vocab)
    module = TransformerXLServing(model, protocol=protocol, max_len=max_len, tokenizer=tokenizer,
                                  vocab_file=vocab_file)
    signatures = module.signatures()
    tf.saved_model.save(module, export_dir, signatures=signatures)
    # The model's sizes, read by `python -m txl_tf.generate --saved_model` to bound its lengths before it loads.
    run_dir.record_architecture(os.path.join(export_dir, "assets"), architecture(model))
    return module


KIND = "export"  # the kind of output in the folder's manifest (txl_tf.base.paths)


def check_export_dir(export_dir: str, overwrite: bool) -> str:
    """`export_dir` if it may receive the export: a new or empty folder, or (with `overwrite`) one holding only an
    export this program wrote (`txl_tf.base.paths.replaceable_dir`); one line otherwise."""
    return paths.replaceable_dir(export_dir, "--export_dir", kind=KIND, overwrite=overwrite)


def write_export(module_fn, export_dir: str, overwrite: bool = False) -> None:
    """Writes the SavedModel with `module_fn(tmp_dir)` into a sibling directory, then swaps it in (no mixing); an
    existing export is replaced only with `overwrite` (checked again under the write's claim)."""
    from txl_tf.base.staging import staged_dir

    with staged_dir(export_dir, kind=KIND, name="--export_dir", overwrite=overwrite) as tmp:
        module_fn(tmp)


def define_flags(flag_values) -> None:
    cli.define_model_flags(flag_values)
    flags.DEFINE_string("export_dir", None, "Where to write the SavedModel (a new or empty directory, or one "
                        "holding an export with --overwrite).", flag_values=flag_values)
    flags.DEFINE_bool("overwrite", False, "Replace an existing export in --export_dir (never another directory).",
                      flag_values=flag_values)
    flags.mark_flag_as_required("export_dir", flag_values=flag_values)


def main(argv):
    from txl_tf.base.staging import remove_stale
    from txl_tf.data.pipeline import load_vocab
    from txl_tf.data.vocab import VOCAB_FILE

    cli.no_arguments(argv)
    cfg = flags.FLAGS
    paths.output_dir(cfg.export_dir, "--export_dir")
    remove_stale(cfg.export_dir)  # a killed export's staging directories (puts back one it was replacing)
    check_export_dir(cfg.export_dir, cfg.overwrite)  # before the model is loaded
    model, configs, prefix = loading.load_model_from_flags(cfg)
    protocol = configs.eval
    vocab, vocab_file = None, None
    data_dir = configs.data.data_dir
    if data_dir and os.path.exists(os.path.join(data_dir, VOCAB_FILE)):
        vocab, vocab_file = load_vocab(data_dir), os.path.join(data_dir, VOCAB_FILE)
    else:
        print(f"warning: no vocabulary at {data_dir!r}; exporting without score_text")
    write_export(lambda directory: export_model(
        model, directory, protocol=protocol.attention_protocol(), max_len=protocol.tgt_len, vocab=vocab,
        vocab_file=vocab_file), cfg.export_dir, cfg.overwrite)
    print(f"exported {prefix} to {cfg.export_dir} (mem_len={protocol.mem_len}, clamp_len={protocol.clamp_len}, "
          f"same_length={protocol.same_length}, max_len={protocol.tgt_len}); inspect with: saved_model_cli show "
          f"--all --dir {cfg.export_dir}")


if __name__ == "__main__":
    cli.run(main, define_flags)
