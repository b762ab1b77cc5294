"""Sample text from a trained TransformerXL (a model_dir or an exported SavedModel).

    python -m txl_tf.generate --model_dir=runs/sample --prompt='The history of ' --max_tokens=300 \
        --temperature=0.8 --top_k=40 --seed=7
    python -m txl_tf.generate --saved_model=exports/sample --prompt='The history of ' --max_tokens=300

The prompt is consumed in segments of EvalConfig.tgt_len with memory; then each new token is one forward pass
of a single position over the memory (EvalConfig.mem_len long; no recomputation of the context). Sampling uses
stateless RNG: the same --seed gives the same text. Prints the text and tokens/s.

Settings are checked against the vocabulary before the model is loaded: --temperature >= 0 (0 is greedy
decoding, not an error: the most likely token each time), 0 <= --top_k <= vocabulary size, --max_tokens >= 1,
and every symbol of --prompt in the vocabulary. A bad value stops with one `error:` line (exit status 2).
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from absl import flags  # noqa: E402

from txl_tf import errors, restore  # noqa: E402
from txl_tf.errors import ConfigError  # noqa: E402

FLAGS = flags.FLAGS
restore.define_model_flags()
flags.DEFINE_string("saved_model", None, "A SavedModel written by `python -m txl_tf.export` (instead).")
flags.DEFINE_string("prompt", "The ", "Text to continue.")
flags.DEFINE_integer("max_tokens", 200, "Number of tokens to generate (>= 1).")
flags.DEFINE_float("temperature", 1.0, "Softmax temperature, >= 0: 0 = greedy (the most likely token), 1 = the "
                   "model's distribution, higher = flatter.")
flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens (0 = all; at most the vocabulary size).")
flags.DEFINE_integer("seed", 0, "Stateless sampling seed.")


def _check_flags(vocab) -> list:
    from txl_tf.generation import check_settings

    return check_settings(vocab, FLAGS.prompt, max_tokens=FLAGS.max_tokens, temperature=FLAGS.temperature,
                          top_k=FLAGS.top_k)


def _from_model_dir():
    import numpy as np

    from txl_tf import generation
    from txl_tf.data.pipeline import load_vocab

    configs = restore.parse_configs(FLAGS.model_dir, FLAGS.gin_file, FLAGS.gin_param, checkpoint=FLAGS.checkpoint)
    vocab = load_vocab(configs.data.data_dir)
    ids = _check_flags(vocab)  # before the model is built and restored
    model, configs, prefix = restore.load_model(FLAGS.model_dir, FLAGS.checkpoint, which=FLAGS.which,
                                                configs=configs)
    result = generation.generate_from_model(
        model, np.asarray([ids], np.int32), max_tokens=FLAGS.max_tokens, mem_len=configs.eval.mem_len,
        clamp_len=configs.eval.clamp_len, temperature=FLAGS.temperature, top_k=FLAGS.top_k, seed=FLAGS.seed,
        segment_len=configs.eval.tgt_len)
    return prefix, vocab, result


def _from_saved_model():
    import tensorflow as tf

    from txl_tf import generation
    from txl_tf.data.vocab import VOCAB_FILE, Vocab

    vocab_file = os.path.join(FLAGS.saved_model, "assets", VOCAB_FILE)
    if not os.path.exists(os.path.join(FLAGS.saved_model, "saved_model.pb")):
        raise ConfigError(f"--saved_model={FLAGS.saved_model} holds no SavedModel (no saved_model.pb); give a "
                          "directory written by `python -m txl_tf.export`")
    if not os.path.exists(vocab_file):
        raise ConfigError(f"{FLAGS.saved_model} has no vocabulary asset ({vocab_file}); re-export it with the "
                          "data present")
    vocab = Vocab.load(vocab_file)
    _check_flags(vocab)  # before the SavedModel is loaded
    loaded = tf.saved_model.load(FLAGS.saved_model)
    ids = loaded.tokenizer.tf_encode(tf.constant([FLAGS.prompt])).to_tensor()  # [1, P]
    mems = loaded.signatures["initial_mems"](batch_size=tf.constant(1))["mems"]
    result = generation.generate(generation.saved_model_logits_fn(loaded), ids.numpy(), mems,
                                 max_tokens=FLAGS.max_tokens, temperature=FLAGS.temperature, top_k=FLAGS.top_k,
                                 seed=FLAGS.seed)
    return FLAGS.saved_model, vocab, result


def main(argv):
    if len(argv) > 1:
        raise ConfigError(f"unexpected arguments {argv[1:]}; quote the --prompt (see --helpshort)")
    if bool(FLAGS.saved_model) == bool(FLAGS.model_dir or FLAGS.checkpoint):
        raise ConfigError("give exactly one of --model_dir (or --checkpoint with --gin_file) and --saved_model")
    source, vocab, result = _from_saved_model() if FLAGS.saved_model else _from_model_dir()
    print(f"# {source}: seed {FLAGS.seed}, temperature {FLAGS.temperature}, top_k {FLAGS.top_k}")
    continuation = vocab.decode(result.tokens[0].tolist())
    # Word level: decode joins words with spaces, so the prompt's last word and the first new one need one too.
    joiner = " " if vocab.level == "word" and FLAGS.prompt and not FLAGS.prompt[-1].isspace() and continuation \
        and not continuation[0].isspace() else ""
    print(FLAGS.prompt + joiner + continuation)
    print(f"# {result.tokens.size} tokens in {result.decode_seconds:.2f} s: {result.tokens_per_second:.1f} tokens/s "
          f"(prompt: {result.prompt_seconds:.2f} s)")


if __name__ == "__main__":
    errors.run(main)
