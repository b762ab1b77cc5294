"""Rebuild a TransformerXL from its gin configuration and restore its weights.

Conventions (pinned with the trainer):

    model_dir/config.gin     the effective gin config (ModelConfig, DataConfig, TrainConfig, EvalConfig, DATA_DIR)
    model_dir/ckpt-N.*       tf.train.CheckpointManager checkpoints with the key `model`
    model_dir/best/ckpt-N.*  the best validation checkpoint

A checkpoint converted from the authors' TF code (`python -m txl_tf.convert --output_dir=DIR`) is DIR/ckpt-1
with the same `model` key and DIR/model.gin (its ModelConfig); pass `--checkpoint=DIR` and the setup's
`--gin_file` for the data and evaluation protocol.

Gin files are read in this order: `model_dir/config.gin` (or the converter's model.gin), then `gin_files`,
then `gin_params`, so later values override earlier ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
from collections.abc import Sequence

import gin
import tensorflow as tf

from txl_tf import errors, run_dir
from txl_tf.configs import DataConfig, EvalConfig, ModelConfig, TrainConfig
from txl_tf.errors import ConfigError

CONFIG_FILE = run_dir.CONFIG_FILE
CONVERTED_CONFIG_FILE = "model.gin"  # written by `python -m txl_tf.convert` beside its checkpoint
BEST_DIR = run_dir.BEST_DIR


@dataclasses.dataclass
class Configs:
    """The gin dataclasses as bound by a model_dir's config and any overrides."""

    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    eval: EvalConfig
    files: tuple = ()


def _base_config_files(model_dir: str | None, checkpoint: str | None) -> list:
    """model_dir/config.gin, else the converter's model.gin beside a converted checkpoint, when present."""
    if model_dir and os.path.exists(os.path.join(model_dir, CONFIG_FILE)):
        return [os.path.join(model_dir, CONFIG_FILE)]
    if checkpoint:
        directory = checkpoint if os.path.isdir(checkpoint) else os.path.dirname(checkpoint)
        if os.path.exists(os.path.join(directory, CONVERTED_CONFIG_FILE)):
            return [os.path.join(directory, CONVERTED_CONFIG_FILE)]
    return []


def parse_configs(model_dir: str | None = None, gin_files: Sequence[str] = (), gin_params: Sequence[str] = (),
                  checkpoint: str | None = None) -> Configs:
    """Parses the base config, then `gin_files`, then `gin_params`; returns the configs.

    The base config is model_dir/config.gin, else the `model.gin` that `txl_tf.convert` writes beside a
    converted checkpoint. A binding of an unknown configurable or parameter in `gin_files` or `gin_params` is an
    error (errors.ConfigError); the base config may bind configurables of modules not imported here.
    """
    from txl_tf import configs

    base = _base_config_files(model_dir, checkpoint)
    if not base and not gin_files:
        where = os.path.join(model_dir, CONFIG_FILE) if model_dir else f"beside {checkpoint}"
        raise FileNotFoundError(
            f"no gin config found ({where}): pass the setup's --gin_file, or point --model_dir at a directory "
            "written by `python -m txl_tf.train`")
    gin.clear_config()
    files = configs.parse_gin(gin_files, gin_params, lenient_files=base)
    made = configs.make_configs()
    return Configs(model=made["ModelConfig"], data=made["DataConfig"], train=made["TrainConfig"],
                   eval=made["EvalConfig"], files=tuple(files))


def _search_dirs(path: str, which: str) -> list:
    if which not in ("latest", "best"):
        raise ValueError(f"which must be 'latest' or 'best'; got {which!r}")
    return [os.path.join(path, BEST_DIR)] if which == "best" else [path, os.path.join(path, BEST_DIR)]


def find_checkpoints(path: str, which: str = "latest") -> list:
    """The checkpoints (run_dir.Candidate) to try for `path`, newest first: a prefix itself, or those of a
    model_dir (`which` = "latest": model_dir, then best/; "best": best/ only)."""
    if tf.io.gfile.exists(path + ".index"):
        return [run_dir.Candidate(-1, path)]
    if not tf.io.gfile.isdir(path):
        raise FileNotFoundError(f"{path} is neither a checkpoint prefix (no {path}.index) nor a directory; "
                                "pass a model_dir or a checkpoint prefix")
    search = _search_dirs(path, which)
    for directory in search:
        found = run_dir.candidates(directory)
        if found:
            return found
    raise FileNotFoundError(f"no {which} checkpoint found in {path} (looked in {', '.join(search)}); train one "
                            "with `python -m txl_tf.train` or pass --checkpoint")


def find_checkpoint(path: str, which: str = "latest") -> str:
    """The newest checkpoint prefix for `path` whose files are all present (see `find_checkpoints`)."""
    found = find_checkpoints(path, which)
    complete = [c for c in found if not c.problem]
    if not complete:
        raise run_dir.RunDirError(f"no complete checkpoint in {path}: "
                                  + "; ".join(f"{c.name} ({c.problem})" for c in found))
    return complete[0].prefix


@contextlib.contextmanager
def dtype_policy(dtype: str | None):
    """Keras' global dtype policy set to `dtype` (e.g. "mixed_bfloat16") while layers are created.

    Sublayers take the global policy when they are constructed (a `dtype` argument to the model alone does not
    reach them), so models are built inside this context.
    """
    import keras

    previous = keras.config.dtype_policy()
    if dtype:
        keras.config.set_dtype_policy(dtype)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


def build_model(model_config: ModelConfig, n_token: int | None = None, dtype: str | None = None):
    """Builds a TransformerXL (every layer in `dtype`'s policy) and checks it with one tiny forward pass."""
    from txl_tf.model import TransformerXL

    with dtype_policy(dtype):
        model = TransformerXL(**model_config.model_kwargs(n_token))
    tokens = tf.zeros([1, 2], tf.int32)
    hidden, _ = model(tokens, mems=None, training=False)
    model.nll(hidden, tokens)
    return model


def restore_weights(model, checkpoint_prefix: str) -> None:
    """Restores `model` from a checkpoint saved as tf.train.Checkpoint(model=model); every weight must match."""
    status = tf.train.Checkpoint(model=model).restore(checkpoint_prefix).expect_partial()
    try:
        status.assert_existing_objects_matched()
    except AssertionError as error:
        raise ConfigError(f"checkpoint {checkpoint_prefix} does not match the configured model "
                          f"({errors.one_line(error)}); check ModelConfig in the gin config") from error


def restore_newest(model, source: str, which: str = "latest", log=None) -> str:
    """Restores the newest checkpoint of `source` (prefix or model_dir) that restores intact; returns its prefix.

    Broken newer checkpoints are skipped with one line each on `log` (stderr); errors.UserError when none
    restores.
    """
    found = find_checkpoints(source, which)
    restored = run_dir.restore_newest(found, functools.partial(restore_weights, model))
    if restored.prefix is None:
        raise run_dir.RunDirError(f"no checkpoint of {source} restores intact ({restored.skipped_text()}); restore "
                                  "the files or pass another --checkpoint")
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
    """Parses the configs (unless given), rebuilds the model and restores it. Returns (model, configs, prefix).

    `checkpoint` (a prefix or a directory) defaults to `model_dir`; the newest checkpoint that restores intact
    is used. The vocabulary size comes from ModelConfig.n_token, else from the prepared data in
    DataConfig.data_dir.
    """
    source = checkpoint or model_dir
    if not source:
        raise ConfigError("give --model_dir (or --checkpoint with --gin_file)")
    if configs is None:
        configs = parse_configs(model_dir, gin_files, gin_params, checkpoint=checkpoint)
    n_token = configs.model.n_token or vocab_size(configs.data)
    if n_token is None:
        raise ConfigError(f"the vocabulary size is unknown: bind ModelConfig.n_token or prepare the data in "
                          f"DataConfig.data_dir={configs.data.data_dir!r}")
    find_checkpoints(source, which)  # a missing checkpoint is reported before the model is built
    model = build_model(configs.model, n_token, dtype=dtype)
    prefix = restore_newest(model, source, which)
    return model, configs, prefix


def define_model_flags(flag_values=None) -> None:
    """Defines the entry points' shared flags: --model_dir, --checkpoint, --which, --gin_file, --gin_param."""
    from absl import flags

    fv = flag_values or flags.FLAGS
    if "model_dir" in fv:  # already defined by another entry point imported in this process
        return
    flags.DEFINE_string("model_dir", None, "Training directory (config.gin + checkpoints).", flag_values=fv)
    flags.DEFINE_string("checkpoint", None, "Checkpoint prefix or directory (default: --model_dir), e.g. the "
                        "output_dir of `python -m txl_tf.convert`.", flag_values=fv)
    flags.DEFINE_enum("which", "latest", ["latest", "best"], "Checkpoint of a model_dir: the latest or best/.",
                      flag_values=fv)
    flags.DEFINE_multi_string("gin_file", [], "Gin files read after model_dir/config.gin.", flag_values=fv)
    flags.DEFINE_multi_string("gin_param", [], "Gin bindings applied last, e.g. EvalConfig.mem_len=800.",
                              flag_values=fv)


def load_model_from_flags(flag_values=None, **kwargs):
    """`load_model` with the flags of `define_model_flags`; returns (model, configs, checkpoint prefix)."""
    from absl import flags

    fv = flag_values or flags.FLAGS
    if not fv.model_dir and not fv.checkpoint:
        raise ConfigError("give --model_dir (or --checkpoint with --gin_file)")
    return load_model(fv.model_dir, fv.checkpoint, which=fv.which, gin_files=fv.gin_file,
                      gin_params=fv.gin_param, **kwargs)
