"""The run directory's checkpoints and saved configuration: found, checked, restored with fallback, never lost.

    model_dir/config.gin         the effective gin config of the run (written by the trainer)
    model_dir/ckpt-N.index       tf.train.Checkpoint files of step N (+ ckpt-N.data-0000k-of-0000n)
    model_dir/checkpoint         CheckpointManager's state file (the newest checkpoint and the ones it may prune)
    model_dir/best/ckpt-N.*      the best validation checkpoint
    model_dir/set_aside/<time>/  broken checkpoints newer than the one a run resumed from (moved, never deleted)

Rules (txl_tf.trainer and txl_tf.restore follow them):

* Checkpoints are found from the files themselves (every `ckpt-N.index`), not only from the state file: a
  missing or stale state file loses nothing.
* The newest checkpoint that restores intact is used; each newer one that does not is named with the reason
  (missing .index or .data shard, checksum mismatch, truncated file, ...). When none restores, the command
  stops with one line naming the files and the way out; nothing is changed.
* A training run never deletes or overwrites a checkpoint it did not write: the checkpoints present when it
  starts are marked preserved in the state file (CheckpointManager prunes only the ones it saves itself), and
  broken checkpoints newer than the resumed one (whose step numbers the run will save again) are moved to
  set_aside/ instead of being overwritten.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from collections.abc import Callable, Sequence

import tensorflow as tf

from txl_tf import errors

CONFIG_FILE = "config.gin"
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
    """The result of `restore_newest`: the prefix restored (None: none) and `skipped` lines, newest first."""

    prefix: str | None
    step: int | None
    skipped: list[str]

    def skipped_text(self) -> str:
        return "; ".join(self.skipped)


def restore_newest(found: Sequence[Candidate], restore_fn: Callable[[str], object]) -> Restored:
    """Calls `restore_fn(prefix)` on each candidate, newest first, until one restores without error."""
    skipped = []
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
    restored = restore_newest(found, restore_fn)
    if restored.prefix is None:
        raise RunDirError(
            f"{model_dir} holds checkpoint(s) {describe(found)} but none restores intact "
            f"({restored.skipped_text()}); nothing was changed: restore the files, or move them out of "
            f"{model_dir} (or pass another --model_dir) to start afresh")
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


# ---- the saved configuration ------------------------------------------------------------------------------
def config_values(configs: dict) -> dict:
    """{"ModelConfig.n_layer": 12, ...} of {"ModelConfig": ModelConfig(...), ...}."""
    values = {}
    for class_name, config in configs.items():
        for field in dataclasses.fields(config):
            value = getattr(config, field.name)
            values[f"{class_name}.{field.name}"] = tuple(value) if isinstance(value, list) else value
    return values


def compare_configs(model_dir: str, saved: dict, new: dict) -> list[str]:
    """Checks a new configuration against the one saved in model_dir/config.gin; returns the changed bindings.

    Raises RunDirError when a field in ARCHITECTURE or SAVED_STATE differs (the checkpoints cannot be restored).
    """
    old_values, new_values = config_values(saved), config_values(new)
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


def saved_configs(model_dir: str) -> dict | None:
    """The configs of model_dir/config.gin ({"ModelConfig": ..., ...}), or None without one; clears gin."""
    import gin

    from txl_tf import configs

    path = os.path.join(model_dir, CONFIG_FILE)
    if not tf.io.gfile.exists(path):
        return None
    gin.clear_config()
    try:
        configs.parse_gin(lenient_files=[path])
        return configs.make_configs()
    except errors.ConfigError as error:
        raise RunDirError(f"{path} (the saved configuration of this run) does not parse: {errors.one_line(error)}; "
                          "repair it or pass another --model_dir") from None
    finally:
        gin.clear_config()
