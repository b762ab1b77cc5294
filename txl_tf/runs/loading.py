"""Building a TransformerXL from its configuration and loading its weights from a checkpoint.

    dtype_policy(dtype)              Keras' global dtype policy while layers are created
    build_model(model_config, ...)   a TransformerXL of a ModelConfig (checked by one tiny forward pass)
    restore_weights(model, prefix)   the weights (key `model`) of one checkpoint; every weight must match, and no
                                     model variable of the checkpoint may be left unread
    check_weights_file(weights, ...) a Keras .weights.h5 holds exactly these weights (the presets' loaders)
    restore_newest(model, source)    the newest checkpoint of a prefix or run directory that restores intact
    vocab_size(data_config)          the vocabulary size of the prepared data, if it is there
    load_model(model_dir, ...)       all of it: the configs, the model and its newest intact checkpoint

The run directory's files (config.gin, checkpoints, their discovery and fallback) are `txl_tf.runs.run_dir`'s; this
module builds and fills models from what it finds. Evaluate, export, generate, average and the study load models
through here; the trainer builds its model with `dtype_policy` and `build_model`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import tempfile
from collections.abc import Sequence

import tensorflow as tf

from txl_tf.base import errors
from txl_tf.base.errors import ConfigError
from txl_tf.configs import Configs, DataConfig, ModelConfig, architecture, check_inference_size
from txl_tf.runs import run_dir


@contextlib.contextmanager
def dtype_policy(dtype: str | None):
    """Keras' global dtype policy set to `dtype` (e.g. "mixed_bfloat16") while layers are created.

    Sublayers take the global policy when they are constructed (a `dtype` argument to the model alone does not
    reach them), so models are built inside this context.
    """
    import keras

    check_dtype(dtype)
    previous = keras.config.dtype_policy()
    if dtype:
        keras.config.set_dtype_policy(dtype)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


def check_dtype(dtype) -> None:
    """A dtype policy given by name must be one Keras knows (a one-line ConfigError, not Keras' ValueError)."""
    import keras

    if isinstance(dtype, str):
        try:
            keras.dtype_policies.get(dtype)
        except ValueError:
            raise ConfigError(f"dtype={dtype[:40]!r} is not a Keras dtype policy; give one such as 'float32', "
                              "'bfloat16' or 'mixed_bfloat16'") from None


def build_model(model_config: ModelConfig, n_token: int | None = None, dtype: str | None = None, *,
                check: bool = True):
    """Builds a TransformerXL (every layer in `dtype`'s policy; None: the current one) from a ModelConfig.

    Sizes that would not fit in this machine's memory are a ConfigError before anything is built
    (`configs.check_model_size`, by way of `ModelConfig.model_kwargs`). `check`: one tiny forward pass, so that a
    config that cannot run fails here (the trainer, which builds the model inside a strategy's scope, skips it).
    The fused kernels and recomputation are not the model's: the trainer passes its `TrainingPolicy`
    (`txl_tf.model.policy`) to its training calls.
    """
    from txl_tf.model.transformer_xl import TransformerXL

    with dtype_policy(dtype):
        model = TransformerXL(**model_config.model_kwargs(n_token))
    if not check:
        return model
    tokens = tf.zeros([1, 2], tf.int32)
    hidden, _ = model(tokens, training=False)
    model.nll(hidden, tokens)
    return model


def restore_weights(model, checkpoint_prefix: str) -> None:
    """Restores `model` from a checkpoint saved as tf.train.Checkpoint(model=model); every weight must match, and
    every variable of the checkpoint's model must have its place in `model` (none left unread).

    An intact checkpoint that does not fit the model is a run_dir.CheckpointMismatchError naming the variable,
    both shapes and the config field (`run_dir.mismatch`); a damaged one raises TensorFlow's error. A checkpoint
    written before the attention's projections became layers is read through `txl_tf.model.upgrade`."""
    from txl_tf.model import upgrade

    run_dir.check_checkpoint(checkpoint_prefix)  # regular files before anything opens them (a FIFO would hang)
    try:
        legacy = upgrade.legacy_checkpoint(checkpoint_prefix)
    except run_dir.RESTORE_ERRORS:
        legacy = False  # a damaged checkpoint: the restore below names the problem
    if legacy:
        with tempfile.TemporaryDirectory(prefix="txl_tf-upgrade-") as tmp:
            return _restore(model, upgrade.upgraded_checkpoint(checkpoint_prefix, tmp), checkpoint_prefix)
    return _restore(model, checkpoint_prefix, checkpoint_prefix)


def _restore(model, prefix: str, named: str) -> None:
    """`restore_weights` of the checkpoint `prefix`; errors name `named` (the user's checkpoint)."""
    root = tf.train.Checkpoint(model=model)
    try:
        status = root.restore(prefix).expect_partial()
        status.assert_existing_objects_matched()
    except (*run_dir.RESTORE_ERRORS, AssertionError) as error:
        problem = run_dir.mismatch(prefix, root)
        if problem:
            raise run_dir.CheckpointMismatchError(f"checkpoint {problem.replace(prefix, named)}") from None
        if isinstance(error, AssertionError):
            raise ConfigError(f"checkpoint {named} does not match the configured model "
                              f"({errors.one_line(error)}); check ModelConfig in the gin config") from error
        raise
    # Every variable of the model came from the checkpoint; none of the checkpoint's model may be left over either
    # (an XL checkpoint restored into a 'vaswani' model leaves its position projections and biases unread).
    problem = run_dir.mismatch(prefix, root)
    if problem:
        raise run_dir.CheckpointMismatchError(f"checkpoint {problem.replace(prefix, named)}")


def check_weights_file(weights, path: str, fix: str) -> None:
    """Refuses, in one UserError line naming `path` and ending with `fix`, a Keras weights file (.weights.h5) that
    is not one (garbage, an empty file) or whose variables are not exactly `weights` (a model's weights: as many,
    of the same shapes). Keras' own loading reads the variables the model asks for and leaves the file's others
    unread without a word: an XL model's weights would load into a 'vaswani' model."""
    import collections

    import h5py

    saved = []

    def visit(name, item):
        if isinstance(item, h5py.Dataset):
            saved.append((name, tuple(item.shape)))

    try:
        with h5py.File(path, "r") as f:
            f.visititems(visit)
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        raise errors.UserError(f"{path} is not a Keras weights file ({errors.one_line(error)}); {fix}") from None
    mine = collections.Counter(tuple(weight.shape) for weight in weights)
    theirs = collections.Counter(shape for _, shape in saved)
    if mine == theirs:
        return
    extra, missing = theirs - mine, mine - theirs
    what = "; ".join(f"{sum(counts.values())} {whose} (of shape(s) {', '.join(str(list(s)) for s in sorted(counts))}) "
                     f"{verb}" for whose, verb, counts in (("of the file's weights", "have no place in the model", extra),
                                                          ("of the model's weights", "are not in the file", missing))
                     if counts)
    raise errors.UserError(f"{path} holds {len(saved)} weights and the model {sum(mine.values())}: {what} (the file "
                           f"is of another architecture or size); {fix}")


def restore_newest(model, source: str, which: str = "latest", log=None, found=None) -> str:
    """Restores the newest checkpoint of `source` (prefix or model_dir) that restores intact; returns its prefix.

    `found`: `run_dir.find_checkpoints(source, which)` when the caller has it already. Broken newer checkpoints
    are skipped with one line each on `log` (stderr); run_dir.RunDirError when none restores.
    """
    found = run_dir.find_checkpoints(source, which) if found is None else found
    restore_fn = functools.partial(restore_weights, model)
    restored = run_dir.restore_first(found, restore_fn)
    if restored.prefix is None:
        own = found and os.path.normpath(os.path.dirname(found[0].prefix)) == os.path.normpath(source)
        best = run_dir.intact_best(source, restore_fn) if which == "latest" and own else None
        raise run_dir.RunDirError(f"no checkpoint of {source} restores intact ({restored.skipped_text()}); "
                                  "restore the files or pass another --checkpoint"
                                  + (f"; {best} restores intact: pass --which=best to use it" if best else ""))
    for line in restored.skipped:
        (log or functools.partial(print, file=sys.stderr))(f"warning: {line}; using {restored.prefix}")
    return restored.prefix


def vocab_size(data_config: DataConfig) -> int | None:
    """The vocabulary size of the prepared data, or None when the data directory is absent."""
    if not data_config.data_dir or not os.path.isdir(data_config.data_dir):
        return None
    from txl_tf.data.pipeline import load_vocab

    return len(load_vocab(data_config.data_dir))


def load_model(model_dir: str | None = None, checkpoint: str | None = None, *, which: str = "latest",
               gin_files: Sequence[str] = (), gin_params: Sequence[str] = (), dtype: str | None = None,
               configs: Configs | None = None):
    """Reads the configs (unless given), rebuilds the model and restores it. Returns (model, configs, prefix).

    `checkpoint` (a prefix or a directory) defaults to `model_dir`; the newest checkpoint that restores intact
    is used. The configs are `run_dir.read_configs(model_dir, gin_files, gin_params, checkpoint)`. The vocabulary
    size comes from ModelConfig.n_token, else from the prepared data in DataConfig.data_dir, whose vocabulary must be
    the one the run recorded (`run_dir.check_vocabulary`: one line otherwise), and the configured architecture the
    one its checkpoints were saved from (`run_dir.check_architecture`). The model's sizes and
    EvalConfig's lengths are checked against the machine's memory before the model is built (one ConfigError line).
    """
    source = checkpoint or model_dir
    if not source:
        raise ConfigError("give --model_dir (or --checkpoint with --gin_file)")
    if configs is None:
        configs = run_dir.read_configs(model_dir, gin_files, gin_params, checkpoint=checkpoint)
    n_token = configs.model.n_token or vocab_size(configs.data)
    if n_token is None:
        raise ConfigError(f"the vocabulary size is unknown: bind ModelConfig.n_token or prepare the data in "
                          f"DataConfig.data_dir={configs.data.data_dir!r}")
    found = run_dir.find_checkpoints(source, which)  # a missing checkpoint is reported before the model is built
    # The architecture the checkpoints were trained with (a record beside them), before the model is built.
    run_dir.check_architecture(run_dir.run_folder(source), architecture(configs.model, n_token), "load its weights")
    if configs.data.data_dir and os.path.isdir(configs.data.data_dir):  # the ids must mean what they were trained on
        run_dir.check_vocabulary(run_dir.run_folder(source), configs.data.data_dir, "load its weights")
    # The evaluation's lengths with one row (every use needs that much): before the model is built.
    check_inference_size(configs.model, n_token=n_token, batch_size=1, tgt_len=configs.eval.tgt_len,
                         mem_len=configs.eval.mem_len)
    model = build_model(configs.model, n_token, dtype=dtype)
    prefix = restore_newest(model, source, which, found=found)
    return model, configs, prefix


def load_model_from_flags(flag_values, **kwargs):
    """The model, configs and checkpoint prefix named by the flags of `txl_tf.base.cli.define_model_flags` (parsed
    absl flag values); `kwargs` go to `load_model` (e.g. dtype)."""
    if not flag_values.model_dir and not flag_values.checkpoint:
        raise ConfigError("give --model_dir (or --checkpoint with --gin_file)")
    return load_model(flag_values.model_dir, flag_values.checkpoint, which=flag_values.which,
                      gin_files=flag_values.gin_file, gin_params=flag_values.gin_param, **kwargs)
