"""Sample text from a trained TransformerXL (a model_dir or an exported SavedModel).

    python -m txl_tf.generate --model_dir=runs/sample --prompt='The history of ' --max_tokens=300 \
        --temperature=0.8 --top_p=0.9 --seed=7
    python -m txl_tf.generate --saved_model=exports/sample --prompt='The history of ' --prompt='In 1990, '

Each --prompt is one row of a batch (prompts of different lengths are fine). Both sources run one function,
`txl_tf.generation.Generator` (the SavedModel's `generate` signature is that function, traced at export): the
prompts consumed in segments of EvalConfig.tgt_len, then keras-hub's sampler loop, each new token one position
over the keys/values of the last EvalConfig.mem_len positions (nothing of the context is projected again):
--temperature=0 is keras-hub's greedy sampler, anything else its top-p sampler among the --top_k likeliest
tokens. The same --seed, settings and prompts give the same text, from the model_dir and from its SavedModel.
Prints each continuation and tokens/s.

Settings are checked against the vocabulary before the model is loaded: --temperature >= 0 (0 is greedy
decoding, not an error: the most likely token each time), 0 <= --top_k <= vocabulary size, 0 < --top_p <= 1,
--max_tokens >= 1, and every symbol of every --prompt in the vocabulary. A bad value stops with one `error:` line
(exit status 2).
"""

from __future__ import annotations

import os

from absl import flags

from txl_tf import cli, loading, run_dir
from txl_tf.errors import ConfigError

FLAGS = flags.FLAGS


def define_flags(flag_values) -> None:
    cli.define_model_flags(flag_values)
    flags.DEFINE_string("saved_model", None, "A SavedModel written by `python -m txl_tf.export` (instead).",
                        flag_values=flag_values)
    flags.DEFINE_multi_string("prompt", ["The "], "Text to continue; repeat the flag for a batch of prompts.",
                              flag_values=flag_values)
    flags.DEFINE_integer("max_tokens", 200, "Number of tokens to generate (>= 1).", flag_values=flag_values)
    flags.DEFINE_float("temperature", 1.0, "Softmax temperature, >= 0: 0 = greedy (the most likely token), 1 = "
                       "the model's distribution, higher = flatter.", flag_values=flag_values)
    flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens (0 = all; at most the vocabulary "
                         "size).", flag_values=flag_values)
    flags.DEFINE_float("top_p", 1.0, "Nucleus sampling: sample among the likeliest tokens that make up this share "
                       "of the probability, in (0, 1] (1 = all).", flag_values=flag_values)
    flags.DEFINE_integer("seed", 0, "Stateless sampling seed.", flag_values=flag_values)


def _check_flags(vocab) -> list:
    from txl_tf.generation import check_settings

    return check_settings(vocab, FLAGS.prompt, max_tokens=FLAGS.max_tokens, temperature=FLAGS.temperature,
                          top_k=FLAGS.top_k, top_p=FLAGS.top_p)


def _sampling() -> dict:
    return dict(max_tokens=FLAGS.max_tokens, temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p,
                seed=FLAGS.seed)


def _from_model_dir():
    from txl_tf import generation
    from txl_tf.data.pipeline import load_vocab

    configs = run_dir.read_configs(FLAGS.model_dir, FLAGS.gin_file, FLAGS.gin_param, checkpoint=FLAGS.checkpoint)
    vocab = load_vocab(configs.data.data_dir)
    ids = _check_flags(vocab)  # before the model is built and restored
    model, configs, prefix = loading.load_model(FLAGS.model_dir, FLAGS.checkpoint, which=FLAGS.which,
                                                configs=configs)
    # The SavedModel's protocol: EvalConfig's lengths (export fixes the same ones).
    result = generation.generate_from_model(model, ids, protocol=configs.eval.attention_protocol(),
                                            segment_len=configs.eval.tgt_len, **_sampling())
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
    import tensorflow_text  # noqa: F401  (registers the word tokenizer's ops before the graph loads)

    loaded = tf.saved_model.load(FLAGS.saved_model)
    if "initial_state" not in loaded.signatures:
        raise ConfigError(f"--saved_model={FLAGS.saved_model} has no initial_state signature (an export of an "
                          "older txl_tf); export the model again with `python -m txl_tf.export`")
    ragged = loaded.tokenizer.tf_encode(tf.constant(FLAGS.prompt))  # the SavedModel's own tokenizer
    result = generation.generate_with(loaded.signatures["generate"], ragged.to_list(), **_sampling())
    return FLAGS.saved_model, vocab, result


def main(argv):
    from txl_tf import generation

    cli.no_arguments(argv, "quote the --prompt (see --helpshort)")
    if bool(FLAGS.saved_model) == bool(FLAGS.model_dir or FLAGS.checkpoint):
        raise ConfigError("give exactly one of --model_dir (or --checkpoint with --gin_file) and --saved_model")
    source, vocab, result = _from_saved_model() if FLAGS.saved_model else _from_model_dir()
    print(f"# {source}: seed {FLAGS.seed}, temperature {FLAGS.temperature}, top_k {FLAGS.top_k}, "
          f"top_p {FLAGS.top_p}")
    for prompt, row in zip(FLAGS.prompt, result.tokens, strict=True):
        print(generation.with_prompt(vocab, prompt, vocab.decode(row.tolist())))
    print(f"# {result.tokens.size} tokens in {result.seconds:.2f} s: {result.tokens_per_second:.1f} tokens/s "
          "(the prompt and the first call's compilation included)")


if __name__ == "__main__":
    cli.run(main, define_flags)
