"""The one owner of a run directory: its files, its checkpoints, its saved configuration and its state file.

    model_dir/config.gin         the effective gin config of the run (ModelConfig, DataConfig, TrainConfig,
                                 EvalConfig, DATA_DIR), written by training (`write_config`)
    model_dir/ckpt-N.index       tf.train.Checkpoint files of step N (+ ckpt-N.data-0000k-of-0000n); the key
                                 `model` holds the weights, the rest is the trainer's state
    model_dir/checkpoint         CheckpointManager's state file (the newest checkpoint and the ones it may prune)
    model_dir/best/ckpt-N.*      the best validation checkpoint
    model_dir/set_aside/<time>/  broken checkpoints newer than the one a run resumed from (moved, never deleted)
    model_dir/vocab_fingerprint.json  the fingerprint of the vocabulary the run trains on (`record_vocabulary`)
    model_dir/architecture.json  the architecture its checkpoints hold (`record_architecture`; also in averaged/
                                 and a converted directory)
    DIR/ckpt-1 + DIR/model.gin   a checkpoint converted from the authors' TF code (`python -m txl_tf.convert`):
                                 the key `model` and its ModelConfig; pass `--checkpoint=DIR` and the setup's
                                 `--gin_file` for the data and evaluation protocol

Rules (train, evaluate, export, generate, average, ... read and write run directories only here; txl_tf.runs.loading
builds and restores models from what this module finds, txl_tf.configs parses the gin files):

* Checkpoints are found from the files themselves (every `ckpt-N.index`), not only from the state file: a
  missing or stale state file loses nothing.
* The newest checkpoint that restores intact is used; each newer one that does not is named with the reason
  (missing .index or .data shard, checksum mismatch, truncated file, ...). When none restores, the command
  stops with one line naming the files and the way out; nothing is changed.
* A training run never deletes or overwrites a checkpoint it did not write: the checkpoints present when it
  starts are marked preserved in the state file (CheckpointManager prunes only the ones it saves itself), and
  broken checkpoints newer than the resumed one (whose step numbers the run will save again) are moved to
  set_aside/ instead of being overwritten. A training run saves through the managers of
  `txl_tf.training.controller.checkpoint_managers`, made after `resume_training` (a chief's in model_dir, another worker's in its
  temporary folder).
* A checkpoint that is intact but does not fit the configured model (an edited config.gin, another vocabulary
  size) is not "broken": the restore stops with one line naming the variable, both shapes and the config field
  that differs (`mismatch`), and nothing is changed or skipped.
* The vocabulary's fingerprint (`txl_tf.data.records.vocab_sha256`: its level and symbols in order) is recorded
  when training starts; resuming, evaluating (and every other load through txl_tf.runs.loading) and fine-tuning from the
  run on data whose vocabulary has another fingerprint are refused in one line (ids would mean other symbols),
  unless $TXL_TF_ALLOW_OTHER_VOCAB=1. A run without the record (written before it existed) is not checked.
* The architecture (`txl_tf.configs.architecture`) is recorded when training starts (architecture.json, also in
  averaged/ and a converted directory); a load, resume, evaluation, fine-tuning or average with a configured model
  of another architecture is refused in one line naming the field and both values (`check_architecture`).
* Gin files are read in this order (`read_configs`): `model_dir/config.gin` (or the converter's model.gin), then
  `gin_files`, then `gin_params`, so later values override earlier ones.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence

import gin
import tensorflow as tf

from txl_tf.base import errors
from txl_tf.configs import Configs, parse_configs

CONFIG_FILE = "config.gin"
CONVERTED_CONFIG_FILE = "model.gin"  # written by `python -m txl_tf.convert` beside its checkpoint
BEST_DIR = "best"
STATE_FILE = "checkpoint"
SET_ASIDE_DIR = "set_aside"
VOCAB_FINGERPRINT_FILE = "vocab_fingerprint.json"  # {"sha256", "level", "size", "vocab_file"}
ARCHITECTURE_FILE = "architecture.json"  # txl_tf.configs.architecture of the model the checkpoints hold
ALLOW_OTHER_VOCAB_ENV = "TXL_TF_ALLOW_OTHER_VOCAB"  # "1": load or resume a run on another vocabulary anyway
_FILE = re.compile(r"ckpt-(\d+)\.(?:index|data-(\d+)-of-(\d+))")
INDEX_LIMIT = 256 << 20  # a checkpoint's .index, which TensorFlow reads whole (KiBs to a few MiB for txl_tf's models)
# What a damaged checkpoint raises while restoring (DataLossError and NotFoundError are OpErrors; a truncated
# .data file raises IndexError "Read less bytes than requested"; a mismatch raises AssertionError/ValueError).
RESTORE_ERRORS = (tf.errors.OpError, IndexError, ValueError, AssertionError)


class RunDirError(errors.UserError):
    """A run directory that cannot be resumed as asked (nothing in it was changed)."""


class CheckpointMismatchError(errors.ConfigError):
    """An intact checkpoint that does not fit the configured model or training state (`mismatch` says where)."""


class OtherVocabularyError(errors.ConfigError):
    """The data's vocabulary is not the one the run was trained on (`check_vocabulary`)."""


class ArchitectureMismatchError(errors.ConfigError):
    """The configured model is another architecture than the one a folder recorded (`check_architecture`)."""


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
        found[step] = Candidate(step, prefix, problem or checkpoint_problem(prefix))
    for prefix in _state_entries(directory):
        match = re.fullmatch(r"ckpt-(\d+)", os.path.basename(prefix))
        if match and int(match.group(1)) not in found:
            step = int(match.group(1))
            found[step] = Candidate(step, os.path.join(directory, f"ckpt-{step}"),
                                    f"listed in {os.path.join(directory, STATE_FILE)} but its files are missing")
    return [found[step] for step in sorted(found, reverse=True)]


def checkpoint_problem(prefix: str) -> str | None:
    """Why the files of the checkpoint `prefix` must not be opened, or None. Its .index and every .data shard on
    disk must be regular files (TensorFlow's reader waits forever on a FIFO and reads a device without end), the
    .index at most INDEX_LIMIT bytes (it is read whole; a shard is read only where the index points, each tensor
    checked against the model's shape and its checksum). Missing files are the restore's to report; a remote
    prefix (gs://...) is not checked."""
    from txl_tf.base import untrusted

    if "://" in prefix:
        return None
    directory, name = os.path.split(prefix)
    try:
        names = sorted(f for f in os.listdir(directory or ".") if f == f"{name}.index" or f.startswith(f"{name}.data-"))
    except OSError:
        return None
    for file in names:
        limit = INDEX_LIMIT if file.endswith(".index") else sys.maxsize
        try:
            untrusted.check_regular(os.path.join(directory, file), max_bytes=limit, what="the checkpoint file")
        except FileNotFoundError:
            continue
        except untrusted.UntrustedFileError as error:
            return errors.one_line(error).rsplit("; ", 1)[0]  # the caller says what to do
    return None


def check_checkpoint(prefix: str) -> None:
    """`checkpoint_problem` as a one-line RunDirError, before anything opens the checkpoint `prefix`."""
    problem = checkpoint_problem(prefix)
    if problem:
        raise RunDirError(f"{problem}; restore the checkpoint's files or pass another checkpoint")


def _state_entries(directory: str) -> list[str]:
    from txl_tf.base import untrusted

    try:  # the state file is read whole by TensorFlow: a FIFO or a device there must not hang or exhaust it
        if "://" not in directory:
            untrusted.check_regular(os.path.join(directory, STATE_FILE), max_bytes=INDEX_LIMIT,
                                    what="the state file")
    except (FileNotFoundError, untrusted.UntrustedFileError):
        return []  # none, or unreadable: the files on disk still count
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


# ---- a checkpoint that does not fit the model -------------------------------------------------------------
# The config field that each dimension of a model variable's shape is, last dimension first (a variable's Keras
# path, without the model's own name, is matched); `mems` is the trainer's saved memory.
_SHAPE_FIELDS = (
    (re.compile(r"softmax/bias$"), ("the vocabulary size n_token",)),
    (re.compile(r"feed_forward/inner/(kernel|bias)$"), ("ModelConfig.d_inner", "ModelConfig.d_model")),
    (re.compile(r"feed_forward/outer/kernel$"), ("ModelConfig.d_model", "ModelConfig.d_inner")),
    (re.compile(r"layer_norm/(gamma|beta)$"), ("ModelConfig.d_model",)),
    (re.compile(r"r_[wr]_bias$"), ("ModelConfig.d_head", "ModelConfig.n_head", "ModelConfig.n_layer")),
    (re.compile(r"^mems$"), ("ModelConfig.d_model", "ModelConfig.mem_len", "TrainConfig.batch_size",
                             "ModelConfig.n_layer")),
)
_LAYER = re.compile(r"layer_(\d+)$")
_ROOT_ONLY = ("optimizer", "save_counter")  # their shapes follow the model's; a model-only restore has none
PRESENT = "present"


@dataclasses.dataclass(frozen=True)
class Difference:
    """A variable whose shape differs between a checkpoint and the object restored from it (None: absent;
    PRESENT: an object, not a variable, that only one side has)."""

    name: str
    saved: tuple | str | None
    model: tuple | str | None


def _variable_name(live, path: str) -> str:
    """A model variable's Keras path without the model's own name ("layer_0/feed_forward/inner/kernel"), else the
    object path in the checkpoint ("mems")."""
    keras_path = getattr(live, "path", None)
    if isinstance(keras_path, str) and path.startswith("model/") and "/" in keras_path:
        return keras_path.split("/", 1)[1]
    return path


def differences(prefix: str, root) -> tuple[list[Difference], dict]:
    """Where the checkpoint `prefix` and `root` (the tf.train.Checkpoint restored from it) differ, walking both
    object graphs from the root as a restore does: (the variables whose shapes differ or that one side lacks,
    {"ModelConfig.n_layer": (saved, model)} when the number of layers differs). Empty when the checkpoint cannot be
    read (it is damaged, not different). The optimizer's variables follow the model's and are not compared."""
    from google.protobuf.message import DecodeError
    from tensorflow.core.protobuf import trackable_object_graph_pb2

    try:
        reader = tf.train.load_checkpoint(prefix)
        shapes = reader.get_variable_to_shape_map()
        graph = trackable_object_graph_pb2.TrackableObjectGraph.FromString(
            reader.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH"))
    except (tf.errors.OpError, ValueError, IndexError, DecodeError):
        return [], {}
    found, layers, visited = [], {}, set()
    stack = [(0, root, "")]
    while stack:  # depth first, the model first: its variables are named by their paths in the model
        node_id, live, path = stack.pop()
        if node_id in visited:
            continue
        visited.add(node_id)
        node = graph.nodes[node_id]
        for attribute in node.attributes:
            if attribute.name == "VARIABLE_VALUE" and hasattr(live, "shape"):
                saved = shapes.get(attribute.checkpoint_key)
                saved, mine = (None if saved is None else tuple(saved)), tuple(live.shape)
                if saved != mine:
                    found.append(Difference(_variable_name(live, path), saved, mine))
        children = tf.train.TrackableView.children(live)
        saved_children = {ref.local_name: ref.node_id for ref in node.children}
        if path:
            counts = [sum(bool(_LAYER.fullmatch(n)) for n in names) for names in (saved_children, children)]
            if counts[0] != counts[1] and path == "model":
                layers["ModelConfig.n_layer"] = tuple(counts)
            for name in sorted(saved_children.keys() - children.keys()):
                found.append(Difference(f"{path}/{name}", PRESENT, None))
            for name in sorted(children.keys() - saved_children.keys()):
                child = children[name]
                found.append(Difference(_variable_name(child, f"{path}/{name}"), None,
                                        tuple(child.shape) if hasattr(child, "shape") else PRESENT))
        order = sorted(saved_children.items(), key=lambda item: item[0] != "model")  # stable: checkpoint order
        for name, child_id in reversed(order):  # popped in that order
            if name in children and not (not path and name in _ROOT_ONLY):
                stack.append((child_id, children[name], f"{path}/{name}".lstrip("/")))
    return found, layers


def _fields(found: Sequence[Difference], layers: dict) -> dict:
    """{config field: (value in the checkpoint, value configured)} that the differing shapes show."""
    fields = dict(layers)
    for difference in found:
        if not isinstance(difference.saved, tuple) or not isinstance(difference.model, tuple):
            continue
        for pattern, names in _SHAPE_FIELDS:
            if not pattern.search(difference.name):
                continue
            if len(difference.saved) != len(difference.model):
                if names[0] == "ModelConfig.d_head":
                    fields.setdefault("ModelConfig.untie_r", (len(difference.saved) == 3,
                                                              len(difference.model) == 3))
                break
            for name, saved, mine in zip(names, reversed(difference.saved), reversed(difference.model), strict=False):
                if saved != mine:
                    fields.setdefault(name, (saved, mine))
            break
    return fields


def _shape(shape: tuple | str | None) -> str:
    return "absent" if shape is None else shape if isinstance(shape, str) else str(list(shape))


def mismatch(prefix: str, root) -> str | None:
    """One line saying how the intact checkpoint `prefix` does not fit `root` (the tf.train.Checkpoint, with the
    model under `model`, being restored from it): the first variable that differs, its shape in the checkpoint and
    in the model, and the config fields that differ with both values. None when nothing differs (a restore that
    failed anyway found a damaged checkpoint)."""
    found, layers = differences(prefix, root)
    if not found and not layers:
        return None
    fields = _fields(found, layers)
    first = next((d for d in found if d.saved is not None and d.model is not None), found[0] if found else None)
    what = (f"{first.name} is {_shape(first.saved)} in the checkpoint and {_shape(first.model)} in the model"
            + (f" ({len(found) - 1} more differ)" if len(found) > 1 else "")) if first else ""
    if fields:
        said = "; ".join(f"{name}: {saved} in the checkpoint, {mine} configured"
                         for name, (saved, mine) in fields.items())
    else:
        said = "the architecture (ModelConfig) differs"
    vocabulary = any(name.startswith("the vocabulary") for name in fields)
    return (f"{prefix} is intact but does not fit the configured model: {', '.join(p for p in (what, said) if p)}"
            + (" (ModelConfig.n_token, else the vocabulary of DataConfig.data_dir)" if vocabulary else "")
            + "; nothing was changed: configure the model as the checkpoint was trained (its run's config.gin, "
            + ("or DataConfig.data_dir of the data it was trained on, " if vocabulary else "")
            + "or --gin_param), or use another checkpoint or --model_dir")


@dataclasses.dataclass
class Restored:
    """The result of `restore_first`: the prefix restored (None: none) and `skipped` lines, newest first."""

    prefix: str | None
    step: int | None
    skipped: list[str]

    def skipped_text(self) -> str:
        return "; ".join(self.skipped)


def restore_first(found: Sequence[Candidate], restore_fn: Callable[[str], object], root=None) -> Restored:
    """Calls `restore_fn(prefix)` on each candidate, newest first, until one restores without error.

    `root`: the tf.train.Checkpoint that `restore_fn` restores. With it, a candidate that fails but is intact and
    does not fit it (an edited config.gin, another vocabulary size) stops the search with a
    CheckpointMismatchError saying what differs (`mismatch`) instead of being skipped as broken.

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
                problem = mismatch(candidate.prefix, root) if root is not None else None
                if problem:
                    raise CheckpointMismatchError(problem) from None
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
                    log: Callable[[str], None], root=None) -> int:
    """Restores the newest intact checkpoint of a training run directory; returns the step to start from.

    Raises RunDirError (nothing changed) when the directory holds checkpoints and none restores, and
    CheckpointMismatchError (nothing changed) when the newest intact one does not fit `root`, the
    tf.train.Checkpoint `restore_fn` restores (default: the `checkpoint` of the object whose method `restore_fn`
    is, as for `Trainer.restore_checkpoint`). On the chief, once a checkpoint is restored, broken newer
    checkpoints are moved to set_aside/ and every checkpoint present is marked preserved (see the module
    docstring): call this before creating CheckpointManagers.
    """
    found = candidates(model_dir)
    if not found:
        if tf.io.gfile.exists(os.path.join(model_dir, CONFIG_FILE)):
            log(f"{model_dir} has a config.gin but no checkpoint yet: starting at step 0")
        return 0
    if root is None:
        root = getattr(getattr(restore_fn, "__self__", None), "checkpoint", None)
    restored = restore_first(found, restore_fn, root=root)
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


# ---- the vocabulary a run trains on ------------------------------------------------------------------------
def run_folder(source: str) -> str:
    """The run directory of `source`: a model_dir, its best/, or a checkpoint prefix in either."""
    directory = os.path.normpath(source if tf.io.gfile.isdir(source) else os.path.dirname(source) or ".")
    return os.path.dirname(directory) if os.path.basename(directory) == BEST_DIR else directory


def data_vocabulary(data_dir: str) -> dict:
    """{"sha256", "level", "size", "vocab_file"} of the vocabulary of the prepared `data_dir`
    (`txl_tf.data.records.vocab_sha256`)."""
    from txl_tf.data import pipeline, records
    from txl_tf.data.vocab import VOCAB_FILE

    vocab = pipeline.load_vocab(data_dir)
    name = pipeline.load_metadata(data_dir).get("vocab_file", VOCAB_FILE)
    return {"sha256": records.vocab_sha256(vocab), "level": vocab.level, "size": len(vocab),
            "vocab_file": os.path.abspath(os.path.join(data_dir, name))}


def recorded_vocabulary(model_dir: str) -> dict | None:
    """The vocabulary fingerprint a run recorded (`record_vocabulary`), or None for a run without one."""
    from txl_tf.base import untrusted

    path = os.path.join(model_dir, VOCAB_FINGERPRINT_FILE)
    if not os.path.lexists(path):
        return None
    record = untrusted.load_json(path, max_bytes=1 << 16, what="the vocabulary fingerprint")
    if not (isinstance(record, dict) and isinstance(record.get("sha256"), str)
            and re.fullmatch(r"[0-9a-f]{64}", record["sha256"])):
        raise RunDirError(f"{path} is not a vocabulary fingerprint written by txl_tf (no \"sha256\" of 64 hex "
                          "digits); delete it: the next training command in this run records it again")
    return record


def record_vocabulary(model_dir: str, data_dir: str) -> dict:
    """Writes model_dir/vocab_fingerprint.json, the fingerprint of `data_dir`'s vocabulary (written beside and
    renamed into place); returns it."""
    record = data_vocabulary(data_dir)
    path = os.path.join(model_dir, VOCAB_FINGERPRINT_FILE)
    os.makedirs(model_dir, exist_ok=True)
    with open(f"{path}.partial", "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    os.replace(f"{path}.partial", path)
    return record


def check_vocabulary(model_dir: str, data_dir: str, what: str) -> None:
    """Refuses (OtherVocabularyError, one line naming both vocabularies and the fix) when the run `model_dir`
    recorded a vocabulary fingerprint and the prepared `data_dir`'s vocabulary has another: the run's ids would
    mean other symbols. `what` says what was to be done ("resume training", ...). With $TXL_TF_ALLOW_OTHER_VOCAB=1
    (the user's opt-in) it is only a warning on stderr. A run without the record is not checked."""
    recorded = recorded_vocabulary(model_dir)
    if recorded is None:
        return
    current = data_vocabulary(data_dir)
    if current["sha256"] == recorded["sha256"]:
        return
    detail = (f"{current['vocab_file']} (sha256 {current['sha256'][:16]}..., {current['size']} {current['level']} "
              f"symbols) is another vocabulary than the one {model_dir} was trained on (sha256 "
              f"{recorded['sha256'][:16]}..., {recorded.get('size')} symbols, of {recorded.get('vocab_file')}; "
              f"recorded in {os.path.join(model_dir, VOCAB_FINGERPRINT_FILE)})")
    if os.environ.get(ALLOW_OTHER_VOCAB_ENV) == "1":
        print(f"warning: {detail}; {what} anyway, as {ALLOW_OTHER_VOCAB_ENV}=1 asks", file=sys.stderr, flush=True)
        return
    raise OtherVocabularyError(
        f"{detail}: its ids would mean other symbols to the model; point DataConfig.data_dir at the data it was "
        f"trained on (or data prepared with --vocab_from it), or set {ALLOW_OTHER_VOCAB_ENV}=1 to {what} on this "
        "vocabulary anyway")


# ---- the architecture a run trains -------------------------------------------------------------------------
def recorded_architecture(folder: str) -> dict | None:
    """The architecture recorded in `folder` (`record_architecture`; a run, best/'s run, averaged/, a converted
    directory), or None for a folder without the record (written before it existed)."""
    from txl_tf.base import untrusted

    path = os.path.join(folder, ARCHITECTURE_FILE)
    if not os.path.lexists(path):
        return None
    record = untrusted.load_json(path, max_bytes=1 << 16, what="the architecture record")
    if not (isinstance(record, dict) and isinstance(record.get("attn_type"), str)):
        raise RunDirError(f"{path} is not an architecture record written by txl_tf (no \"attn_type\"); restore it "
                          "from the run's copy, or delete it to load the checkpoints by their variables alone")
    return record


def check_architecture(folder: str, architecture: dict, what: str) -> None:
    """Refuses (ArchitectureMismatchError, one line naming the field, both values and the fix) when `folder`
    recorded another architecture than `architecture` (`txl_tf.configs.architecture` of the model about to be
    loaded): its weights would load into a model that computes something else (an XL run as 'vaswani', a RoPE run
    as 'alibi'). `what` says what was to be done. A folder without the record is not checked here (the restore
    still requires every checkpoint variable to fit the model: `txl_tf.runs.loading.restore_weights`)."""
    from txl_tf.configs import differing_architecture

    recorded = recorded_architecture(folder)
    difference = None if recorded is None else differing_architecture(recorded, architecture)
    if difference:
        vocabulary = difference.startswith("ModelConfig.n_token ")
        raise ArchitectureMismatchError(
            f"{folder} was trained as another model: {difference} ({os.path.join(folder, ARCHITECTURE_FILE)} "
            "against the configured model" + (": the vocabulary of DataConfig.data_dir, else ModelConfig.n_token"
                                              if vocabulary else "")
            + "); nothing was done: configure the model as it was trained (its config.gin, --gin_file, --gin_param"
            + (", DataConfig.data_dir of the data it was trained on" if vocabulary else "")
            + f") to {what}, or use another run")


def record_architecture(folder: str, architecture: dict) -> None:
    """Writes folder/architecture.json (renamed into place) unless it is there; a record of another architecture
    is refused first (`check_architecture`)."""
    check_architecture(folder, architecture, "write into it")
    path = os.path.join(folder, ARCHITECTURE_FILE)
    if os.path.lexists(path):
        return
    os.makedirs(folder, exist_ok=True)
    with open(f"{path}.partial", "w") as f:
        json.dump(architecture, f, indent=1)
        f.write("\n")
    os.replace(f"{path}.partial", path)


# ---- finding a run's checkpoints --------------------------------------------------------------------------
def _search_dirs(path: str, which: str) -> list:
    if which not in ("latest", "best"):
        raise ValueError(f"which must be 'latest' or 'best'; got {which!r}")
    return [os.path.join(path, BEST_DIR)] if which == "best" else [path, os.path.join(path, BEST_DIR)]


def find_checkpoints(path: str, which: str = "latest") -> list:
    """The checkpoints (Candidate) to try for `path`, newest first: a prefix itself, or those of a
    model_dir (`which` = "latest": model_dir, then best/; "best": best/ only)."""
    if tf.io.gfile.exists(path + ".index"):
        return [Candidate(-1, path, checkpoint_problem(path))]
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
def config_files(model_dir: str | None, checkpoint: str | None = None) -> list:
    """The gin file a run was made with: model_dir/config.gin; without a model_dir, the config.gin of the run
    `checkpoint` belongs to (`run_folder`: its folder, or the run of its best/); else the converter's model.gin
    beside a converted checkpoint, when present ([] when none is)."""
    if model_dir and os.path.exists(os.path.join(model_dir, CONFIG_FILE)):
        return [os.path.join(model_dir, CONFIG_FILE)]
    if checkpoint and not model_dir and os.path.exists(os.path.join(run_folder(checkpoint), CONFIG_FILE)):
        return [os.path.join(run_folder(checkpoint), CONFIG_FILE)]
    if checkpoint:
        directory = checkpoint if os.path.isdir(checkpoint) else os.path.dirname(checkpoint)
        if os.path.exists(os.path.join(directory, CONVERTED_CONFIG_FILE)):
            return [os.path.join(directory, CONVERTED_CONFIG_FILE)]
    return []


def read_configs(model_dir: str | None = None, gin_files: Sequence[str] = (), gin_params: Sequence[str] = (),
                 checkpoint: str | None = None) -> Configs:
    """The configs of a run: its saved gin file (`config_files`), then `gin_files`, then `gin_params`.

    The saved file may bind configurables of modules not imported here; an unknown binding in `gin_files` or
    `gin_params` is an error (errors.ConfigError). See txl_tf.configs.parse_configs.
    """
    base = config_files(model_dir, checkpoint)
    if not base and not gin_files:
        where = os.path.join(model_dir, CONFIG_FILE) if model_dir else f"beside {checkpoint}"
        raise FileNotFoundError(
            f"no gin config found ({where}): pass the setup's --gin_file, or point --model_dir at a directory "
            "written by `python -m txl_tf.train`")
    return parse_configs(gin_files, gin_params, base_files=base)


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


def saved_configs(model_dir: str) -> Configs | None:
    """The configs of model_dir/config.gin, or None without one; clears gin."""
    path = os.path.join(model_dir, CONFIG_FILE)
    if not tf.io.gfile.exists(path):
        return None
    try:
        return read_configs(model_dir)
    except errors.ConfigError as error:
        raise RunDirError(f"{path} (the saved configuration of this run) does not parse: {errors.one_line(error)}; "
                          "repair it or pass another --model_dir") from None
    finally:
        gin.clear_config()
