"""Helpers shared by the training tests: tiny corpora prepared by the real data pipeline, tiny gin overrides, tiny
in-process trainers and controllers."""

from __future__ import annotations

import os
import random
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_WORDS = ("the memory of a segment is reused as context for the next one while gradients stop at the boundary "
          "relative positions keep the attention consistent across segments so the model sees longer text "
          "characters words and sentences form streams that every replica keeps").split()


def tiny_text(n_lines: int = 400, seed: int = 0) -> str:
    """Deterministic English-like lines (a small vocabulary, some structure to learn)."""
    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 12))]
        lines.append(f"{i % 7} " + " ".join(words) + ".")
    return "\n".join(lines) + "\n"


def prepare_tiny_corpus(directory: str, level: str = "char", n_lines: int = 400) -> str:
    """Writes a tiny text and prepares it with `txl_tf.data.prepare` (dataset `text`); returns the data_dir."""
    from txl_tf.data import corpora, prepare

    source = os.path.join(directory, f"tiny_{level}.txt")
    with open(source, "w") as f:
        f.write(tiny_text(n_lines))
    data_dir = os.path.join(directory, f"tiny_{level}")
    prepare.prepare("text", data_dir, corpora.PrepareSettings(source=source, level=level, cache_dir=directory))
    return data_dir


def tiny_params(data_dir: str, **overrides) -> list:
    """Gin bindings that shrink any setup to a seconds-long CPU run on `data_dir`."""
    params = {
        "DATA_DIR": repr(data_dir),
        "ModelConfig.n_layer": 2, "ModelConfig.d_model": 16, "ModelConfig.n_head": 2, "ModelConfig.d_head": 8,
        "ModelConfig.d_inner": 24, "ModelConfig.mem_len": 6, "ModelConfig.dropout": 0.0,
        "ModelConfig.dropatt": 0.0,
        "TrainConfig.batch_size": 4, "TrainConfig.tgt_len": 5, "TrainConfig.train_steps": 6,
        "TrainConfig.warmup_steps": 2, "TrainConfig.learning_rate": 1e-3, "TrainConfig.steps_per_loop": 2,
        "TrainConfig.log_every": 2, "TrainConfig.eval_every": 0, "TrainConfig.checkpoint_every": 3,
        "TrainConfig.sample_tokens": 0, "TrainConfig.measure_mfu": False, "TrainConfig.mixed_precision": False,
        "TrainConfig.jit_compile": False, "TrainConfig.kernels": "'tf'",
        "EvalConfig.tgt_len": 4, "EvalConfig.mem_len": 8, "EvalConfig.clamp_len": -1, "EvalConfig.batch_size": 3,
        "EvalConfig.max_steps": 2,
    }
    params.update(overrides)
    return [f"{key} = {value}" for key, value in params.items()]


def train_command(model_dir: str, params: list, gin_file: str = "gin/sample.gin", strategy: str = "default") -> list:
    """argv of `python -m txl_tf.train` for a subprocess."""
    command = [sys.executable, "-m", "txl_tf.train", f"--gin_file={gin_file}", f"--model_dir={model_dir}",
               f"--strategy={strategy}"]
    return command + [f"--gin_param={p}" for p in params]


def subprocess_env() -> dict:
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    env.pop("TF_CONFIG", None)
    return env


def run_training(model_dir: str, params: list, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """Runs `python -m txl_tf.train` to completion; raises with its output when it fails."""
    result = subprocess.run(train_command(model_dir, params, **kwargs), cwd=REPO_ROOT, env=subprocess_env(),
                            capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"training failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


def checkpoint_weights(prefix: str) -> dict:
    """Model weights of a checkpoint by name (the pinned key `model`)."""
    import tensorflow as tf

    reader = tf.train.load_checkpoint(prefix)
    return {name: reader.get_tensor(name) for name, _ in tf.train.list_variables(prefix)
            if name.startswith("model/") and "OPTIMIZER_SLOT" not in name}


B, L, M = 4, 5, 6  # global batch, tgt_len, mem_len of `tiny_trainer` (pairwise distinct)
TINY_EVAL = dict(tgt_len=4, mem_len=7, clamp_len=-1, same_length=True, batch_size=3, max_steps=3)


def make_trainer(model_config, train_config, data_dir: str, strategy: str = "default"):
    """A txl_tf.training.trainer.Trainer on the prepared `data_dir`, put together as txl_tf.train.run does: the global seeds
    first, the data's vocabulary size, the distributed train batches (`train.training_batches`)."""
    from txl_tf.data import pipeline
    from txl_tf.train import training_batches
    from txl_tf.training import distribute
    from txl_tf.training.trainer import Trainer, set_global_seeds

    strategy = distribute.make_strategy(strategy)
    set_global_seeds(train_config)
    return Trainer(model_config, train_config, strategy=strategy, n_token=len(pipeline.load_vocab(data_dir)),
                   dataset_fn=training_batches(strategy, data_dir, train_config))


def tiny_train_config(**train):
    """The TrainConfig of `tiny_trainer`: fields as keywords."""
    from txl_tf.configs import TrainConfig

    settings = dict(batch_size=B, tgt_len=L, train_steps=3, warmup_steps=0, learning_rate=1e-3, steps_per_loop=2,
                    log_every=1, eval_every=0, checkpoint_every=0, sample_tokens=0, measure_mfu=False,
                    mixed_precision=False, jit_compile=False, kernels="tf")  # "auto" (the default) is measured
    settings.update(train)
    return TrainConfig(**settings)


def tiny_model_config(**model):
    """The ModelConfig of `tiny_trainer` (1 layer, mem_len M, no dropout): fields as keywords."""
    from txl_tf.configs import ModelConfig

    return ModelConfig(n_layer=1, d_model=16, n_head=2, d_head=8, d_inner=24, mem_len=M, dropout=0.0, dropatt=0.0,
                       **model)


def tiny_trainer(data_dir: str, strategy: str = "default", model: dict | None = None, **train):
    """A txl_tf.training.trainer.Trainer of a 1-layer model on `data_dir`; TrainConfig fields as keywords."""
    return make_trainer(tiny_model_config(**(model or {})), tiny_train_config(**train), data_dir, strategy)


V = 11  # vocabulary of the in-memory batches


def repeated_batch(seed: int = 0):
    """(inputs, targets) int32 [B, L]: one batch of B streams of random tokens (targets = inputs shifted by one)."""
    import numpy as np

    streams = np.random.default_rng(seed).integers(0, V, [B, L + 1]).astype(np.int32)
    return streams[:, :-1], streams[:, 1:]


def in_memory_trainer(starts: list | None = None, model: dict | None = None, **train):
    """A Trainer of `tiny_trainer`'s model (vocabulary V) under the default strategy, fed by one in-memory batch
    repeated (`repeated_batch`; no corpus, no data directory). Each step its dataset_fn is asked to start at is
    appended to `starts`. TrainConfig fields as keywords."""
    import tensorflow as tf

    from txl_tf.training.trainer import Trainer, set_global_seeds

    batch = repeated_batch()

    def dataset_fn(start_step: int):
        if starts is not None:
            starts.append(start_step)
        return tf.data.Dataset.from_tensors(batch).repeat()

    config = tiny_train_config(**train)
    set_global_seeds(config)
    return Trainer(tiny_model_config(**(model or {})), config, strategy=tf.distribute.get_strategy(), n_token=V,
                   dataset_fn=dataset_fn)


def tiny_controller(trainer, model_dir, data_dir: str | None = None, evaluation: dict | None = None,
                    actions=None, **kwargs):
    """A txl_tf.training.controller.Controller of `trainer` in `model_dir`, put together as txl_tf.train.run does: the
    trainer restored from model_dir's newest checkpoint (if any), then the checkpoint managers. Its actions are
    `actions`, else the default ones on `data_dir` (evaluation with TINY_EVAL updated by `evaluation`, samples);
    the metric's level is the data's ("char" without data). No console output unless `log` is given."""
    from txl_tf.configs import EvalConfig
    from txl_tf.data import pipeline
    from txl_tf.runs import run_dir
    from txl_tf.training.controller import Controller, checkpoint_managers, default_actions

    kwargs.setdefault("log", lambda line: None)
    model_dir = str(model_dir)
    run_dir.resume_training(model_dir, trainer.restore_checkpoint, chief=True, log=kwargs["log"])
    checkpoints = checkpoint_managers(trainer.checkpoint, model_dir, strategy=trainer.strategy,
                                              step_counter=trainer.step_var, keep=trainer.config.keep_checkpoints)
    vocab = pipeline.load_vocab(data_dir) if data_dir else None
    if actions is None:
        actions = default_actions(trainer, EvalConfig(**{**TINY_EVAL, **(evaluation or {})}), data_dir=data_dir,
                                  vocab=vocab)
    return Controller(trainer, checkpoints, model_dir=model_dir, level=vocab.level if vocab else "char",
                      actions=actions, **kwargs)


AVERAGE_CONFIG = dict(n_layer=1, d_model=8, n_head=2, d_head=3, d_inner=10, n_token=11, mem_len=4, dropout=0.0,
                      dropatt=0.0)


def make_run(directory, offsets):
    """For the averaging tests: a run directory with config.gin and one checkpoint per offset: the same model, every
    float weight + offset (saved like the trainer's: model, optimizer-like extras, numbered by step). Returns the
    float weights."""
    import tensorflow as tf

    from txl_tf import average
    from txl_tf.configs import ModelConfig
    from txl_tf.runs import loading

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.gin").write_text("".join(f"ModelConfig.{k} = {v!r}\n" for k, v in AVERAGE_CONFIG.items()))
    model = loading.build_model(ModelConfig(**AVERAGE_CONFIG))
    base = [v.numpy() for v in model.weights]
    step = tf.Variable(0, dtype=tf.int64)
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=model, step=step, extra=tf.Variable(1.0)),
                                         str(directory), max_to_keep=None, step_counter=step)
    saved = []
    for i, offset in enumerate(offsets):
        for variable, value in zip(model.weights, base, strict=True):
            if average.is_float(variable):
                variable.assign(value + offset)
        step.assign(10 * (i + 1))
        manager.save(checkpoint_number=10 * (i + 1))
        saved.append([v.numpy() for v in model.weights if average.is_float(v)])
    return saved
