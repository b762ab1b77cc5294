r"""Train Transformer-XL: everything but infrastructure is configured with gin.

    python -m txl_tf.train --gin_file=gin/enwik8.gin
    python -m txl_tf.train --gin_file=gin/sample.gin --model_dir=runs/sample \
        --gin_param="DATA_DIR='data/enwik8_sample'" --gin_param="TrainConfig.mixed_precision=False"
    python -m txl_tf.train --gin_file=gin/wt103.gin --strategy=mirrored
    scripts/launch_local_multiworker.sh 2 --gin_file=gin/sample.gin --model_dir=runs/mw

Re-running the same command resumes from the latest checkpoint in --model_dir (default: runs/<gin file name>).
SIGTERM / Ctrl-C save a checkpoint and exit cleanly. A gin file is found as given, else in the repository's gin/
folder, so `--gin_file=enwik8.gin` works from any directory; `include` lines resolve the same way.
"""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import flags  # noqa: E402
from absl import logging as absl_logging  # noqa: E402

from txl_tf import errors  # noqa: E402
from txl_tf.distribute import STRATEGIES  # noqa: E402
from txl_tf.errors import ConfigError, UserError  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The infrastructure flags; defined only when this module is the program (importing `run` defines none,
    so other entry points with the same flag names can be imported beside it)."""
    flags.DEFINE_multi_string("gin_file", [], "Gin config files, applied in order (e.g. gin/enwik8.gin).")
    flags.DEFINE_multi_string("gin_param", [], "Gin bindings applied after the files, e.g. "
                              "TrainConfig.train_steps=10.")
    flags.DEFINE_string("model_dir", None, "Checkpoints, config.gin and TensorBoard logs (default runs/<gin name>).")
    flags.DEFINE_enum("strategy", "default", list(STRATEGIES), "tf.distribute strategy.")
    flags.DEFINE_string("tpu", None, "TPU name or address for --strategy=tpu.")


class WorkerLostError(UserError):
    """A peer of a multi-worker run died or stopped answering (reported in one line; exit status 2)."""


def default_model_dir(gin_files) -> str:
    name = os.path.splitext(os.path.basename(gin_files[-1]))[0] if gin_files else "run"
    return os.path.join("runs", name)


def run(gin_files=(), gin_params=(), model_dir=None, strategy="default", tpu=None) -> dict:
    """Checks the configuration (and a run directory's saved one), builds the strategy, the trainer (the step)
    and the controller (the loop, with the evaluation and sample actions) and trains.

    Returns the last metrics. Expected user errors raise txl_tf.errors.UserError before anything is written.
    """
    import gin

    from txl_tf import distribute, run_dir
    from txl_tf.controller import Controller, default_actions
    from txl_tf.run_lock import RunLock
    from txl_tf.trainer import Trainer

    if not gin_files:
        raise ConfigError("no --gin_file given; pass a setup, e.g. --gin_file=gin/sample.gin")
    model_dir = model_dir or default_model_dir(gin_files)
    saved = run_dir.saved_configs(model_dir)
    made = run_dir.parse_configs(gin_files=gin_files, gin_params=gin_params)  # exactly these files and bindings
    if saved is not None:
        changes = run_dir.compare_configs(model_dir, saved, made)
        if changes:
            print(f"{len(changes)} binding(s) differ from {os.path.join(model_dir, run_dir.CONFIG_FILE)} "
                  f"(this command's values are used): {'; '.join(changes)}", flush=True)
    data_config = made.data
    if not os.path.isdir(data_config.data_dir):
        raise ConfigError(
            f"DataConfig.data_dir={data_config.data_dir!r} does not exist; prepare it with "
            f"`python -m txl_tf.data.prepare --dataset={data_config.dataset} --data_dir={data_config.data_dir}` "
            "or set --gin_param=\"DATA_DIR='...'\"")
    strategy_obj = distribute.make_strategy(strategy, tpu)
    # One writer per run directory (the chief's; other workers write only their own temporary folders).
    with RunLock(model_dir) if distribute.is_chief(strategy_obj) else contextlib.nullcontext():
        trainer = Trainer(made.model, data_config, made.train, strategy=strategy_obj)
        controller = Controller(trainer, model_dir=model_dir, actions=default_actions(trainer, made.eval),
                                config_str=gin.operative_config_str())
        print(f"training in {model_dir} with strategy {strategy} ({strategy_obj.num_replicas_in_sync} replica(s))",
              flush=True)
        try:
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


def main(argv):
    if len(argv) > 1:
        raise ConfigError(f"unexpected arguments {argv[1:]}; give settings as --gin_param (see --helpshort)")
    absl_logging.set_verbosity(absl_logging.WARNING)  # gin's and TF's INFO lines (one per collective) drown the log
    run(FLAGS.gin_file, FLAGS.gin_param, FLAGS.model_dir, FLAGS.strategy, FLAGS.tpu)


if __name__ == "__main__":
    define_flags()
    errors.run(main)
