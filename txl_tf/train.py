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

import logging
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402
from absl import logging as absl_logging  # noqa: E402

from txl_tf.distribute import STRATEGIES  # noqa: E402

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

GIN_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gin")


def resolve_gin_file(path: str) -> str:
    """`path` if it exists, else the file of that name in the repository's gin/ folder."""
    if os.path.exists(path):
        return path
    for candidate in (os.path.join(GIN_DIR, path), os.path.join(GIN_DIR, os.path.basename(path))):
        if os.path.exists(candidate):
            return candidate
    raise FileNotFoundError(f"gin file {path!r} not found (looked in the working directory and {GIN_DIR}); "
                            f"available: {', '.join(sorted(f for f in os.listdir(GIN_DIR) if f.endswith('.gin')))}"
                            if os.path.isdir(GIN_DIR) else f"gin file {path!r} not found")


def parse_gin(gin_files, gin_params) -> list:
    """Parses the files (includes resolved against each file's folder and gin/) and bindings; returns paths."""
    import gin

    import txl_tf.configs  # noqa: F401  (registers the configurables)

    paths = [resolve_gin_file(p) for p in gin_files]
    for directory in dict.fromkeys([os.path.dirname(os.path.abspath(p)) for p in paths] + [GIN_DIR]):
        gin.add_config_file_search_path(directory)
    quiet = _DropMessages("Path not found")  # gin logs every search-path miss of an include before a hit
    logging.getLogger().addFilter(quiet)
    try:
        gin.parse_config_files_and_bindings(paths, list(gin_params))
    finally:
        logging.getLogger().removeFilter(quiet)
    return paths


class _DropMessages(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def default_model_dir(gin_files) -> str:
    name = os.path.splitext(os.path.basename(gin_files[-1]))[0] if gin_files else "run"
    return os.path.join("runs", name)


def run(gin_files=(), gin_params=(), model_dir=None, strategy="default", tpu=None) -> dict:
    """Parses the configuration, builds the strategy and trains; returns the last metrics."""
    import gin

    from txl_tf import distribute
    from txl_tf.configs import DataConfig, EvalConfig, ModelConfig, TrainConfig
    from txl_tf.trainer import Trainer

    if not gin_files:
        raise ValueError("give at least one --gin_file (e.g. gin/sample.gin)")
    parse_gin(gin_files, gin_params)
    model_dir = model_dir or default_model_dir(gin_files)
    strategy_obj = distribute.make_strategy(strategy, tpu)
    configs = dict(model_config=ModelConfig(), data_config=DataConfig(), train_config=TrainConfig(),
                   eval_config=EvalConfig())
    if not os.path.isdir(configs["data_config"].data_dir):
        raise FileNotFoundError(
            f"DataConfig.data_dir={configs['data_config'].data_dir!r} does not exist; prepare it with "
            f"`python -m txl_tf.data.prepare --dataset={configs['data_config'].dataset} "
            f"--data_dir={configs['data_config'].data_dir}` or set --gin_param=\"DATA_DIR='...'\"")
    trainer = Trainer(**configs, strategy=strategy_obj, model_dir=model_dir,
                      config_str=gin.operative_config_str())
    print(f"training in {model_dir} with strategy {strategy} ({strategy_obj.num_replicas_in_sync} replica(s))",
          flush=True)
    return trainer.train()


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    absl_logging.set_verbosity(absl_logging.WARNING)  # gin's and TF's INFO lines (one per collective) drown the log
    run(FLAGS.gin_file, FLAGS.gin_param, FLAGS.model_dir, FLAGS.strategy, FLAGS.tpu)


if __name__ == "__main__":
    define_flags()
    app.run(main)
