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
import os
import re
from collections.abc import Sequence

import gin
import tensorflow as tf

from txl_tf.configs import DataConfig, EvalConfig, ModelConfig, TrainConfig

CONFIG_FILE = "config.gin"
CONVERTED_CONFIG_FILE = "model.gin"  # written by `python -m txl_tf.convert` beside its checkpoint
BEST_DIR = "best"


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
    converted checkpoint. Unknown configurables (bindings for modules not imported here) are skipped.
    """
    files = _base_config_files(model_dir, checkpoint)
    if not files and not gin_files:
        where = os.path.join(model_dir, CONFIG_FILE) if model_dir else f"beside {checkpoint}"
        raise FileNotFoundError(
            f"no gin config found ({where}): pass the setup's --gin_file, or point --model_dir at a directory "
            "written by `python -m txl_tf.train`")
    for path in gin_files:
        if not os.path.exists(path):
            raise FileNotFoundError(f"gin file {path} does not exist")
        files.append(path)
    gin.clear_config()
    gin.parse_config_files_and_bindings(files, list(gin_params), finalize_config=False, skip_unknown=True)
    return Configs(model=ModelConfig(), data=DataConfig(), train=TrainConfig(), eval=EvalConfig(),
                   files=tuple(files))


def find_checkpoint(path: str, which: str = "latest") -> str:
    """The checkpoint prefix for `path`: a prefix itself, or a model_dir (`which` = "latest" or "best")."""
    if tf.io.gfile.exists(path + ".index"):
        return path
    if not tf.io.gfile.isdir(path):
        raise FileNotFoundError(f"{path} is neither a checkpoint prefix (no {path}.index) nor a directory")
    if which not in ("latest", "best"):
        raise ValueError(f"which must be 'latest' or 'best'; got {which!r}")
    search = [os.path.join(path, BEST_DIR)] if which == "best" else [path, os.path.join(path, BEST_DIR)]
    for directory in search:
        if not tf.io.gfile.isdir(directory):
            continue
        prefix = tf.train.latest_checkpoint(directory)
        if not prefix:  # written with Checkpoint.write (no state file): the highest ckpt-N
            numbered = [(int(m.group(1)), name) for name in tf.io.gfile.listdir(directory)
                        if (m := re.fullmatch(r"ckpt-(\d+)\.index", name))]
            prefix = os.path.join(directory, max(numbered)[1][:-len(".index")]) if numbered else None
        if prefix:
            return prefix
    raise FileNotFoundError(f"no {which} checkpoint found in {path} (looked in {', '.join(search)})")


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
        raise ValueError(f"checkpoint {checkpoint_prefix} does not match the configured model "
                         f"(check ModelConfig in the gin config): {error}") from error


def vocab_size(data_config: DataConfig) -> int | None:
    """The vocabulary size of the prepared data, or None when the data directory is absent."""
    if not data_config.data_dir or not os.path.isdir(data_config.data_dir):
        return None
    from txl_tf.data.pipeline import load_vocab

    return len(load_vocab(data_config.data_dir))


def load_model(model_dir: str | None = None, checkpoint: str | None = None, *, which: str = "latest",
               gin_files: Sequence[str] = (), gin_params: Sequence[str] = (), dtype: str | None = None):
    """Parses the configs, rebuilds the model and restores it. Returns (model, configs, checkpoint prefix).

    `checkpoint` (a prefix or a directory) defaults to `model_dir`. The vocabulary size comes from
    ModelConfig.n_token, else from the prepared data in DataConfig.data_dir.
    """
    configs = parse_configs(model_dir, gin_files, gin_params, checkpoint=checkpoint)
    source = checkpoint or model_dir
    if not source:
        raise ValueError("give --model_dir or --checkpoint")
    prefix = find_checkpoint(source, which)
    n_token = configs.model.n_token or vocab_size(configs.data)
    if n_token is None:
        raise ValueError(f"the vocabulary size is unknown: bind ModelConfig.n_token or prepare the data in "
                         f"DataConfig.data_dir={configs.data.data_dir!r}")
    model = build_model(configs.model, n_token, dtype=dtype)
    restore_weights(model, prefix)
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
        raise ValueError("give --model_dir (or --checkpoint with --gin_file)")
    return load_model(fv.model_dir, fv.checkpoint, which=fv.which, gin_files=fv.gin_file,
                      gin_params=fv.gin_param, **kwargs)
