"""The training step: Transformer-XL under `tf.distribute`, the optimizer and the state a checkpoint holds.

`Trainer` is the inner part of training (like orbit's StandardTrainer); `txl_tf.training.controller.Controller` is the
outer loop that decides when to train, evaluate, checkpoint, summarise and stop. The trainer gets what it uses:
the configs, the strategy, the vocabulary size and `dataset_fn(start_step)`, the training batches from a step on
(txl_tf.train builds them from the prepared data; a test can pass an in-memory `tf.data.Dataset`). The global
seeds are the caller's: `set_global_seeds` before the trainer is made.

One host loop (`train_loop`) is one call of a `tf.function` that runs `strategy.run(step)` for up to `num_steps`
steps (`tf.range`). Each replica owns a fixed block of the global batch's streams and carries its own memory
[n_layer, B/R, M, d] from step to step and from host loop to host loop as a per-replica value (zeroed only when a
run starts from scratch). A step:

  1. splits the replica's rows into `grad_accum_steps` chunks; each chunk is a contiguous block of streams with
     its own rows of the memory, so accumulation changes nothing but the peak activation memory;
  2. loss = sum of per-token NLL / number of tokens in the GLOBAL batch (token-weighted), so the gradients
     summed over replicas are the gradient of the global mean;
  3. all-reduces the gradient, clips it by global norm (the norm of the global gradient, as the original), and
     applies Adam. A non-finite gradient skips the update (the memory restarts at zeros); with
     `TrainConfig.nonfinite="stop"` the host loop ends at that step.

`checkpoint` (a `tf.train.Checkpoint`) holds the model (key `model`), optimizer, step, the memory of every stream
(gathered from all replicas, [n_layer, B, M, d] in stream order; key `mems`), the dropout RNG states (`rng`) and
the best validation loss. The data position is the step: the batch of step t is a pure function of t
(txl_tf.data.pipeline), so resuming at the checkpoint's step with its memory and RNG states continues exactly
where the run stopped. `sync_checkpoint(step)` writes the step and the gathered memory into the checkpoint's
variables; call it (on every worker) before saving.

What the autotuner ("auto" paths, `choose_path`) and scripts/benchmark_model.py time is this step: a
`timing_trainer` on random tokens, its `train_loop` timed by `step_seconds`.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import time
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf

from txl_tf.base.errors import ConfigError, UserError
from txl_tf.configs import ModelConfig, TrainConfig
from txl_tf.model import fused, upgrade
from txl_tf.model.policy import TrainingPolicy
from txl_tf.model.state import Memory
from txl_tf.runs import loading, run_dir
from txl_tf.training import autotune, distribute, schedules

# dataset_fn(start_step): (inputs, targets) global batches [B, L] int32 of steps start_step, start_step + 1, ...:
# distributed (txl_tf.data.pipeline.distribute_dataset: replica r gets streams [r*B/R, (r+1)*B/R)), or, with one
# replica, a plain tf.data.Dataset.
DatasetFn = Callable[[int], "tf.data.Dataset | tf.distribute.DistributedDataset"]


def set_global_seeds(config: TrainConfig) -> None:
    """Seeds Python, NumPy, Keras and TensorFlow with TrainConfig.seed and, with TrainConfig.deterministic, makes
    TensorFlow's ops deterministic. Call it before making the Trainer: the initial weights and the dropout
    streams come from these seeds."""
    keras.utils.set_random_seed(config.seed)
    if config.deterministic:
        tf.config.experimental.enable_op_determinism()


class NonFiniteLossError(UserError, RuntimeError):
    """Raised when a step's loss or gradient is not finite and TrainConfig.nonfinite == "stop"."""


@dataclasses.dataclass
class LoopStats:
    """Sums over the steps of one or more host loops (token-weighted)."""

    steps: int = 0
    nll_sum: float = 0.0
    tokens: int = 0
    grad_norm_sum: float = 0.0
    nonfinite: int = 0
    seconds: float = 0.0

    def add(self, other: LoopStats) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))

    @property
    def loss(self) -> float:
        return self.nll_sum / self.tokens if self.tokens else float("nan")


class Trainer:
    """The model, optimizer and distributed step of one run, fed by the batches it is given.

    Args:
      model_config, train_config: the gin dataclasses.
      strategy: a `tf.distribute.Strategy` (see txl_tf.training.distribute.make_strategy).
      dataset_fn: `dataset_fn(start_step)` gives the training batches from `start_step` on (see `DatasetFn`); the
        batch of a step must be a pure function of the step, so that a resumed run sees what an uninterrupted
        one would have.
      n_token: the vocabulary size (None: ModelConfig.n_token, which must then be bound).
      log: where the choice of an "auto" path and its measurement are reported (one line each).

    Use: `start(step)` once (the data position and the memory), then `train_loop(num_steps)` per host loop.

    `path` (a `txl_tf.training.autotune.TrainPath`) is what the steps run: TrainConfig.mixed_precision, jit_compile and
    kernels, with "auto" ones measured (`path_measured`: tokens/s of each candidate; the global seeds are set
    again afterwards), and "tf" kernels where the fused ones cannot run in this process (`kernels_fallback` then
    says why; None otherwise). `mixed_precision` and `kernels` repeat two of its fields.
    """

    def __init__(self, model_config: ModelConfig, train_config: TrainConfig, *, strategy: tf.distribute.Strategy,
                 dataset_fn: DatasetFn, n_token: int | None = None,
                 log: Callable[[str], None] = functools.partial(print, flush=True)):
        self.model_config, self.config = model_config, train_config
        self.strategy, self.dataset_fn = strategy, dataset_fn
        self._check_config()
        self.n_token = n_token if n_token is not None else model_config.n_token
        if self.n_token is None:
            raise ConfigError("the vocabulary size is unknown: bind ModelConfig.n_token or give the trainer n_token")
        self.global_batch = train_config.batch_size
        self.replicas = strategy.num_replicas_in_sync
        self.replica_batch = self.global_batch // self.replicas
        self.path, self.path_measured, self.kernels_fallback = self._resolve_path(log)
        self.mixed_precision, self.kernels = self.path.mixed_precision, self.path.kernels
        self._iterator = self.mems = None
        self._build()

    # ---- set-up -----------------------------------------------------------------------------------------
    def _check_config(self) -> None:
        """The checks that need the strategy; every field's own range was checked when the TrainConfig was made
        (`txl_tf.configs.validate`, `check_together`)."""
        c = self.config
        replicas = self.strategy.num_replicas_in_sync
        if c.batch_size % replicas:
            raise ConfigError(f"TrainConfig.batch_size={c.batch_size} must be divisible by the {replicas} replicas")
        if (c.batch_size // replicas) % c.grad_accum_steps:
            raise ConfigError(f"the per-replica batch {c.batch_size // replicas} must be divisible by "
                             f"TrainConfig.grad_accum_steps={c.grad_accum_steps}")

    def _resolve_path(self, log) -> tuple[autotune.TrainPath, dict, str | None]:
        """(the path this trainer's steps run, {candidate: tokens/s} when "auto" measured, why the kernels are
        not TrainConfig.kernels or None), decided once here.

        "auto" fields are measured (`choose_path`: this module's step on each candidate; in a multi-worker run
        every worker takes the chief's choice). "fused" runs where the strategy computes on CPUs only and the
        kernels build and load (`fused.unavailable`); otherwise the step runs TensorFlow's ops and one warning
        says why.
        """
        c = self.config
        accelerators = sorted(distribute.device_kinds(self.strategy) & {"GPU", "TPU"})
        why = None
        if c.kernels in ("fused", "auto"):
            why = (f"the strategy computes on {' and '.join(accelerators)} and the kernels are CPU-only"
                   if accelerators else fused.unavailable())
        measured = {}
        if autotune.auto_fields(c):
            chunk = self.replica_batch // c.grad_accum_steps
            paths = autotune.candidates(c, accelerators=accelerators, fused_why=why)
            path, measured = choose_path(self.model_config.model_kwargs(self.n_token), c, chunk,
                                         accelerators=accelerators, fused_why=why, log=log)
            if distribute.is_multi_worker(self.strategy):
                path = paths[distribute.broadcast_from_chief(self.strategy, paths.index(path))]
            set_global_seeds(c)  # the measurement drew from the global random state; the run starts afresh
        else:
            path = autotune.TrainPath(bool(c.mixed_precision), bool(c.jit_compile), c.kernels)
        if path.kernels == "fused" and why is not None:
            logging.warning("txl_tf: TrainConfig.kernels='fused' but %s; training with TensorFlow's ops "
                            "(TrainConfig.kernels='tf' silences this)", why)
            return dataclasses.replace(path, kernels="tf"), measured, why
        return path, measured, None

    def _build(self) -> None:
        policy = "mixed_bfloat16" if self.mixed_precision else "float32"
        with loading.dtype_policy(policy), self.strategy.scope():
            self.model = loading.build_model(self.model_config, self.n_token, check=False)
            self.policy = TrainingPolicy.of(self.kernels, self.config.recompute)  # passed to every training call
            self.schedule = schedules.learning_rate_schedule(self.config)
            self.optimizer = schedules.make_optimizer(self.config, self.schedule)
            self.optimizer.build(self.model.trainable_variables)
        model = self.model
        self.compute_dtype = model.compute_dtype
        # Host-side state saved with the checkpoint (plain variables: identical on every worker).
        self.step_var = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        self.best_loss = tf.Variable(np.inf, dtype=tf.float64, trainable=False, name="best_valid_loss")
        self.saved_mems = tf.Variable(
            tf.zeros([model.n_layer, self.global_batch, model.mem_len, model.d_model], self.compute_dtype),
            trainable=False, name="mems")
        rng = [v for v in model.variables if "seed_generator_state" in v.path]  # dropout streams
        state = dict(model=model, optimizer=self.optimizer, step=self.step_var, best_valid_loss=self.best_loss,
                     rng={f"state_{i}": v for i, v in enumerate(rng)})
        if self.config.checkpoint_memory:
            state["mems"] = self.saved_mems
        self.checkpoint = tf.train.Checkpoint(**state)
        # Set by a stop request (SIGTERM / SIGINT, from a thread while a host loop runs; txl_tf.training.controller);
        # the host loop ends after the step during which any worker's flag was set. Not checkpointed.
        self.stop_flag = tf.Variable(False, trainable=False, name="stop_requested")
        self._loop_fn = tf.function(self._host_loop)
        self._grad_fn = tf.function(self._loss_and_grads, jit_compile=True) if self.path.jit_compile \
            else self._loss_and_grads

    def num_parameters(self) -> int:
        return int(sum(np.prod(v.shape) for v in self.model.trainable_variables))

    def restore_checkpoint(self, prefix: str) -> None:
        """Restores the whole training state from `prefix`; every object of it must be in the checkpoint. A checkpoint
        of the attention's old layout (`txl_tf.model.upgrade`) is one line: its weights load, its optimizer state cannot."""
        if upgrade.legacy_checkpoint(prefix):
            raise run_dir.RunDirError(
                f"{prefix} was written before the attention's projections became Keras layers (txl_tf.model.upgrade): "
                "its weights still load for evaluate, generate, export and average, but its optimizer state cannot "
                "resume training; train into a new --model_dir with --gin_param=\"TrainConfig.init_checkpoint="
                f"'{prefix}'\" (its weights, a fresh optimizer)")
        self.checkpoint.restore(prefix).assert_existing_objects_matched()

    def start(self, step: int) -> None:
        """Positions the training data at `step` (`dataset_fn(step)`) and sets the memory: the restored one when
        resuming at a step > 0 with TrainConfig.checkpoint_memory, else zeros."""
        resume_memory = step and self.config.checkpoint_memory
        self.mems = self._distribute_mems(self.saved_mems if resume_memory else tf.zeros_like(self.saved_mems))
        dataset = self.dataset_fn(step)
        if isinstance(dataset, tf.data.Dataset) and self.replicas > 1:
            raise ValueError(f"dataset_fn gave a tf.data.Dataset, which feeds one replica; for the {self.replicas} "
                             "replicas give a distributed dataset (txl_tf.data.pipeline.distribute_dataset)")
        self._iterator = iter(dataset)

    def request_stop(self) -> None:
        """Ends the running host loop after its current step (safe to call from another thread)."""
        self.stop_flag.assign(True)

    def train_loop(self, num_steps: int) -> LoopStats:
        """One host loop of up to `num_steps` steps (fewer when a step is non-finite in "stop" mode, or after
        `request_stop`)."""
        start = time.perf_counter()
        self.mems, out = self._loop_fn(self._iterator, self.mems, tf.constant(num_steps, tf.int32))
        done, nll_sum, tokens, norm_sum, bad = (x.numpy() for x in out)
        return LoopStats(int(done), float(nll_sum), int(tokens), float(norm_sum), int(bad),
                         time.perf_counter() - start)

    def sync_checkpoint(self, step: int) -> None:
        """Writes `step` and the memory gathered from all replicas into the checkpoint's variables.

        Every worker must call it before a save (the gather is a collective in multi-worker runs).
        """
        self.step_var.assign(step)
        if self.config.checkpoint_memory:
            self.saved_mems.assign(tf.cast(self._gather_mems(self.mems), self.saved_mems.dtype))

    # ---- the step ---------------------------------------------------------------------------------------
    def _loss_and_grads(self, inputs, targets, mems):
        """Per replica: (sum of weighted NLL, gradient of sum/global tokens, new memory), chunk by chunk."""
        variables = self.model.trainable_variables
        length = self.config.tgt_len
        weights = tf.constant(self._np_weights(length))  # [L]
        global_tokens = float(self.global_batch * self._np_weights(length).sum())
        chunks = self.config.grad_accum_steps
        rows = self.replica_batch // chunks
        nll_sum, grads, new_mems = tf.constant(0.0, tf.float32), None, []
        for c in range(chunks):  # each chunk = a contiguous block of streams with its own memory rows
            part = slice(c * rows, (c + 1) * rows)
            with tf.GradientTape() as tape:
                hidden, chunk_memory = self.model(inputs[part], Memory(mems).select_rows(part.start, part.stop),
                                                  training=True, policy=self.policy)  # [b, L, d]
                nll = self.model.nll(hidden, targets[part]) * weights  # [b, L] float32
                chunk_sum = tf.reduce_sum(nll)
                loss = chunk_sum / global_tokens
            chunk_grads = tape.gradient(loss, variables)
            if chunks > 1:
                chunk_grads = [tf.convert_to_tensor(g) for g in chunk_grads]
            grads = chunk_grads if grads is None else [a + b for a, b in zip(grads, chunk_grads, strict=True)]
            nll_sum += chunk_sum
            new_mems.append(chunk_memory.hidden)
        new_mems = new_mems[0] if chunks == 1 else tf.concat(new_mems, axis=Memory.BATCH_AXIS)  # [n, b_replica, M, d]
        return nll_sum, grads, new_mems

    def _np_weights(self, length: int) -> np.ndarray:
        """[L] per-position loss weights: 1, or only the most recent half of the segment (ablation)."""
        weights = np.ones([length], np.float32)
        if self.config.loss_recent_half:
            weights[: length // 2] = 0.0
        return weights

    def _replica_step(self, inputs, targets, mems):
        """One optimisation step on this replica's streams; returns (new memory, stats)."""
        ctx = tf.distribute.get_replica_context()
        variables = self.model.trainable_variables
        nll_sum, grads, new_mems = self._grad_fn(inputs, targets, mems)
        with tf.control_dependencies([nll_sum]):  # read after the step's work: a request during it ends the loop
            stop = tf.cast(self.stop_flag.read_value(), tf.float32)
        if self.replicas > 1:
            summed = ctx.all_reduce(tf.distribute.ReduceOp.SUM, [tf.convert_to_tensor(g) for g in grads])
            global_nll = ctx.all_reduce(tf.distribute.ReduceOp.SUM, nll_sum)
        else:
            summed, global_nll = grads, nll_sum
        grad_norm = tf.linalg.global_norm(summed)
        finite = tf.math.is_finite(grad_norm) & tf.math.is_finite(global_nll)
        clip = tf.constant(self.config.clip_norm, tf.float32)
        if self.replicas > 1:  # Keras sums the replicas' gradients again: pass the local ones, clipped
            factor = clip / tf.maximum(grad_norm, clip)
            to_apply = [g * factor for g in grads]
        else:
            to_apply, _ = tf.clip_by_global_norm(summed, clip, use_norm=grad_norm)

        def apply_update(grads_to_apply):
            self.optimizer.apply_gradients(zip(grads_to_apply, variables, strict=True))

        def cross_replica(strategy, grads_to_apply, finite_flags):
            finite_flag = strategy.experimental_local_results(finite_flags)[0]  # equal on every replica

            def skip():
                self.optimizer.iterations.assign_add(1)  # the schedule keeps counting steps

            # A cond in cross-replica context: apply_gradients synchronises replicas, which a cond in replica
            # context may not contain.
            tf.cond(finite_flag, lambda: strategy.extended.call_for_each_replica(
                apply_update, args=(grads_to_apply,)), skip)

        ctx.merge_call(cross_replica, args=(to_apply, finite))
        new_mems = tf.where(finite, new_mems, tf.zeros_like(new_mems))
        tokens = tf.constant(self.replica_batch * float(np.sum(self._np_weights(self.config.tgt_len))))
        return new_mems, (nll_sum, tokens, grad_norm, tf.cast(tf.logical_not(finite), tf.float32), stop)

    def _host_loop(self, iterator, mems, num_steps):
        """Up to `num_steps` steps in one tf.function; stops early on a non-finite step in "stop" mode."""
        strategy = self.strategy
        nll_sum = tf.constant(0.0, tf.float64)
        tokens = tf.constant(0.0, tf.float64)
        grad_norm_sum = tf.constant(0.0, tf.float64)
        nonfinite = tf.constant(0, tf.int32)
        steps = tf.constant(0, tf.int32)
        stop_on_nonfinite = self.config.nonfinite == "stop"
        for _ in tf.range(num_steps):
            if stop_on_nonfinite and nonfinite > 0:
                break
            inputs, targets = next(iterator)
            mems, stats = strategy.run(self._replica_step, args=(inputs, targets, mems))
            step_nll, step_tokens, step_norm, step_bad, step_stop = stats
            nll_sum += tf.cast(strategy.reduce(tf.distribute.ReduceOp.SUM, step_nll, axis=None), tf.float64)
            tokens += tf.cast(strategy.reduce(tf.distribute.ReduceOp.SUM, step_tokens, axis=None), tf.float64)
            grad_norm_sum += tf.cast(strategy.reduce(tf.distribute.ReduceOp.MEAN, step_norm, axis=None),
                                     tf.float64)
            nonfinite += tf.cast(strategy.reduce(tf.distribute.ReduceOp.MEAN, step_bad, axis=None) > 0, tf.int32)
            steps += 1
            # Every worker sees the same sum, so all of them end the loop after the same step.
            if strategy.reduce(tf.distribute.ReduceOp.SUM, step_stop, axis=None) > 0:
                break
        return mems, (steps, nll_sum, tokens, grad_norm_sum, nonfinite)

    # ---- memory -----------------------------------------------------------------------------------------
    def _distribute_mems(self, global_mems: tf.Tensor):
        """[n, B, M, d] in stream order -> per-replica [n, B/R, M, d] (replica r owns streams r*B/R ...)."""
        b = self.replica_batch
        mems = distribute.replica_values(self.strategy, lambda r: global_mems[:, r * b:(r + 1) * b])
        local = self.strategy.experimental_local_results(mems)
        # With one local replica strategy.run returns plain tensors: carry the same type through the loop.
        return local[0] if len(local) == 1 else mems

    def _gather_mems(self, mems) -> tf.Tensor:
        return distribute.gather_replicas(self.strategy, mems, axis=1)


# ---- timing the step: what the autotuner ("auto" paths) and scripts/benchmark_model.py measure ---------------
def timing_trainer(model_kwargs: dict, train_config: TrainConfig, batch: int, path: autotune.TrainPath) -> Trainer:
    """A started Trainer of `TransformerXL(**model_kwargs)` whose steps run `path`, with `train_config`'s other
    settings at `batch` streams without gradient accumulation, under the current (default) strategy, fed one
    batch of random tokens again and again (stateless: the global random state is not drawn from for the data)."""
    model_config = ModelConfig(**model_kwargs)
    config = dataclasses.replace(train_config, batch_size=batch, grad_accum_steps=1, **path.bindings())
    tokens = tf.random.stateless_uniform([batch, config.tgt_len + 1], [7, 11], 0, model_config.n_token, tf.int32)
    batches = tf.data.Dataset.from_tensors((tokens[:, :-1], tokens[:, 1:])).repeat()
    trainer = Trainer(model_config, config, strategy=tf.distribute.get_strategy(), dataset_fn=lambda step: batches,
                      log=lambda line: None)
    trainer.start(0)
    return trainer


def gradient_hlo(trainer: Trainer) -> bytes:
    """The serialized HloModuleProto of the XLA program of `trainer`'s gradient function (forward, token-weighted
    NLL, backward; a trainer on an XLA path) on its next batch: the program XLA compiles for the step, for timing it
    where TensorFlow does not run (scripts/benchmark_hlo.py)."""
    if not trainer.path.jit_compile:
        raise ValueError(f"the trainer's path {trainer.path} does not compile with XLA; give it jit_compile")
    inputs, targets = next(trainer._iterator)
    return trainer._grad_fn.experimental_get_compiler_ir(inputs, targets, trainer.mems)(stage="hlo_serialized")


def step_seconds(trainer: Trainer, steps: int, warmup: int = 1) -> float:
    """The median seconds of one step of `trainer.train_loop` (one step per host loop) over `steps`, after
    `warmup` untimed ones (tracing, XLA's compilation)."""
    times = [trainer.train_loop(1).seconds for _ in range(warmup + steps)][warmup:]
    return sorted(times)[len(times) // 2]


def choose_path(model_kwargs: dict, train_config: TrainConfig, batch: int, **kwargs) -> tuple[autotune.TrainPath, dict]:
    """`txl_tf.training.autotune.choose` (its keywords in `kwargs`) timing each candidate path with this module's step: a
    `timing_trainer` at the per-replica `batch` and `step_seconds`."""
    def time_step(path: autotune.TrainPath, steps: int) -> float:
        try:
            return step_seconds(timing_trainer(model_kwargs, train_config, batch, path), steps)
        finally:  # a Trainer is a reference cycle (its tf.functions): free its weights before the next candidate's
            gc.collect()

    return autotune.choose(model_kwargs, train_config, batch, time_step=time_step, **kwargs)
