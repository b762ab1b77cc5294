"""Sample text from a trained TransformerXL (a model_dir or an exported SavedModel).

    python -m txl_tf.generate --model_dir=runs/sample --prompt='The history of ' --max_tokens=300 \
        --temperature=0.8 --top_p=0.9 --seed=7
    python -m txl_tf.generate --saved_model=exports/sample --prompt='The history of ' --prompt='In 1990, '

Each --prompt is one row of a batch (prompts of different lengths are fine). Both sources run one function,
`txl_tf.lm.generation.Generator` (the SavedModel's `generate` signature is that function, traced at export): the
prompts consumed in segments of EvalConfig.tgt_len, then keras-hub's sampler loop, each new token one position
over the keys/values of the last EvalConfig.mem_len positions (nothing of the context is projected again):
--temperature=0 is keras-hub's greedy sampler, anything else its top-p sampler among the --top_k likeliest
tokens. The same --seed, settings and prompts give the same text, from the model_dir and from its SavedModel.
Prints each continuation and tokens/s; `--stream=auto` prints one prompt's continuation as it is made, in pieces of
about 25 ms (the first of one token), `--stream=N` N tokens at a time (the same text: `Generator.stream` keeps the
decoding state between its calls).

Settings are checked against the vocabulary before the model is loaded: --temperature >= 0 (0 is greedy
decoding, not an error: the most likely token each time), 0 <= --top_k <= vocabulary size, 0 < --top_p <= 1,
--max_tokens >= 1, and every symbol of every --prompt in the vocabulary; then --max_tokens and the number of prompts
against the memory this process can allocate now (`configs.check_generation_size`; a SavedModel's sizes from its
assets/architecture.json). A bad value stops with one `error:` line (exit status 2).
"""

from __future__ import annotations

import dataclasses
import os

from absl import flags

from txl_tf.base import cli, errors
from txl_tf.base.errors import ConfigError
from txl_tf.runs import loading, run_dir

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
    flags.DEFINE_string("stream", None, "Print the text as it is made: 'auto' (pieces sized by time, the first of "
                        "one token, then about 25 ms each) or N new tokens at a time, 1 to 4096 (unset or 0: all at "
                        "the end; --model_dir and one --prompt). The same text as without it.",
                        flag_values=flag_values)


def _check_flags(vocab) -> list:
    from txl_tf.lm.generation import check_settings

    return check_settings(vocab, FLAGS.prompt, max_tokens=FLAGS.max_tokens, temperature=FLAGS.temperature,
                          top_k=FLAGS.top_k, top_p=FLAGS.top_p)


def _check_length(sizes, ids, *, n_token: int, segment_len: int, mem_len: int) -> None:
    """--max_tokens and the number of prompts against the memory this process can allocate, before the model is
    loaded or any buffer is made (`configs.check_generation_size`: one line naming the value and the bound)."""
    from txl_tf.configs import check_generation_size

    check_generation_size(sizes, batch_size=len(ids), length=max(len(row) for row in ids) + FLAGS.max_tokens,
                          given=FLAGS.max_tokens, name="--max_tokens", batch_name="the number of --prompt flags",
                          segment_len=segment_len, mem_len=mem_len, n_token=n_token)


def _export_sizes(saved_model: str, n_token: int):
    """(the model's sizes, the memory length, the segment length) of a SavedModel of `python -m txl_tf.export`,
    without loading it: its recorded architecture (assets/architecture.json) and its `mem_len` and `max_len`
    variables. An export written before the record bounds with its variables' largest width instead."""
    import re
    import types

    import tensorflow as tf

    from txl_tf.base import untrusted
    from txl_tf.configs import ModelConfig

    try:
        reader = tf.train.load_checkpoint(os.path.join(saved_model, "variables", "variables"))
        lengths = [int(reader.get_tensor(f"{name}/.ATTRIBUTES/VARIABLE_VALUE")) for name in ("mem_len", "max_len")]
        shapes = reader.get_variable_to_shape_map()
    except (tf.errors.OpError, ValueError) as error:
        raise ConfigError(f"--saved_model={saved_model}: its variables do not read as an export of txl_tf "
                          f"({errors.one_line(error)}); export the model again with `python -m txl_tf.export`") from None
    record = os.path.join(saved_model, "assets", run_dir.ARCHITECTURE_FILE)
    if os.path.lexists(record):
        fields = untrusted.load_json(record, max_bytes=1 << 16, what="the export's architecture record")
        known = {field.name for field in dataclasses.fields(ModelConfig)}
        try:
            fields = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()
                      if k in known and v is not None}
            return ModelConfig(**fields), *lengths
        except (ConfigError, TypeError, AttributeError):
            raise ConfigError(f"{record} is not an architecture record of txl_tf; export the model again with "
                              "`python -m txl_tf.export`") from None
    layers = {match.group(1) for name in shapes if (match := re.match(r"model/layer_(\d+)/", name))}
    widest = max([dim for shape in shapes.values() for dim in shape if dim != n_token] or [1])
    sizes = types.SimpleNamespace(n_layer=max(len(layers), 1), d_model=widest, n_head=1, d_head=widest,
                                  d_inner=widest, n_token=n_token, d_embed=None, cutoffs=(), div_val=1,
                                  attn_type="vaswani", max_position=1, untie_r=False, proj_same_dim=True)
    return sizes, *lengths


def _sampling() -> dict:
    return dict(max_tokens=FLAGS.max_tokens, temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p,
                seed=FLAGS.seed)


def _from_model_dir(stream=None):
    from txl_tf.data.pipeline import load_vocab
    from txl_tf.lm import generation

    configs = run_dir.read_configs(FLAGS.model_dir, FLAGS.gin_file, FLAGS.gin_param, checkpoint=FLAGS.checkpoint)
    vocab = load_vocab(configs.data.data_dir)
    ids = _check_flags(vocab)  # before the model is built and restored
    _check_length(configs.model, ids, n_token=len(vocab), segment_len=configs.eval.tgt_len,
                  mem_len=configs.eval.mem_len)
    model, configs, prefix = loading.load_model(FLAGS.model_dir, FLAGS.checkpoint, which=FLAGS.which,
                                                configs=configs)
    # The SavedModel's protocol: EvalConfig's lengths (export fixes the same ones).
    if stream:
        generator = generation.generator(model, configs.eval.attention_protocol(), configs.eval.tgt_len)
        return prefix, vocab, _stream(generator, vocab, ids[0], prefix, stream)
    result = generation.generate_from_model(model, ids, protocol=configs.eval.attention_protocol(),
                                            segment_len=configs.eval.tgt_len, **_sampling())
    return prefix, vocab, result


def _stream_chunk(value: str | None) -> int | str | None:
    """--stream's value: None (off), "auto" or new tokens a piece (1 to 4,096); anything else is one error line."""
    if value is None or value.strip() in ("", "0"):
        return None
    if value.strip() == "auto":
        return "auto"
    try:
        chunk = int(value)
    except ValueError:
        chunk = 0
    if not 1 <= chunk <= 4096:
        raise ConfigError(f"--stream={value[:40]} must be auto (pieces sized by time), 1 to 4096 new tokens per "
                          "printed piece, or 0 (off)")
    return chunk


def _stream(generator, vocab, ids, source: str, chunk):
    """Prints the prompt, then its continuation a piece at a time as it is made (`Generator.stream`; `chunk`:
    --stream's tokens a piece or "auto"); returns the GenerationResult of the whole call."""
    import sys
    import time

    import numpy as np

    from txl_tf.lm import generation
    from txl_tf.lm.sampling import PIECE_SECONDS

    pieces = f"pieces of about {PIECE_SECONDS * 1000:.0f} ms" if chunk == "auto" else f"{chunk} tokens at a time"
    print(f"# {source}: seed {FLAGS.seed}, temperature {FLAGS.temperature}, top_k {FLAGS.top_k}, top_p "
          f"{FLAGS.top_p}, {pieces}")
    start, made, settings = time.perf_counter(), [], _sampling()

    def chunks():  # the stream's chunks, kept for the count of tokens
        for tokens in generator.stream(ids, max_tokens=settings.pop("max_tokens"),
                                       chunk=None if chunk == "auto" else chunk, **settings):
            made.append(tokens)
            yield tokens

    for piece in generation.text_pieces(vocab, FLAGS.prompt[0], chunks()):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return generation.GenerationResult(tokens=np.concatenate(made)[None].astype(np.int32),
                                       seconds=time.perf_counter() - start)


def _from_saved_model():
    import tensorflow as tf

    from txl_tf.data.vocab import VOCAB_FILE, Vocab
    from txl_tf.lm import generation

    vocab_file = os.path.join(FLAGS.saved_model, "assets", VOCAB_FILE)
    if not os.path.exists(os.path.join(FLAGS.saved_model, "saved_model.pb")):
        raise ConfigError(f"--saved_model={FLAGS.saved_model} holds no SavedModel (no saved_model.pb); give a "
                          "directory written by `python -m txl_tf.export`")
    if not os.path.exists(vocab_file):
        raise ConfigError(f"{FLAGS.saved_model} has no vocabulary asset ({vocab_file}); re-export it with the "
                          "data present")
    vocab = Vocab.load(vocab_file)
    ids = _check_flags(vocab)  # before the SavedModel is loaded
    sizes, mem_len, segment_len = _export_sizes(FLAGS.saved_model, len(vocab))
    _check_length(sizes, ids, n_token=len(vocab), segment_len=segment_len, mem_len=mem_len)
    import tensorflow_text  # noqa: F401  (registers the word tokenizer's ops before the graph loads)

    loaded = tf.saved_model.load(FLAGS.saved_model)
    if "initial_state" not in loaded.signatures:
        raise ConfigError(f"--saved_model={FLAGS.saved_model} has no initial_state signature (an export of an "
                          "older txl_tf); export the model again with `python -m txl_tf.export`")
    ragged = loaded.tokenizer.tf_encode(tf.constant(FLAGS.prompt))  # the SavedModel's own tokenizer
    result = generation.generate_with(loaded.signatures["generate"], ragged.to_list(), **_sampling())
    return FLAGS.saved_model, vocab, result


def main(argv):
    from txl_tf.lm import generation

    cli.no_arguments(argv, "quote the --prompt (see --helpshort)")
    if bool(FLAGS.saved_model) == bool(FLAGS.model_dir or FLAGS.checkpoint):
        raise ConfigError("give exactly one of --model_dir (or --checkpoint with --gin_file) and --saved_model")
    stream = _stream_chunk(FLAGS.stream)
    if stream and (FLAGS.saved_model or len(FLAGS.prompt) != 1):
        raise ConfigError(f"--stream prints one --prompt from --model_dir as it is made, not "
                          f"{'a --saved_model' if FLAGS.saved_model else f'{len(FLAGS.prompt)} prompts'}; give one "
                          "--prompt and --model_dir, or drop --stream")
    source, vocab, result = _from_saved_model() if FLAGS.saved_model else _from_model_dir(stream)
    if not stream:
        print(f"# {source}: seed {FLAGS.seed}, temperature {FLAGS.temperature}, top_k {FLAGS.top_k}, "
              f"top_p {FLAGS.top_p}")
        for prompt, row in zip(FLAGS.prompt, result.tokens, strict=True):
            print(generation.with_prompt(vocab, prompt, vocab.decode(row.tolist())))
    print(f"# {result.tokens.size} tokens in {result.seconds:.2f} s: {result.tokens_per_second:.1f} tokens/s "
          "(the prompt and the first call's compilation included)")


if __name__ == "__main__":
    cli.run(main, define_flags)
