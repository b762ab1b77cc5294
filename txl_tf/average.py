r"""Checkpoint averaging: the element-wise mean of several checkpoints' weights, as one checkpoint.

    python -m txl_tf.average --model_dir=runs/ptb --last=5
    python -m txl_tf.average --model_dir=runs/ptb --checkpoints=runs/ptb/ckpt-38000 --checkpoints=runs/ptb/ckpt-40000
    python -m txl_tf.average --checkpoints=runs/a/ckpt-4000 --checkpoints=runs/b/ckpt-4000 --output_dir=runs/ab
    python -m txl_tf.evaluate --model_dir=runs/ptb/averaged --split=test

The paper averaged the weights of its last PTB checkpoints. The output directory (default MODEL_DIR/averaged)
gets `ckpt-N` (N: the newest averaged step; key `model` only, like a converted checkpoint), the effective gin
config as `config.gin`, `averaged.json` (which checkpoints) and the run's vocabulary fingerprint
(`vocab_fingerprint.json`, when the run has one); `evaluate`, `export` and `generate` take it as
`--model_dir`. Without --model_dir the model is rebuilt from the config.gin of the newest checkpoint's run;
checkpoints of several runs are averaged only when the runs' configs make one model. The run's own checkpoints
are only read: the output directory may not be one that holds them, and an existing output directory is replaced
only with --overwrite and only if this command wrote it. The average is
written whole into a staging directory beside it and then swapped in (txl_tf.base.staging): a run killed at any point
leaves the previous average (or none), never half of one, and the next run removes what it left. A checkpoint
that a trainer still saving into the run deletes before it is read is named in one line (re-run the command), and
an output folder that cannot be written is refused in one line before the work.

Floating-point weights are averaged in float64; other model variables (dropout RNG states) come from the
newest checkpoint. Checkpoints are given oldest first; `--last=N` takes the N highest-numbered `ckpt-N` of the
run directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from collections.abc import Sequence

# First: txl_tf.base.cli quiets TensorFlow's start-up (it must come before TensorFlow's import).
from txl_tf.base import cli

# isort: split
import numpy as np
import tensorflow as tf
from absl import flags

from txl_tf.base import errors, paths, staging
from txl_tf.base.errors import ConfigError, UserError
from txl_tf.configs import architecture
from txl_tf.runs import loading, run_dir

OUTPUT_DIR = "averaged"
RECORD_FILE = "averaged.json"
KIND = "average"  # the kind of output in the folder's manifest (txl_tf.base.paths)
_NUMBERED = re.compile(r"ckpt-(\d+)$")


def last_checkpoints(model_dir: str, count: int) -> list[str]:
    """The `count` highest-numbered checkpoint prefixes `model_dir/ckpt-N`, oldest first."""
    if count < 1:
        raise ConfigError(f"--last must be >= 1; got {count}")
    intact = [c.prefix for c in run_dir.candidates(model_dir) if c.problem is None][::-1]  # oldest first
    if not intact:
        raise FileNotFoundError(f"no ckpt-N checkpoints in {model_dir}")
    if len(intact) < count:
        print(f"{model_dir} has {len(intact)} checkpoints, fewer than --last={count}: averaging them all",
              file=sys.stderr)
    return intact[-count:]


def is_float(variable) -> bool:
    return tf.as_dtype(variable.dtype).is_floating


class CheckpointRemovedError(UserError):
    """A checkpoint to average was deleted while it was being read (by a trainer still saving into the run)."""


def _restore(model, prefix: str) -> None:
    """`loading.restore_weights`, where a checkpoint whose files are gone by the time they are read (a trainer
    saving into the run deletes its oldest ones: CheckpointManager keeps TrainConfig.keep_checkpoints) is one line."""
    try:
        loading.restore_weights(model, prefix)
    except (tf.errors.NotFoundError, tf.errors.DataLossError, IndexError):
        files = [f"{prefix}.index"] + (tf.io.gfile.glob(f"{prefix}.data-*") if tf.io.gfile.exists(f"{prefix}.index")
                                       else [])
        if all(tf.io.gfile.exists(f) for f in files) and len(files) > 1:
            raise  # its files are there: a damaged checkpoint, named by the restore's own error
        raise CheckpointRemovedError(
            f"{prefix} was removed while it was being read (a trainer still saving into "
            f"{os.path.dirname(prefix)} deletes its older checkpoints, keeping TrainConfig.keep_checkpoints); nothing "
            "was written: re-run the command, or average once training has ended (or --checkpoints that it keeps, "
            "e.g. copies)") from None


def average_weights(model, prefixes: Sequence[str]) -> None:
    """Sets `model`'s weights to the mean of the checkpoints `prefixes` (each restored into `model` in turn).

    A checkpoint removed before or while it is read (a trainer saving into the run) is a CheckpointRemovedError
    naming it."""
    if not prefixes:
        raise ConfigError("no checkpoints to average")
    sums = None
    for prefix in prefixes:
        _restore(model, prefix)
        values = [np.asarray(v.numpy(), np.float64) if is_float(v) else None for v in model.weights]
        sums = values if sums is None else [s if s is None else s + x for s, x in zip(sums, values, strict=True)]
    for variable, total in zip(model.weights, sums, strict=True):
        if total is not None:  # non-float variables keep the last (newest) checkpoint's value
            variable.assign(tf.cast(total / len(prefixes), variable.dtype))


def _check_output_dir(output_dir: str, prefixes: Sequence[str], overwrite: bool) -> str:
    output_dir = paths.output_dir(output_dir, "--output_dir")
    for prefix in prefixes:
        if paths.inside(os.path.dirname(prefix), output_dir):
            raise ConfigError(f"--output_dir={output_dir} holds the averaged checkpoint {prefix}; write the "
                             "average elsewhere (default: MODEL_DIR/averaged)")
    staging.remove_stale(output_dir)  # a killed average's staging directory (or a replacement cut halfway)
    return paths.replaceable_dir(output_dir, "--output_dir", kind=KIND, overwrite=overwrite)


def _check_writable(output_dir: str) -> None:
    """The average is staged beside `output_dir`, in its folder: one line before the work when that folder (or the
    nearest one that exists) cannot be written (a read-only file system, no write permission)."""
    folder = errors.existing_folder(os.path.dirname(os.path.abspath(output_dir)))
    reason = errors.not_writable_reason(folder)
    if reason:
        raise UserError(f"{folder} is not writable ({reason}), so the average cannot be written to "
                        f"--output_dir={output_dir}; give an --output_dir in a writable folder (the default is "
                        "MODEL_DIR/averaged)")


def _check_one_model(prefixes: Sequence[str], gin_files=(), gin_params=()) -> None:
    """Checkpoints of several runs are averaged only when their runs' saved configs (each with `gin_files` and
    `gin_params`) make one model on one vocabulary: a ConfigError naming the two runs and the first ModelConfig
    field (or the recorded vocabulary) that differs otherwise."""
    found = {}  # config file -> (the ModelConfig it makes, the run's recorded vocabulary sha256 or None)
    for prefix in prefixes:
        for path in run_dir.config_files(None, checkpoint=prefix):
            if path not in found:
                vocab = run_dir.recorded_vocabulary(run_dir.run_folder(prefix))
                found[path] = (run_dir.read_configs(None, gin_files, gin_params, checkpoint=prefix).model,
                               vocab and vocab["sha256"])
    if len(found) < 2:
        return
    (first, (model, vocab)), *others = found.items()
    for path, (other, other_vocab) in others:
        differ = [f"ModelConfig.{f.name}={getattr(model, f.name)!r}, {path} has {getattr(other, f.name)!r}"
                  for f in dataclasses.fields(model) if getattr(model, f.name) != getattr(other, f.name)]
        if vocab and other_vocab and vocab != other_vocab:
            differ.append(f"a vocabulary of sha256 {vocab[:12]}…, {path} one of {other_vocab[:12]}…")
        if differ:
            raise ConfigError(f"the checkpoints come from runs of different models: {first} has {differ[0]}; "
                              "average checkpoints of one model")


def average(prefixes: Sequence[str], output_dir: str, *, model_dir: str | None = None, gin_files=(),
            gin_params=(), overwrite: bool = False) -> str:
    """Averages the checkpoints `prefixes` (oldest first) into `output_dir`; returns the new checkpoint prefix.

    The model is rebuilt from `model_dir`'s config.gin (or the `model.gin` beside a converted checkpoint), then
    `gin_files` and `gin_params`, as `evaluate` does.
    """
    import gin

    prefixes = [run_dir.find_checkpoint(p) for p in prefixes]
    output_dir = _check_output_dir(output_dir, prefixes, overwrite)
    _check_writable(output_dir)
    _check_one_model(prefixes, gin_files, gin_params)
    # Without model_dir: the config.gin of the newest checkpoint's run (run_dir.config_files).
    configs = run_dir.read_configs(model_dir, gin_files, gin_params, checkpoint=prefixes[-1])
    n_token = configs.model.n_token or loading.vocab_size(configs.data)
    if n_token is None:
        raise ConfigError("the vocabulary size is unknown: bind ModelConfig.n_token or prepare the data in "
                         f"DataConfig.data_dir={configs.data.data_dir!r}")
    model = loading.build_model(configs.model, n_token)
    built = architecture(model)
    for folder in dict.fromkeys(run_dir.run_folder(p) for p in prefixes):  # each run's record, before any is read
        run_dir.check_architecture(folder, built, "average its checkpoints")
    average_weights(model, prefixes)
    match = _NUMBERED.search(prefixes[-1])
    step = int(match.group(1)) if match else 1
    # replaces a previous average only once this one is whole, checked again under its claim
    with staging.staged_dir(output_dir, kind=KIND, name="--output_dir", overwrite=overwrite) as tmp:
        checkpoint = tf.train.Checkpoint(model=model)
        prefix = tf.train.CheckpointManager(checkpoint, tmp, max_to_keep=None).save(checkpoint_number=step)
        run_dir.write_config(tmp, gin.config_str(),
                             "The configuration of the averaged checkpoints (written by txl_tf.average).")
        run_dir.record_architecture(tmp, built)
        record = run_dir.recorded_vocabulary(model_dir or run_dir.run_folder(prefixes[-1]))
        if record is not None:  # the run's vocabulary, checked where the average is loaded
            with open(os.path.join(tmp, run_dir.VOCAB_FINGERPRINT_FILE), "w") as f:
                json.dump(record, f, indent=1)
                f.write("\n")
        with open(os.path.join(tmp, RECORD_FILE), "w") as f:
            json.dump({"checkpoints": list(prefixes), "mean_of": len(prefixes)}, f, indent=1)
            f.write("\n")
    return os.path.join(output_dir, os.path.basename(prefix))


def define_flags(flag_values) -> None:
    cli.define(flag_values, "model_dir", "gin_file", "gin_param")
    flags.DEFINE_integer("last", None, "Average the last N checkpoints (highest ckpt-N) of --model_dir.",
                         flag_values=flag_values)
    flags.DEFINE_multi_string("checkpoints", [], "Checkpoint prefixes to average, oldest first; repeat the flag "
                              "(instead of --last).", flag_values=flag_values)
    flags.DEFINE_string("output_dir", None, f"Where to write the average (default MODEL_DIR/{OUTPUT_DIR}).",
                        flag_values=flag_values)
    flags.DEFINE_bool("overwrite", False, "Replace an average this command wrote before.", flag_values=flag_values)


def main(argv) -> None:
    fv = flags.FLAGS
    cli.no_arguments(argv)
    if bool(fv.last) == bool(fv.checkpoints):
        raise ConfigError("give exactly one of --last=N (with --model_dir) and --checkpoints=PREFIX (repeated)")
    if fv.last and not fv.model_dir:
        raise ConfigError("--last needs --model_dir")
    output_dir = fv.output_dir or (os.path.join(fv.model_dir, OUTPUT_DIR) if fv.model_dir else None)
    if not output_dir:
        raise ConfigError("give --output_dir (or --model_dir, whose averaged/ is the default)")
    prefixes = last_checkpoints(fv.model_dir, fv.last) if fv.last else list(fv.checkpoints)
    prefix = average(prefixes, output_dir, model_dir=fv.model_dir, gin_files=fv.gin_file, gin_params=fv.gin_param,
                     overwrite=fv.overwrite)
    print(f"averaged {len(prefixes)} checkpoints ({', '.join(os.path.basename(p) for p in prefixes)}) -> {prefix}")
    print(f"evaluate it with: python -m txl_tf.evaluate --model_dir={output_dir}")


if __name__ == "__main__":
    cli.run(main, define_flags)
