r"""Train Transformer-XL: everything but infrastructure is configured with gin.

    python -m txl_tf.train --gin_file=gin/enwik8.gin
    python -m txl_tf.train --gin_file=gin/sample.gin --model_dir=runs/sample \
        --gin_param="DATA_DIR='data/enwik8_sample'" --gin_param="TrainConfig.mixed_precision=False"
    python -m txl_tf.train --gin_file=gin/wt103.gin --strategy=mirrored
    scripts/launch_local_multiworker.sh 2 --gin_file=gin/sample.gin --model_dir=runs/mw

Re-running the same command resumes from the latest checkpoint in --model_dir (default: runs/<gin file name>).
SIGTERM / Ctrl-C save a checkpoint and exit cleanly. A gin file is found as given, else among the shipped gin
files (the checkout's gin/ folder, which a wheel installs as txl_tf/gin: `txl_tf.configs.GIN_DIR`), so
`--gin_file=enwik8.gin` works from any directory; `include` lines resolve the same way.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Callable

from absl import flags

# First: txl_tf.base.cli sets TF_CPP_MIN_LOG_LEVEL (and txl_tf the Keras backend) before TensorFlow starts.
from txl_tf.base import cli

# isort: split
from txl_tf.base import paths
from txl_tf.base.cli import STRATEGIES
from txl_tf.base.errors import ConfigError, UserError
from txl_tf.training import autotune

FLAGS = flags.FLAGS


def define_flags(flag_values) -> None:
    """The infrastructure flags (everything else is a gin binding)."""
    cli.define(flag_values, "gin_file", "gin_param", "model_dir")
    flags.DEFINE_enum("strategy", "default", list(STRATEGIES), "tf.distribute strategy.", flag_values=flag_values)
    flags.DEFINE_string("tpu", None, "TPU name or address for --strategy=tpu.", flag_values=flag_values)


class WorkerLostError(UserError):
    """A peer of a multi-worker run died or stopped answering (reported in one line; exit status 2)."""


def default_model_dir(gin_files) -> str:
    name = os.path.splitext(os.path.basename(gin_files[-1]))[0] if gin_files else "run"
    return os.path.join("runs", name)


def training_batches(strategy, data_dir: str, train_config) -> Callable[[int], object]:
    """The trainer's `dataset_fn`: the prepared train split of `data_dir` as distributed batches from a step on
    (txl_tf.data.pipeline.distribute_dataset; the streams rotate per epoch with TrainConfig.rotate_streams)."""
    from txl_tf.data import pipeline

    rotate_seed = train_config.seed if train_config.rotate_streams else None

    def dataset_fn(start_step: int):
        return pipeline.distribute_dataset(strategy, data_dir, "train", train_config.batch_size,
                                           train_config.tgt_len, start_step=start_step, rotate_seed=rotate_seed)

    return dataset_fn


def check_configs(model_dir: str, gin_files, gin_params):
    """(the run directory's saved configs or None, this command's configs: exactly these files and bindings).

    A change of the architecture or the saved state is refused (ConfigError), other changes are printed in one
    line (this command's values are used); the prepared data must exist and its train split must fill one segment
    of every stream of the batch (`check_batch_fits`: before any model is built or any path measured).
    """
    from txl_tf import configs
    from txl_tf.runs import run_dir

    saved = run_dir.saved_configs(model_dir)
    made = configs.parse_configs(gin_files, gin_params)
    if saved is not None:
        # "auto" fields resume on the path the run recorded (`run`); a path that changes anyway gets its own line
        # once the trainer knows which it runs (`path_change`).
        changes = [c for c in configs.compare_configs(model_dir, saved, made)
                   if not c.startswith(tuple(f"TrainConfig.{f}" for f in autotune.FIELDS))]
        if changes:
            print(f"{len(changes)} binding(s) differ from {os.path.join(model_dir, run_dir.CONFIG_FILE)} "
                  f"(this command's values are used): {'; '.join(changes)}", flush=True)
    data = made.data
    if not os.path.isdir(data.data_dir):
        raise ConfigError(
            f"DataConfig.data_dir={data.data_dir!r} does not exist; prepare it with "
            f"`python -m txl_tf.data.prepare --dataset={data.dataset} --data_dir={data.data_dir}` "
            "or set --gin_param=\"DATA_DIR='...'\"")
    check_batch_fits(data.data_dir, made.train)
    return saved, made


def check_batch_fits(data_dir: str, train_config, split: str = "train") -> None:
    """Raises ConfigError unless `split` of the prepared `data_dir` holds one segment for every one of the
    TrainConfig's batch_size streams: batch_size x (tgt_len + 1) tokens (`txl_tf.data.pipeline.StreamLayout`).
    Reads only metadata.json, so a batch far too large is one line before a model is built or measured."""
    from txl_tf.data import pipeline

    batch, length = train_config.batch_size, train_config.tgt_len
    if not (isinstance(batch, int) and isinstance(length, int) and batch >= 1 and length >= 1):
        return  # the trainer's checks name these
    try:
        tokens = int(pipeline.load_metadata(data_dir)["splits"][split]["num_tokens"])
    except (KeyError, TypeError, ValueError):
        return  # a missing or damaged split: reading it says what is wrong
    need = batch * (length + 1)
    if tokens >= need:
        return
    most = tokens // (length + 1)
    fix = (f"set TrainConfig.batch_size to at most {most} (or lower tgt_len, or prepare more data)" if most else
           f"set TrainConfig.batch_size to 1 and tgt_len to at most {max(tokens - 1, 1)}, or prepare more data")
    raise ConfigError(f"TrainConfig.batch_size={batch} is too large for the {split} split of {data_dir} ({tokens} "
                      f"tokens): {batch} streams of tgt_len={length} need at least batch_size x (tgt_len + 1) = "
                      f"{need} tokens; {fix}")


def run(gin_files=(), gin_params=(), model_dir=None, strategy="default", tpu=None) -> dict:
    """Checks the configuration (and a run directory's saved one) and puts the run together: the strategy, the
    global seeds, the vocabulary and training batches of the prepared data, the trainer (the step), its restored
    state, the checkpoint managers and the controller (the loop, with the evaluation and sample actions); trains.

    Returns the last metrics. Expected user errors raise txl_tf.base.errors.UserError before anything is written.
    """
    import gin

    from txl_tf import configs
    from txl_tf.base.run_lock import RunLock
    from txl_tf.data import pipeline
    from txl_tf.runs import run_dir
    from txl_tf.training import distribute
    from txl_tf.training.controller import Controller, checkpoint_managers, default_actions
    from txl_tf.training.trainer import Trainer, set_global_seeds

    if not gin_files:
        raise ConfigError("no --gin_file given; pass a setup, e.g. --gin_file=gin/sample.gin")
    model_dir = default_model_dir(gin_files) if model_dir is None else paths.output_dir(model_dir, "--model_dir")
    saved, made = check_configs(model_dir, gin_files, gin_params)
    data_config = made.data
    strategy_obj = distribute.make_strategy(strategy, tpu)  # before other TensorFlow work (multi-worker needs it)
    vocab = pipeline.load_vocab(data_config.data_dir)
    if made.model.n_token is not None:
        pipeline.check_vocab_size(data_config.data_dir, made.model.n_token)
    if saved is not None:  # a resume: another vocabulary is refused before anything in the run folder changes
        run_dir.check_vocabulary(model_dir, data_config.data_dir, "resume training")
    # and another architecture than its checkpoints hold (an edited config.gin: its record beside them)
    run_dir.check_architecture(model_dir, configs.architecture(made.model, len(vocab)), "resume training")
    chief = distribute.is_chief(strategy_obj)
    # One writer per run directory (the chief's; other workers write only their own temporary folders).
    with RunLock(model_dir) if chief else contextlib.nullcontext():
        set_global_seeds(made.train)
        # A resumed run keeps the path its config.gin recorded for the fields this command leaves "auto".
        train_config = autotune.with_recorded_path(made.train, saved.train if saved is not None else None)
        trainer = Trainer(made.model, train_config, strategy=strategy_obj, n_token=len(vocab),
                          dataset_fn=training_batches(strategy_obj, data_config.data_dir, made.train))
        change = path_change(model_dir, saved, trainer.path)
        if change:
            print(change, flush=True)
        print(f"training in {model_dir} with strategy {strategy} ({strategy_obj.num_replicas_in_sync} replica(s))",
              flush=True)
        try:
            run_dir.resume_training(model_dir, trainer.restore_checkpoint, chief=chief,
                                    log=functools.partial(print, flush=True))
            checkpoints = checkpoint_managers(trainer.checkpoint, model_dir, strategy=strategy_obj,
                                                      step_counter=trainer.step_var,
                                                      keep=made.train.keep_checkpoints)
            controller = Controller(
                trainer, checkpoints, model_dir=model_dir, level=vocab.level,
                actions=default_actions(trainer, made.eval, data_dir=data_config.data_dir, vocab=vocab),
                config_str=with_path(gin.operative_config_str(), made.train, trainer))
            return controller.train()
        except Exception as error:  # noqa: BLE001  (re-raised unless a multi-worker peer was lost)
            lost = distribute.lost_worker(error, strategy_obj)
            if lost is None:
                raise
            import tensorflow as tf

            newest = tf.train.latest_checkpoint(model_dir)
            raise WorkerLostError(
                f"lost a worker: {lost}; this worker stopped too. The newest complete checkpoint in {model_dir} is "
                f"{newest or 'none yet'}; restart the lost worker and re-run the same command on every worker "
                "to resume from it") from None


def with_path(config_str: str, requested, trainer) -> str:
    """The config.gin text of a run: `config_str`, plus bindings of the path the trainer runs (`trainer.path`)
    where it is not what TrainConfig `requested` says ("auto" measured, or "fused" kernels that could not run),
    so the file records the path that trained and a resumed run keeps it.

    Only text this function makes goes into the file: the values of the known choices, the names of the known
    paths (`autotune.PATH_NAMES`) and rates it formats itself; the measured rates may come from the autotune cache,
    a file someone else could have written, and the fallback's reason is folded into one comment line."""
    lines = []
    for name, value in trainer.path.bindings().items():
        if getattr(requested, name) == value:
            continue
        binding = f"TrainConfig.{name} = {_GIN_VALUES[value]}"
        if getattr(requested, name) == autotune.AUTO:
            lines.append(binding)
        else:
            lines.append(_comment(f"TrainConfig.{name}={getattr(requested, name)!r} was asked for, but "
                                  f"{trainer.kernels_fallback}: this run trained with {_GIN_VALUES[value]}.") +
                         f"\n{binding}")
    if not lines:
        return config_str
    measured = "; ".join(f"{path}: {rate:.0f} tokens/s" for path, rate in trainer.path_measured.items()
                         if path in autotune.PATH_NAMES and _is_rate(rate))
    header = f"# The path this run trained on ({trainer.path.describe()})" + (
        f", measured here: {measured}" if measured else "") + "."
    return f"{config_str.rstrip()}\n\n{header}\n" + "\n".join(lines) + "\n"


# The gin text of each value a path's field may have (keys compare equal to True, False and the kernel names only).
_GIN_VALUES = {True: "True", False: "False", **{k: repr(k) for k in autotune.KERNEL_CHOICES}}


def _is_rate(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _comment(text: str) -> str:
    """`text` as one gin comment line (every kind of line break folded into a space)."""
    return "# " + " ".join(str(text).splitlines())


def path_change(model_dir: str, saved, path) -> str | None:
    """The one line a resumed run prints when its saved config.gin (`saved`, None for a new run) recorded another
    path than `path` (the trainer's `TrainPath`): other kernels draw other dropout masks and another precision
    rounds otherwise, so the run from here is no longer the one an uninterrupted run would have been. None
    otherwise (also when no checkpoint exists yet)."""
    from txl_tf.runs import run_dir

    if saved is None or not run_dir.candidates(model_dir):
        return None
    recorded = {name: getattr(saved.train, name) for name in autotune.FIELDS}
    if autotune.AUTO in recorded.values() or recorded == path.bindings():
        return None
    return (f"{model_dir} trained on {autotune.TrainPath(**recorded).describe()} ({run_dir.CONFIG_FILE}) and "
            f"resumes on {path.describe()}: from here its weights are no longer bit for bit those of an "
            "uninterrupted run")


def main(argv):
    cli.no_arguments(argv, "give settings as --gin_param (see --helpshort)")
    autotune.choose_onednn(functools.partial(print, flush=True))  # before TensorFlow starts
    run(FLAGS.gin_file, FLAGS.gin_param, FLAGS.model_dir, FLAGS.strategy, FLAGS.tpu)


if __name__ == "__main__":
    cli.run(main, define_flags)
