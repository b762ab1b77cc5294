"""The training loop: Transformer-XL under `tf.distribute`, resumable, observable.

One host loop is one call of a `tf.function` that runs `strategy.run(step)` for up to `steps_per_loop` steps
(`tf.range`). Each replica owns a fixed block of the global batch's streams and carries its own memory
[n_layer, B/R, M, d] from step to step and from host loop to host loop as a per-replica value (zeroed only when a
run starts from scratch). A step:

  1. splits the replica's rows into `grad_accum_steps` chunks; each chunk is a contiguous block of streams with
     its own rows of the memory, so accumulation changes nothing but the peak activation memory;
  2. loss = sum of per-token NLL / number of tokens in the GLOBAL batch (token-weighted), so the gradients
     summed over replicas are the gradient of the global mean;
  3. all-reduces the gradient, clips it by global norm (the norm of the global gradient, as the original), and
     applies Adam. A non-finite gradient skips the update (the memory restarts at zeros); with
     `TrainConfig.nonfinite="stop"` training then stops, keeping the last good checkpoint.

Checkpoints (`tf.train.Checkpoint` + `CheckpointManager(step_counter=step)`) hold the model (key `model`),
optimizer, step, the memory of every stream (gathered from all replicas, [n_layer, B, M, d] in stream order),
the dropout RNG states and the best validation loss. The data position is the step: the batch of step t is a
pure function of t (txl_tf.data.pipeline), so resuming at the checkpoint's step with its memory and RNG states
continues exactly where the run stopped. SIGTERM / SIGINT save a checkpoint and end the run cleanly; in a
multi-worker run all workers agree on the stop at the next host-loop boundary.

Files in model_dir: config.gin (the effective gin config), ckpt-N.*, best/ckpt-N.* (best validation loss),
TensorBoard event files (train/ and valid/).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Optional

import keras
import numpy as np
import tensorflow as tf

from txl_tf import distribute, flops, run_dir, schedules
from txl_tf.configs import DataConfig, EvalConfig, ModelConfig, TrainConfig
from txl_tf.errors import ConfigError, UserError

CONFIG_FILE = "config.gin"
BEST_DIR = "best"
NONFINITE_MODES = ("stop", "skip")


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


def metric_name(level: str) -> str:
    return "bpc" if level == "char" else "ppl"


def level_metric(loss: float, level: str) -> float:
    """bits per character (char level) or perplexity (word level) of a mean NLL in nats."""
    return loss / math.log(2.0) if level == "char" else math.exp(min(loss, 700.0))


class _StopRequest:
    """SIGTERM / SIGINT handler: remembers the request; the loop saves and stops at the next boundary."""

    def __init__(self):
        self.requested = False
        self.previous = {}

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self.previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals stay with their current handlers
                return

    def uninstall(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}

    def _handle(self, signum, frame):
        del frame
        if self.requested and signum == signal.SIGINT:  # a second Ctrl-C stops at once
            raise KeyboardInterrupt
        self.requested = True
        print(f"\nreceived {signal.Signals(signum).name}: saving a checkpoint at the end of this host loop",
              file=sys.stderr, flush=True)


class Trainer:
    """Builds the model, optimizer, data and checkpoints for one run and trains it (`train()`).

    Args:
      model_config, data_config, train_config, eval_config: the gin dataclasses.
      strategy: a `tf.distribute.Strategy` (see txl_tf.distribute.make_strategy).
      model_dir: where checkpoints, config.gin and TensorBoard logs go (the chief's; other workers write
        to temporary directories inside it).
      config_str: the effective gin config to save as model_dir/config.gin (None: not written).
      log: where console lines go.
    """

    def __init__(self, model_config: ModelConfig, data_config: DataConfig, train_config: TrainConfig,
                 eval_config: EvalConfig, *, strategy: tf.distribute.Strategy, model_dir: str,
                 config_str: Optional[str] = None, log: Callable[[str], None] = functools.partial(print, flush=True)):
        self.model_config, self.data_config = model_config, data_config
        self.config, self.eval_config = train_config, eval_config
        self.strategy, self.model_dir, self.log = strategy, model_dir, log
        self.config_str = config_str
        self._check_config()
        self.chief = distribute.is_chief(strategy)
        self.write_dir = distribute.worker_dir(model_dir, strategy)

        from txl_tf.data import pipeline

        self.pipeline = pipeline
        data_dir = data_config.data_dir
        self.vocab = pipeline.load_vocab(data_dir)
        self.n_token = len(self.vocab)
        if model_config.n_token is not None:
            pipeline.check_vocab_size(data_dir, model_config.n_token)

        keras.utils.set_random_seed(train_config.seed)
        if train_config.deterministic:
            tf.config.experimental.enable_op_determinism()
        self.global_batch = train_config.batch_size
        self.replicas = strategy.num_replicas_in_sync
        self.replica_batch = self.global_batch // self.replicas
        self.mixed_precision = (distribute.has_fast_bfloat16(strategy) if train_config.mixed_precision == "auto"
                                else bool(train_config.mixed_precision))
        self._splits = {}  # evaluation splits, read once
        self._build()

    # ---- set-up -----------------------------------------------------------------------------------------
    def _check_config(self) -> None:
        c = self.config
        replicas = self.strategy.num_replicas_in_sync
        if c.batch_size % replicas:
            raise ConfigError(f"TrainConfig.batch_size={c.batch_size} must be divisible by the {replicas} replicas")
        if (c.batch_size // replicas) % c.grad_accum_steps:
            raise ConfigError(f"the per-replica batch {c.batch_size // replicas} must be divisible by "
                             f"TrainConfig.grad_accum_steps={c.grad_accum_steps}")
        if c.nonfinite not in NONFINITE_MODES:
            raise ConfigError(f"TrainConfig.nonfinite must be one of {NONFINITE_MODES}; got {c.nonfinite!r}")
        for name in ("tgt_len", "train_steps", "steps_per_loop", "log_every", "grad_accum_steps"):
            if getattr(c, name) < 1:
                raise ConfigError(f"TrainConfig.{name} must be >= 1; got {getattr(c, name)}")
        if c.loss_recent_half and c.tgt_len < 2:
            raise ConfigError("TrainConfig.loss_recent_half needs tgt_len >= 2")
        if c.mixed_precision not in (True, False, "auto"):
            raise ConfigError(f"TrainConfig.mixed_precision must be True, False or 'auto'; got {c.mixed_precision!r}")

    def _build(self) -> None:
        policy = "mixed_bfloat16" if self.mixed_precision else "float32"
        previous = keras.config.dtype_policy()
        keras.config.set_dtype_policy(policy)
        try:
            with self.strategy.scope():
                self.model = self.model_config.build(self.n_token)
                self.schedule = schedules.learning_rate_schedule(self.config)
                self.optimizer = schedules.make_optimizer(self.config, self.schedule)
                self.optimizer.build(self.model.trainable_variables)
        finally:
            keras.config.set_dtype_policy(previous)
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
        self._make_managers()
        self._loop_fn = tf.function(self._host_loop)
        self._grad_fn = tf.function(self._loss_and_grads, jit_compile=True) if self.config.jit_compile \
            else self._loss_and_grads

    def num_parameters(self) -> int:
        return int(sum(np.prod(v.shape) for v in self.model.trainable_variables))

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
                hidden, chunk_mems = self.model(inputs[part], mems=mems[:, part], training=True)  # [b, L, d]
                nll = self.model.nll(hidden, targets[part]) * weights  # [b, L] float32
                chunk_sum = tf.reduce_sum(nll)
                loss = chunk_sum / global_tokens
            chunk_grads = tape.gradient(loss, variables)
            if chunks > 1:
                chunk_grads = [tf.convert_to_tensor(g) for g in chunk_grads]
            grads = chunk_grads if grads is None else [a + b for a, b in zip(grads, chunk_grads, strict=True)]
            nll_sum += chunk_sum
            new_mems.append(chunk_mems)
        new_mems = new_mems[0] if chunks == 1 else tf.concat(new_mems, axis=1)  # [n, b_replica, M, d]
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
        return new_mems, (nll_sum, tokens, grad_norm, tf.cast(tf.logical_not(finite), tf.float32))

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
            step_nll, step_tokens, step_norm, step_bad = stats
            nll_sum += tf.cast(strategy.reduce(tf.distribute.ReduceOp.SUM, step_nll, axis=None), tf.float64)
            tokens += tf.cast(strategy.reduce(tf.distribute.ReduceOp.SUM, step_tokens, axis=None), tf.float64)
            grad_norm_sum += tf.cast(strategy.reduce(tf.distribute.ReduceOp.MEAN, step_norm, axis=None),
                                     tf.float64)
            nonfinite += tf.cast(strategy.reduce(tf.distribute.ReduceOp.MEAN, step_bad, axis=None) > 0, tf.int32)
            steps += 1
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

    # ---- checkpoints ------------------------------------------------------------------------------------
    def _make_managers(self) -> None:
        """CheckpointManagers of write_dir and write_dir/best (they prune only checkpoints they saved)."""
        self.manager = tf.train.CheckpointManager(
            self.checkpoint, self.write_dir, max_to_keep=self.config.keep_checkpoints, step_counter=self.step_var)
        self.best_manager = tf.train.CheckpointManager(
            self.checkpoint, os.path.join(self.write_dir, BEST_DIR), max_to_keep=1, step_counter=self.step_var)

    def _restore_prefix(self, prefix: str) -> None:
        self.checkpoint.restore(prefix).assert_existing_objects_matched()

    def restore(self) -> int:
        """Restores the newest intact checkpoint of model_dir (the chief's), if any; returns the step to start from.

        Broken newer checkpoints are named and skipped (txl_tf.run_dir.resume_training); a directory whose
        checkpoints all fail raises run_dir.RunDirError. The managers are made again afterwards, so that they
        never prune the checkpoints that were there before this run.
        """
        step = run_dir.resume_training(self.model_dir, self._restore_prefix, chief=self.chief, log=self.log)
        if step:
            step = int(self.step_var.numpy())
        self._make_managers()
        return step

    def init_weights(self, path: str) -> str:
        """The model's weights (only) from `path`: a converted directory, a run directory or a checkpoint prefix.

        Returns the checkpoint prefix used; the architecture must match (one line naming the mismatch if not).
        """
        from txl_tf import restore

        prefix = restore.find_checkpoint(path)
        restore.restore_weights(self.model, prefix)
        return prefix

    def save(self, step: int, mems, manager: Optional[tf.train.CheckpointManager] = None) -> str:
        """Saves model, optimizer, step, gathered memory and RNG states (every worker must call it)."""
        self.step_var.assign(step)
        if self.config.checkpoint_memory:
            self.saved_mems.assign(tf.cast(self._gather_mems(mems), self.saved_mems.dtype))
        path = (manager or self.manager).save(checkpoint_number=step)
        return path

    def write_config(self) -> None:
        if self.config_str is None or not self.chief:
            return
        os.makedirs(self.model_dir, exist_ok=True)
        with open(os.path.join(self.model_dir, CONFIG_FILE), "w") as f:
            f.write("# Effective configuration of this run (written by txl_tf.train; read by evaluate/export/"
                    "generate).\n")
            f.write(self.config_str)

    # ---- evaluation -------------------------------------------------------------------------------------
    def evaluate(self, split: str = "valid", max_steps: Optional[int] = None):
        """Token-weighted evaluation of `split` with the EvalConfig protocol; returns an EvalResult."""
        from txl_tf import evaluation

        e = self.eval_config
        tokens = self._split_tokens(split)
        steps = self.config.eval_steps or e.max_steps if max_steps is None else max_steps
        if e.protocol == "vanilla":  # a fixed-context model: a window of tgt_len tokens shifted by one
            return evaluation.evaluate_vanilla(self.model, tokens, window=e.tgt_len, batch_size=e.batch_size,
                                               max_steps=steps, clamp_len=e.clamp_len)
        return evaluation.evaluate_tokens(
            self.model, tokens, tgt_len=e.tgt_len, protocol=e.attention_protocol(), batch_size=e.batch_size,
            max_steps=steps, layout=e.layout, kv_cache=e.kv_cache)

    def _split_tokens(self, split: str) -> np.ndarray:
        if split not in self._splits:
            self._splits[split] = self.pipeline.read_split(self.data_config.data_dir, split)
        return self._splits[split]

    def sample_text(self, step: int) -> str:
        """A continuation of the start of the validation split (the prompt is shown in brackets)."""
        from txl_tf import generation

        tokens = self._split_tokens("valid")
        prompt = self.vocab.decode(tokens[: min(len(tokens) - 1, 64 if self.vocab.level == "char" else 16)])
        text = generation.generate_text(self.model, self.vocab, prompt, max_tokens=self.config.sample_tokens,
                                        temperature=1.0, top_k=0, seed=step)
        return f"[{prompt}]{text}"

    # ---- the run ----------------------------------------------------------------------------------------
    def _writers(self):
        if self.chief:
            return (tf.summary.create_file_writer(os.path.join(self.model_dir, "train")),
                    tf.summary.create_file_writer(os.path.join(self.model_dir, "valid")))
        return tf.summary.create_noop_writer(), tf.summary.create_noop_writer()

    def _agree_to_stop(self, local: bool) -> bool:
        """True when any worker wants to stop (an all-reduce across workers in multi-worker runs)."""
        if self.replicas == 1 or not isinstance(self.strategy, tf.distribute.MultiWorkerMirroredStrategy):
            return local
        flags = distribute.replica_values(self.strategy, lambda r: tf.constant(int(local)))
        return bool(self.strategy.reduce(tf.distribute.ReduceOp.SUM, flags, axis=None).numpy() > 0)

    def _next_boundary(self, step: int) -> int:
        c = self.config
        candidates = [c.train_steps, (step // c.steps_per_loop + 1) * c.steps_per_loop,
                      (step // c.log_every + 1) * c.log_every]
        for every in (c.eval_every, c.checkpoint_every):
            if every > 0:
                candidates.append((step // every + 1) * every)
        return min(candidates)

    def train(self) -> dict:
        """Trains until TrainConfig.train_steps (or a stop request); returns the last metrics."""
        c = self.config
        start_step = self.restore()
        if c.init_checkpoint and start_step == 0:
            self.log(f"fine-tuning: weights from {self.init_weights(c.init_checkpoint)} "
                     "(TrainConfig.init_checkpoint); fresh optimizer, step 0, zero memory")
        elif c.init_checkpoint:
            self.log(f"TrainConfig.init_checkpoint={c.init_checkpoint!r} ignored: resuming this run's own checkpoint")
        self.write_config()
        train_writer, valid_writer = self._writers()
        if start_step == 0 and self.config_str is not None:
            with train_writer.as_default():
                tf.summary.text("config", "```\n" + self.config_str + "\n```", step=0)
        resume_memory = start_step and self.config.checkpoint_memory
        mems = self._distribute_mems(self.saved_mems if resume_memory else tf.zeros_like(self.saved_mems))
        dataset = self.pipeline.distribute_dataset(
            self.strategy, self.data_config.data_dir, "train", self.global_batch, c.tgt_len, start_step=start_step,
            rotate_seed=c.seed if c.rotate_streams else None)
        iterator = iter(dataset)
        level = self.vocab.level
        auto = ""
        if c.mixed_precision == "auto":
            auto = (" (mixed_precision='auto': native bfloat16 on these devices)" if self.mixed_precision else
                    " (mixed_precision='auto': no native bfloat16 on these devices, so float32 is faster)")
        self.log(f"model: {self.num_parameters():,} parameters; {self.replicas} replica(s), global batch "
                 f"{self.global_batch} x tgt_len {c.tgt_len} (mem_len {self.model.mem_len}), "
                 f"{self.model.dtype_policy.name}{auto}{', XLA' if c.jit_compile else ''}")
        flops_per_token = flops.config_flops_per_token(self.model_config, self.n_token, tgt_len=c.tgt_len,
                                                       batch_size=self.global_batch // c.grad_accum_steps)
        precision = "bfloat16" if self.mixed_precision else "float32"
        peak = flops.measure_matmul_peak(precision, jit_compile=c.jit_compile) if c.measure_mfu else float("nan")
        stop = _StopRequest()
        stop.install()
        step, window, last_metrics = start_step, LoopStats(), {}
        progress = keras.utils.Progbar(c.train_steps, stateful_metrics=["loss", metric_name(level), "lr"]) \
            if sys.stdout.isatty() and self.chief else None
        loops, mfu_printed = 0, False
        try:
            while step < c.train_steps:
                num = self._next_boundary(step) - step
                start = time.perf_counter()
                mems, out = self._loop_fn(iterator, mems, tf.constant(num, tf.int32))
                done, nll_sum, tokens, norm_sum, bad = (x.numpy() for x in out)
                seconds = time.perf_counter() - start
                loops += 1
                stats = LoopStats(int(done), float(nll_sum), int(tokens), float(norm_sum), int(bad), seconds)
                step += stats.steps
                if loops == 2 and not mfu_printed and c.measure_mfu:  # the first loop includes tracing
                    mfu_printed = True
                    self.log(flops.utilisation_line(stats.tokens / seconds, flops_per_token, peak, precision))
                if stats.nonfinite and c.nonfinite == "stop":
                    raise NonFiniteLossError(
                        f"non-finite loss or gradient at step {step}: the update was skipped and training "
                        f"stopped; the last good checkpoint is {tf.train.latest_checkpoint(self.model_dir)}. "
                        "Lower TrainConfig.learning_rate / clip_norm, or set TrainConfig.nonfinite='skip'")
                window.add(stats)
                if step % c.log_every == 0 or step == c.train_steps:
                    last_metrics = self._log_train(step, window, flops_per_token, peak, train_writer, progress)
                    window = LoopStats()
                if c.eval_every > 0 and (step % c.eval_every == 0 or step == c.train_steps):
                    last_metrics.update(self._evaluate_and_keep_best(step, mems, valid_writer))
                if (c.checkpoint_every > 0 and step % c.checkpoint_every == 0) or step == c.train_steps:
                    self.save(step, mems)
                if self._agree_to_stop(stop.requested):
                    path = self.save(step, mems)
                    self.log(f"stopped at step {step} on request; saved {path}. Re-run the same command to resume.")
                    break
        finally:
            stop.uninstall()
            for writer in (train_writer, valid_writer):
                writer.flush()
            distribute.cleanup_worker_dir(self.model_dir, self.strategy)
        last_metrics["step"] = step
        return last_metrics

    def _log_train(self, step: int, window: LoopStats, flops_per_token: float, peak: float, writer,
                   progress) -> dict:
        level = self.vocab.level
        loss = window.loss
        lr = float(self.schedule(step - 1))  # the rate of the last step
        tokens_per_s = window.tokens / window.seconds if window.seconds else float("nan")
        metrics = {
            "loss": loss, metric_name(level): level_metric(loss, level), "learning_rate": lr,
            "grad_norm": window.grad_norm_sum / max(window.steps, 1), "tokens_per_second": tokens_per_s,
            "step_time": window.seconds / max(window.steps, 1),
            "mfu": tokens_per_s * flops_per_token / peak, "nonfinite_steps": window.nonfinite,
        }
        with writer.as_default():
            for name, value in metrics.items():
                tf.summary.scalar(name, value, step=step)
        if progress is not None:
            progress.update(step, values=[("loss", loss), (metric_name(level), metrics[metric_name(level)]),
                                          ("lr", lr)])
        elif self.chief:
            self.log(f"step {step:>7d}/{self.config.train_steps} | loss {loss:.4f} | "
                     f"{metric_name(level)} {metrics[metric_name(level)]:8.4f} | lr {lr:.3e} | "
                     f"grad norm {metrics['grad_norm']:.3f} | {tokens_per_s:8,.0f} tokens/s | "
                     f"{metrics['step_time']:.3f} s/step" + (f" | {window.nonfinite} skipped" if window.nonfinite
                                                             else ""))
        return metrics

    def _evaluate_and_keep_best(self, step: int, mems, writer) -> dict:
        level = self.vocab.level
        result = self.evaluate("valid")
        metric = level_metric(result.loss, level)
        improved = result.loss < float(self.best_loss.numpy())
        if improved:
            self.best_loss.assign(result.loss)
            self.save(step, mems, self.best_manager)
        sample = self.sample_text(step) if self.config.sample_tokens > 0 else ""
        with writer.as_default():
            tf.summary.scalar("loss", result.loss, step=step)
            tf.summary.scalar(metric_name(level), metric, step=step)
            if sample:
                tf.summary.text("sample", sample, step=step)
        if self.chief:
            self.log(f"valid step {step}: loss {result.loss:.4f} | {metric_name(level)} {metric:.4f} | "
                     f"{result.num_tokens:,} tokens in {result.seconds:.1f} s"
                     + (" | new best" if improved else f" | best {level_metric(float(self.best_loss.numpy()), level):.4f}"))
            if sample:
                self.log(f"sample: {sample!r}")
        return {"valid_loss": result.loss, f"valid_{metric_name(level)}": metric}
