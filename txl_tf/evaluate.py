"""Evaluate a trained (or converted) TransformerXL on a split with the published evaluation protocol.

    python -m txl_tf.evaluate --model_dir=runs/enwik8 --split=test
    python -m txl_tf.evaluate --model_dir=runs/enwik8 --gin_param='EvalConfig.mem_len=3800' \
        --token_losses=runs/enwik8/test_nll_3800.npy
    python -m txl_tf.evaluate --gin_file=gin/enwik8.gin --checkpoint=converted/ckpt --split=test

The protocol comes from EvalConfig (tgt_len, mem_len, clamp_len, same_length, batch_size, max_steps,
protocol, compute_dtype, layout, kv_cache) as bound in model_dir/config.gin, then --gin_file, then --gin_param. With
`EvalConfig.protocol='vanilla'` the model (attn_type='al_rfou') is evaluated with a window of `tgt_len`
tokens shifted by one token per prediction.
"""

from __future__ import annotations

from absl import flags

from txl_tf.base import cli, paths
from txl_tf.base.errors import ConfigError
from txl_tf.runs import loading, run_dir

FLAGS = flags.FLAGS


def define_flags(flag_values) -> None:
    cli.define_model_flags(flag_values)
    flags.DEFINE_string("split", "test", "Split of the prepared data to evaluate (train, valid, test).",
                        flag_values=flag_values)
    flags.DEFINE_string("token_losses", None, "Write per-token NLL in corpus order (.npy, or text otherwise).",
                        flag_values=flag_values)
    flags.DEFINE_bool("progress", True, "Show progress (a bar on a terminal, a line every few seconds "
                      "otherwise).", flag_values=flag_values)


def run(model_dir=None, checkpoint=None, *, which="latest", gin_files=(), gin_params=(), split="test",
        token_losses=None, progress=True):
    """Restores the model, evaluates `split` and returns the EvalResult (also printed)."""
    from txl_tf.data.pipeline import load_vocab, read_split
    from txl_tf.evaluation import loops as evaluation

    configs = run_dir.read_configs(model_dir, gin_files, gin_params, checkpoint=checkpoint)
    protocol = configs.eval  # its fields' choices and ranges were checked when it was made (txl_tf.configs)
    # The split, the number of streams and the output path are checked before the model is loaded.
    evaluation.check_split(configs.data.data_dir, split, [protocol.batch_size] if protocol.protocol == "xl" else [],
                           protocol.layout)
    if token_losses:
        paths.output_file(token_losses, "--token_losses", "token_losses.npy")
    dtype = None if protocol.compute_dtype == "float32" else protocol.compute_dtype
    model, configs, prefix = loading.load_model(model_dir, checkpoint, which=which, dtype=dtype, configs=configs)
    data_dir = configs.data.data_dir
    tokens = read_split(data_dir, split)
    level = load_vocab(data_dir).level
    print(f"evaluating {prefix} on {data_dir} [{split}]: {len(tokens)} tokens")
    common = dict(batch_size=protocol.batch_size, max_steps=protocol.max_steps, clamp_len=protocol.clamp_len,
                  return_token_losses=bool(token_losses), progress=progress)
    if protocol.protocol == "vanilla":
        result = evaluation.evaluate_vanilla(model, tokens, window=protocol.tgt_len, **common)
    else:
        common.pop("clamp_len")
        result = evaluation.evaluate_tokens(model, tokens, tgt_len=protocol.tgt_len,
                                            protocol=protocol.attention_protocol(), layout=protocol.layout,
                                            kv_cache=protocol.kv_cache, **common)
    result.protocol["compute_dtype"] = protocol.compute_dtype
    result.protocol["split"] = split
    evaluation.print_result(result, level)
    if token_losses:
        evaluation.save_token_losses(token_losses, result.token_losses)
        print(f"wrote {len(result.token_losses)} per-token losses to {token_losses}")
    return result


def main(argv):
    cli.no_arguments(argv, "give settings as --gin_param (see --helpshort)")
    if not FLAGS.model_dir and not FLAGS.checkpoint:
        raise ConfigError("give --model_dir (or --checkpoint with --gin_file)")
    run(FLAGS.model_dir, FLAGS.checkpoint, which=FLAGS.which, gin_files=FLAGS.gin_file,
        gin_params=FLAGS.gin_param, split=FLAGS.split, token_losses=FLAGS.token_losses, progress=FLAGS.progress)


if __name__ == "__main__":
    cli.run(main, define_flags)
