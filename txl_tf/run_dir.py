"""The one owner of a run directory: its files, its checkpoints and the model built from its configuration.

    model_dir/config.gin         the effective gin config of the run (ModelConfig, DataConfig, TrainConfig,
                                 EvalConfig, DATA_DIR), written by training (`write_config`)
    model_dir/ckpt-N.index       tf.train.Checkpoint files of step N (+ ckpt-N.data-0000k-of-0000n); the key
                                 `model` holds the weights, the rest is the trainer's state
    model_dir/checkpoint         CheckpointManager's state file (the newest checkpoint and the ones it may prune)
    model_dir/best/ckpt-N.*      the best validation checkpoint
    model_dir/set_aside/<time>/  broken checkpoints newer than the one a run resumed from (moved, never deleted)
    DIR/ckpt-1 + DIR/model.gin   a checkpoint converted from the authors' TF code (`python -m txl_tf.convert`):
                                 the key `model` and its ModelConfig; pass `--checkpoint=DIR` and the setup's
                                 `--gin_file` for the data and evaluation protocol

Rules (txl_tf.controller, evaluate, export, generate, average, ... read and write run directories only here):

* Checkpoints are found from the files themselves (every `ckpt-N.index`), not only from the state file: a
  missing or stale state file loses nothing.
* The newest checkpoint that restores intact is used; each newer one that does not is named with the reason
  (missing .index or .data shard, checksum mismatch, truncated file, ...). When none restores, the command
  stops with one line naming the files and the way out; nothing is changed.
* A training run never deletes or overwrites a checkpoint it did not write: the checkpoints present when it
  starts are marked preserved in the state file (CheckpointManager prunes only the ones it saves itself), and
  broken checkpoints newer than the resumed one (whose step numbers the run will save again) are moved to
  set_aside/ instead of being overwritten.
* Gin files are read in this order: `model_dir/config.gin` (or the converter's model.gin), then `gin_files`,
  then `gin_params`, so later values override earlier ones. Models are built inside `dtype_policy`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import os
import re
import sys
import time
from collections.abc import Callable, Sequence

import gin
import tensorflow as tf

from txl_tf import errors
from txl_tf.configs import DataConfig, EvalConfig, ModelConfig, TrainConfig
from txl_tf.errors import ConfigError

CONFIG_FILE = "config.gin"
CONVERTED_CONFIG_FILE = "model.gin"  # written by `python -m txl_tf.convert` beside its checkpoint
BEST_DIR = "best"
STATE_FILE = "checkpoint"
SET_ASIDE_DIR = "set_aside"
_FILE = re.compile(r"ckpt-(\d+)\.(?:index|data-(\d+)-of-(\d+))")
# What a damaged checkpoint raises while restoring (DataLossError and NotFoundError are OpErrors; a truncated
# .data file raises IndexError "Read less bytes than requested"; a mismatch raises AssertionError/ValueError).
RESTORE_ERRORS = (tf.errors.OpError, IndexError, ValueError, AssertionError)

# ModelConfig fields that shape the weights, and fields that shape the rest of the saved training state: a run
# directory's checkpoints cannot be restored into a model whose value differs.
ARCHITECTURE = ("ModelConfig.n_layer", "ModelConfig.d_model", "ModelConfig.n_head", "ModelConfig.d_head",
                "ModelConfig.d_inner", "ModelConfig.n_token", "ModelConfig.d_embed", "ModelConfig.cutoffs",
                "ModelConfig.div_val", "ModelConfig.tie_projs", "ModelConfig.proj_same_dim", "ModelConfig.untie_r",
                "ModelConfig.attn_type", "ModelConfig.max_position")
SAVED_STATE = ("ModelConfig.mem_len", "TrainConfig.batch_size", "TrainConfig.checkpoint_memory")


class RunDirError(errors.UserError):
    """A run directory that cannot be resumed as asked (nothing in it was changed)."""


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A checkpoint found in a directory; `problem` says why it cannot be restored when the files show it."""

    step: int
    prefix: str
    problem: str | None = None

    @property
    def name(self) -> str:
        return os.path.basename(self.prefix)

    def files(self) -> list[str]:
        directory = os.path.dirname(self.prefix)
        if not tf.io.gfile.isdir(directory):
            return []
        return sorted(os.path.join(directory, f) for f in tf.io.gfile.listdir(directory)
                      if f.startswith(self.name + ".") and _FILE.fullmatch(f))


def candidates(directory: str) -> list[Candidate]:
    """Every checkpoint of `directory` (files on disk and the state file's entries), newest first."""
    if not tf.io.gfile.isdir(directory):
        return []
    index, shards = set(), {}
    for name in tf.io.gfile.listdir(directory):
        match = _FILE.fullmatch(name)
        if not match:
            continue
        step = int(match.group(1))
        if match.group(2) is None:
            index.add(step)
        else:
            shards.setdefault(step, (set(), int(match.group(3))))[0].add(int(match.group(2)))
    found = {}
    for step in index | set(shards):
        prefix = os.path.join(directory, f"ckpt-{step}")
        problem = None
        if step not in index:
            problem = f"ckpt-{step}.index is missing (an interrupted save or a partial copy)"
        elif step in shards:
            have, total = shards[step]
            missing = sorted(set(range(total)) - have)
            if missing:
                problem = f"ckpt-{step}.data-{missing[0]:05d}-of-{total:05d} is missing"
        found[step] = Candidate(step, prefix, problem)
    for prefix in _state_entries(directory):
        match = re.fullmatch(r"ckpt-(\d+)", os.path.basename(prefix))
        if match and int(match.group(1)) not in found:
            step = int(match.group(1))
            found[step] = Candidate(step, os.path.join(directory, f"ckpt-{step}"),
                                    f"listed in {os.path.join(directory, STATE_FILE)} but its files are missing")
    return [found[step] for step in sorted(found, reverse=True)]


def _state_entries(directory: str) -> list[str]:
    try:
        state = tf.train.get_checkpoint_state(directory)
    except (tf.errors.OpError, ValueError):  # an unreadable state file: the files on disk still count
        return []
    if state is None:
        return []
    return list(dict.fromkeys([*state.all_model_checkpoint_paths, state.model_checkpoint_path]))


def _reason(error: BaseException, candidate: Candidate) -> str:
    message = re.sub(r"\{\{function_node [^}]*\}\}\s*", "", errors.one_line(error))
    message = re.sub(r"\s*\[Op:\w+\]$", "", message)
    files = [os.path.basename(f) for f in candidate.files()]
    if not any(name in message for name in files + [candidate.name]):
        message = f"reading {', '.join(files) or candidate.name}: {message}"
    return f"{type(error).__name__}: {message}"[:300]


@dataclasses.dataclass
class Restored:
    """The result of `restore_first`: the prefix restored (None: none) and `skipped` lines, newest first."""

    prefix: str | None
    step: int | None
    skipped: list[str]

    def skipped_text(self) -> str:
        return "; ".join(self.skipped)


def restore_first(found: Sequence[Candidate], restore_fn: Callable[[str], object]) -> Restored:
    """Calls `restore_fn(prefix)` on each candidate, newest first, until one restores without error.

    TensorFlow's logger is at ERROR meanwhile: a restore that raises midway never returns its status (so no
    `expect_partial()`), and the status, when collected, logs a "Value in checkpoint could not be found" warning
    per value it did not restore; the failed ones are collected here, before the level is restored.
    """
    skipped = []
    logger = tf.get_logger()
    level = logger.level
    logger.setLevel("ERROR")
    try:
        for candidate in found:
            if candidate.problem:
                skipped.append(f"skipped {candidate.name} ({candidate.problem})")
                continue
            try:
                restore_fn(candidate.prefix)
            except errors.UserError:  # e.g. the checkpoint is intact but of another architecture: no fallback
                raise
            except RESTORE_ERRORS as error:
                skipped.append(f"skipped {candidate.name} ({_reason(error, candidate)})")
                continue
            return Restored(candidate.prefix, candidate.step, skipped)
        return Restored(None, None, skipped)
    finally:
        if skipped:
            gc.collect()
        logger.setLevel(level)


def intact_best(model_dir: str, restore_fn: Callable[[str], object]) -> str | None:
    """The newest checkpoint of model_dir/best/ that `restore_fn` restores (named when the run's own checkpoints
    do not restore), or None."""
    return restore_first(candidates(os.path.join(model_dir, BEST_DIR)), restore_fn).prefix


def describe(found: Sequence[Candidate]) -> str:
    return ", ".join(c.name for c in found)


def resume_training(model_dir: str, restore_fn: Callable[[str], object], *, chief: bool,
                    log: Callable[[str], None]) -> int:
    """Restores the newest intact checkpoint of a training run directory; returns the step to start from.

    Raises RunDirError (nothing changed) when the directory holds checkpoints and none restores. On the chief,
    once a checkpoint is restored, broken newer checkpoints are moved to set_aside/ and every checkpoint
    present is marked preserved (see the module docstring): call this before creating CheckpointManagers.
    """
    found = candidates(model_dir)
    if not found:
        if tf.io.gfile.exists(os.path.join(model_dir, CONFIG_FILE)):
            log(f"{model_dir} has a config.gin but no checkpoint yet: starting at step 0")
        return 0
    restored = restore_first(found, restore_fn)
    if restored.prefix is None:
        best = intact_best(model_dir, restore_fn)
        raise RunDirError(
            f"{model_dir} holds checkpoint(s) {describe(found)} but none restores intact "
            f"({restored.skipped_text()}); nothing was changed: restore the files, or move them out of "
            f"{model_dir} (or pass another --model_dir) to start afresh"
            + (f"; {best} restores intact: evaluate or export it with --which=best, or move the broken files out "
               f"and copy its files into {model_dir} to resume from it" if best else ""))
    moved = []
    if chief:
        for directory in (model_dir, os.path.join(model_dir, BEST_DIR)):
            newer = [c for c in candidates(directory) if c.step > restored.step]
            moved += set_aside(model_dir, newer)
            preserve(directory)
    log(f"resumed from {restored.prefix} at step {restored.step}"
        + (f" ({restored.skipped_text()})" if restored.skipped else "")
        + (f"; moved the newer files {', '.join(moved)} to {os.path.join(model_dir, SET_ASIDE_DIR)}" if moved
           else ""))
    return restored.step


def set_aside(model_dir: str, found: Sequence[Candidate]) -> list[str]:
    """Moves the files of `found` to model_dir/set_aside/<time>/ (keeping their names); returns their names."""
    target = os.path.join(model_dir, SET_ASIDE_DIR, time.strftime("%Y%m%d-%H%M%S"))
    moved = []
    for candidate in found:
        sub = os.path.basename(os.path.dirname(candidate.prefix))
        destination = os.path.join(target, sub) if sub == BEST_DIR else target
        files = candidate.files()
        if files:
            tf.io.gfile.makedirs(destination)
        for path in files:
            new = os.path.join(destination, os.path.basename(path))
            if tf.io.gfile.exists(new):  # never overwrite: a second copy gets a suffix
                new += f".{time.time_ns()}"
            tf.io.gfile.rename(path, new)
            moved.append(os.path.relpath(path, model_dir))
    return moved


def preserve(directory: str) -> None:
    """Rewrites the state file so that CheckpointManager will never prune the checkpoints now present.

    CheckpointManager prunes only checkpoints whose timestamp in the state file is newer than
    `last_preserved_timestamp`; all present ones get the current time as both.
    """
    present = [c for c in candidates(directory) if not c.problem]
    if not present:
        return
    now = time.time()
    paths = [c.prefix for c in reversed(present)]  # oldest first; the newest is the latest
    logger = tf.get_logger()
    level = logger.level
    logger.setLevel("ERROR")  # the v1 function logs a deprecation warning (its replacement is the manager itself)
    try:
        tf.compat.v1.train.update_checkpoint_state(
            directory, paths[-1], all_model_checkpoint_paths=paths,
            all_model_checkpoint_timestamps=[now] * len(paths), last_preserved_timestamp=now)
    finally:
        logger.setLevel(level)


# ---- finding a run's checkpoints --------------------------------------------------------------------------
def _search_dirs(path: str, which: str) -> list:
    if which not in ("latest", "best"):
        raise ValueError(f"which must be 'latest' or 'best'; got {which!r}")
    return [os.path.join(path, BEST_DIR)] if which == "best" else [path, os.path.join(path, BEST_DIR)]


def find_checkpoints(path: str, which: str = "latest") -> list:
    """The checkpoints (Candidate) to try for `path`, newest first: a prefix itself, or those of a
    model_dir (`which` = "latest": model_dir, then best/; "best": best/ only)."""
    if tf.io.gfile.exists(path + ".index"):
        return [Candidate(-1, path)]
    if not tf.io.gfile.isdir(path):
        raise FileNotFoundError(f"{path} is neither a checkpoint prefix (no {path}.index) nor a directory; "
                                "pass a model_dir or a checkpoint prefix")
    search = _search_dirs(path, which)
    for directory in search:
        found = candidates(directory)
        if found:
            return found
    raise FileNotFoundError(f"no {which} checkpoint found in {path} (looked in {', '.join(search)}); train one "
                            "with `python -m txl_tf.train` or pass --checkpoint")


def find_checkpoint(path: str, which: str = "latest") -> str:
    """The newest checkpoint prefix for `path` whose files are all present (see `find_checkpoints`)."""
    found = find_checkpoints(path, which)
    complete = [c for c in found if not c.problem]
    if not complete:
        raise RunDirError(f"no complete checkpoint in {path}: "
                          + "; ".join(f"{c.name} ({c.problem})" for c in found))
    return complete[0].prefix


# ---- the saved configuration ------------------------------------------------------------------------------
@dataclasses.dataclass
class Configs:
    """The gin dataclasses as bound by a model_dir's config and any overrides."""

    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    eval: EvalConfig
    files: tuple = ()

    def values(self) -> dict:
        """{"ModelConfig.n_layer": 12, ...}: every field of the four configs by its gin name."""
        values = {}
        for config in (self.model, self.data, self.train, self.eval):
            for field in dataclasses.fields(config):
                value = getattr(config, field.name)
                values[f"{type(config).__name__}.{field.name}"] = tuple(value) if isinstance(value, list) else value
        return values


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


def write_config(directory: str, text: str, comment: str | None = None, name: str = CONFIG_FILE) -> str:
    """Writes a gin config into `directory` (config.gin, or the converter's model.gin); returns its path.

    The file is written beside it and renamed into place, so a crash while writing (a resumed run rewrites its
    config.gin) leaves the previous file whole.
    """
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name)
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        if comment:
            f.write(f"# {comment}\n")
        f.write(text)
    os.replace(partial, path)
    return path


def compare_configs(model_dir: str, saved: Configs, new: Configs) -> list[str]:
    """Checks a new configuration against the one saved in model_dir/config.gin; returns the changed bindings.

    Raises RunDirError when a field in ARCHITECTURE or SAVED_STATE differs (the checkpoints cannot be restored).
    """
    old_values, new_values = saved.values(), new.values()
    changed = [name for name in new_values if name in old_values and old_values[name] != new_values[name]]
    fixed = [name for name in changed if name in ARCHITECTURE + SAVED_STATE]
    if fixed:
        what = ", ".join(f"{name}={old_values[name]!r}" for name in fixed)
        now = ", ".join(f"{new_values[name]!r}" for name in fixed)
        raise RunDirError(
            f"{model_dir} was trained with {what} (its {CONFIG_FILE}) but this command gives {now}: its "
            "checkpoints cannot be restored into a different architecture or state; drop the changed bindings, "
            "or pass another --model_dir for a new run")
    return [f"{name}: {old_values[name]!r} -> {new_values[name]!r}" for name in changed]


def saved_configs(model_dir: str) -> Configs | None:
    """The configs of model_dir/config.gin, or None without one; clears gin."""
    path = os.path.join(model_dir, CONFIG_FILE)
    if not tf.io.gfile.exists(path):
        return None
    try:
        return parse_configs(model_dir)
    except errors.ConfigError as error:
        raise RunDirError(f"{path} (the saved configuration of this run) does not parse: {errors.one_line(error)}; "
                          "repair it or pass another --model_dir") from None
    finally:
        gin.clear_config()


# ---- building and restoring a model -----------------------------------------------------------------------
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


def build_model(model_config: ModelConfig, n_token: int | None = None, dtype: str | None = None, *,
                check: bool = True):
    """Builds a TransformerXL (every layer in `dtype`'s policy; None: the current one) from a ModelConfig.

    `check`: one tiny forward pass, so that a config that cannot run fails here (the trainer, which builds the
    model inside a strategy's scope, skips it).
    """
    from txl_tf.model import TransformerXL

    with dtype_policy(dtype):
        model = TransformerXL(**model_config.model_kwargs(n_token))
    if not check:
        return model
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


def restore_newest(model, source: str, which: str = "latest", log=None, found=None) -> str:
    """Restores the newest checkpoint of `source` (prefix or model_dir) that restores intact; returns its prefix.

    `found`: `find_checkpoints(source, which)` when the caller has it already. Broken newer checkpoints are
    skipped with one line each on `log` (stderr); errors.UserError when none restores.
    """
    found = find_checkpoints(source, which) if found is None else found
    restore_fn = functools.partial(restore_weights, model)
    restored = restore_first(found, restore_fn)
    if restored.prefix is None:
        own = found and os.path.normpath(os.path.dirname(found[0].prefix)) == os.path.normpath(source)
        best = intact_best(source, restore_fn) if which == "latest" and own else None
        raise RunDirError(f"no checkpoint of {source} restores intact ({restored.skipped_text()}); restore "
                          "the files or pass another --checkpoint"
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
    found = find_checkpoints(source, which)  # a missing checkpoint is reported before the model is built
    model = build_model(configs.model, n_token, dtype=dtype)
    prefix = restore_newest(model, source, which, found=found)
    return model, configs, prefix


# ---- the entry points' flags ------------------------------------------------------------------------------
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
