"""The training loop around a `txl_tf.training.trainer.Trainer`: when to train, log, evaluate, checkpoint and stop.

The trainer is the step (model, optimizer, distributed host loop, memory, the checkpoint object); the
`Controller` is the loop, like orbit's Controller around a StandardTrainer:

* cadence: each host loop runs up to the next boundary of `steps_per_loop`, `log_every`, `checkpoint_every`,
  every action's `every` and `train_steps`, so that each of them falls on the end of a host loop;
* checkpoints: saved through the CheckpointManagers it is given (`checkpoint_managers`: model_dir and
  model_dir/best/, made after the run was restored with `run_dir.resume_training`; txl_tf.train does both), and
  the run starts at the trainer's restored step;
* summaries (`tf.summary`, model_dir/train and model_dir/valid), console lines or a progress bar, the MFU line;
* actions after host loops (`Action`): `EvaluateAndKeepBest` (the validation split through an `Evaluator` with the
  setup's EvalConfig; a new best validation loss is kept in model_dir/best/) and `SampleText` (a continuation of
  the start of the validation split), both every `eval_every` steps (`default_actions`); a run's list can be
  extended with any other `Action`;
* stop on request: SIGTERM / SIGINT end the host loop after the current step (the trainer's stop flag) or the
  evaluation after its current segment, save a checkpoint and end the run cleanly; in a multi-worker run all
  workers end after the same step and save at the same step.

Files in model_dir: config.gin (the effective gin config), vocab_fingerprint.json (the fingerprint of the data's
vocabulary: a resumed run, or a fine-tuning run started from this one, on data with another vocabulary is refused
in one line; txl_tf.runs.run_dir.check_vocabulary), ckpt-N.*, best/ckpt-N.* (best validation loss), TensorBoard event
files (train/ and valid/); non-chief workers write into temporary directories inside it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Optional

import keras
import numpy as np
import tensorflow as tf

from txl_tf.configs import EvalConfig, architecture
from txl_tf.evaluation.loops import StopRequested
from txl_tf.model import flops, fused
from txl_tf.runs import loading, run_dir
from txl_tf.training import distribute
from txl_tf.training.autotune import MEASURE_ENV
from txl_tf.training.trainer import LoopStats, NonFiniteLossError, Trainer


def metric_name(level: str) -> str:
    return "bpc" if level == "char" else "ppl"


def level_metric(loss: float, level: str) -> float:
    """bits per character (char level) or perplexity (word level) of a mean NLL in nats."""
    return loss / math.log(2.0) if level == "char" else math.exp(min(loss, 700.0))


class Action:
    """Something the controller runs after a host loop that ends at a multiple of `every` (> 0) or at the last
    step, after the train metrics are logged and before the periodic checkpoint is saved.

    Subclasses implement `__call__(controller, step)` and return metrics to add to the run's last metrics
    (a dict, maybe empty). The controller gives itself: its trainer, log, summary writers and `save`.
    """

    def __init__(self, every: int):
        self.every = every

    def due(self, step: int, last_step: int) -> bool:
        return self.every > 0 and (step % self.every == 0 or step == last_step)

    def __call__(self, controller: Controller, step: int) -> dict:
        raise NotImplementedError


# ---- actions: evaluation with best-model keeping, text samples --------------------------------------------
class Evaluator:
    """Token-weighted evaluation of a split with the EvalConfig protocol (each split read once).

    Args:
      model: the TransformerXL to score.
      data_dir: the prepared data (its splits).
      eval_config: the evaluation protocol (lengths, clamping, batch, layout, cache).
      max_steps: segments per evaluation (0: the whole split) unless `evaluate` is given its own.
    """

    def __init__(self, model, data_dir: str, eval_config: EvalConfig, max_steps: int = 0):
        self.model, self.data_dir, self.eval_config, self.max_steps = model, data_dir, eval_config, max_steps
        self._splits = {}

    def tokens(self, split: str) -> np.ndarray:
        if split not in self._splits:
            from txl_tf.data import pipeline

            self._splits[split] = pipeline.read_split(self.data_dir, split)
        return self._splits[split]

    def evaluate(self, split: str = "valid", max_steps: Optional[int] = None, *, progress: bool = False,
                 stop: Optional[Callable[[], bool]] = None):
        """Evaluates `split`; returns a txl_tf.evaluation.loops.EvalResult.

        `progress` prints progress lines (tokens, rate, time left) while it runs longer than a few seconds;
        `stop() -> True` between segments abandons it (txl_tf.evaluation.loops.StopRequested).
        """
        from txl_tf.evaluation import loops as evaluation

        e = self.eval_config
        tokens = self.tokens(split)
        steps = self.max_steps if max_steps is None else max_steps
        watch = dict(progress="long" if progress else False, stop=stop)
        if e.protocol == "vanilla":  # a fixed-context model: a window of tgt_len tokens shifted by one
            return evaluation.evaluate_vanilla(self.model, tokens, window=e.tgt_len, batch_size=e.batch_size,
                                               max_steps=steps, clamp_len=e.clamp_len, **watch)
        return evaluation.evaluate_tokens(
            self.model, tokens, tgt_len=e.tgt_len, protocol=e.attention_protocol(), batch_size=e.batch_size,
            max_steps=steps, layout=e.layout, kv_cache=e.kv_cache, **watch)


class EvaluateAndKeepBest(Action):
    """Evaluates the validation split; a loss below the checkpoint's best_valid_loss saves model_dir/best/."""

    def __init__(self, evaluator: Evaluator, every: int):
        super().__init__(every)
        self.evaluator = evaluator

    def __call__(self, controller: Controller, step: int) -> dict:
        trainer = controller.trainer
        level = controller.level
        name = metric_name(level)
        result = self.evaluator.evaluate("valid", progress=controller.chief, stop=controller.stop_requested)
        metric = level_metric(result.loss, level)
        improved = result.loss < float(trainer.best_loss.numpy())
        if improved:
            trainer.best_loss.assign(result.loss)
            controller.save(step, controller.checkpoints.best)
        with controller.valid_writer.as_default():
            tf.summary.scalar("loss", result.loss, step=step)
            tf.summary.scalar(name, metric, step=step)
        if controller.chief:
            best = "new best" if improved else f"best {level_metric(float(trainer.best_loss.numpy()), level):.4f}"
            controller.log(f"valid step {step}: loss {result.loss:.4f} | {name} {metric:.4f} | "
                           f"{result.num_tokens:,} tokens in {result.seconds:.1f} s | {best}")
        return {"valid_loss": result.loss, f"valid_{name}": metric}


class SampleText(Action):
    """A continuation of the start of `prompt_tokens()` (the prompt shown in brackets, decoded with `vocab`, a
    txl_tf.data.vocab.Vocab), seeded by the step."""

    def __init__(self, prompt_tokens: Callable[[], np.ndarray], vocab, max_tokens: int, every: int):
        super().__init__(every)
        self.prompt_tokens, self.vocab, self.max_tokens = prompt_tokens, vocab, max_tokens

    def text(self, trainer: Trainer, step: int) -> str:
        from txl_tf.lm import generation

        vocab = self.vocab
        tokens = self.prompt_tokens()
        prompt = vocab.decode(tokens[: min(len(tokens) - 1, 64 if vocab.level == "char" else 16)])
        text = generation.generate_text(trainer.model, vocab, prompt, max_tokens=self.max_tokens, temperature=1.0,
                                        top_k=0, seed=step)
        return f"[{prompt}]{text}"

    def __call__(self, controller: Controller, step: int) -> dict:
        sample = self.text(controller.trainer, step)
        with controller.valid_writer.as_default():
            tf.summary.text("sample", sample, step=step)
        if controller.chief:
            controller.log(f"sample: {sample!r}")
        return {}


def default_actions(trainer: Trainer, eval_config: EvalConfig, *, data_dir: str, vocab) -> list[Action]:
    """The evaluation of the valid split of the prepared `data_dir` (every TrainConfig.eval_every steps,
    TrainConfig.eval_steps or EvalConfig.max_steps segments) and, when TrainConfig.sample_tokens > 0, a text sample
    decoded with `vocab` (the data's txl_tf.data.vocab.Vocab) at the same cadence."""
    c = trainer.config
    evaluator = Evaluator(trainer.model, data_dir, eval_config, max_steps=c.eval_steps or eval_config.max_steps)
    actions: list[Action] = [EvaluateAndKeepBest(evaluator, every=c.eval_every)]
    if c.sample_tokens > 0:
        actions.append(SampleText(functools.partial(evaluator.tokens, "valid"), vocab, c.sample_tokens,
                                  every=c.eval_every))
    return actions


# ---- stop requests and the loop ---------------------------------------------------------------------------
# Why not tf.distribute.experimental.PreemptionCheckpointHandler (TF 2.21, failure_handling.py in the
# distribute/failure_handling folder of TensorFlow's Python sources); see also docs/training.md:
# * on a Google Cloud CPU VM it does nothing: its constructor asks the GCE metadata server where it runs
#   (failure_handling_util.detect_platform/on_gcp), and for GCE_CPU it starts no watcher ("does not support usage
#   with TPU or CPU device on GCP") and `save_checkpoint_if_preempted` returns without checking, so SIGTERM would
#   end a CPU run there without a checkpoint;
# * it adds its own variable `checkpointed_runs` to the tf.train.Checkpoint it is given (a setattr in
#   `_initialize_for_mirrored_and_multi_worker_mirrored`), changing the keys of every checkpoint, and restores the
#   state file's latest checkpoint itself (`restore_or_initialize()`), past run_dir's fallback;
# * it installs a SIGTERM handler for the rest of the process (never put back after an in-process run) and does
#   not handle SIGINT.
class _StopRequest:
    """SIGTERM / SIGINT handler: remembers the request and calls `on_request()` at once.

    Python runs a signal handler only when the main thread is back in the interpreter, which it is not while a
    host loop (a tf.function of up to steps_per_loop steps) runs. So the signal also wakes a thread through
    `signal.set_wakeup_fd`; the thread calls `on_request` (the trainer's stop flag, which the host loop reads
    after every step) within milliseconds. The evaluation reads `requested` between segments.
    """

    def __init__(self, on_request: Callable[[], None] = lambda: None):
        self.requested = False
        self.on_request = on_request
        self.previous: dict = {}
        self._interrupts = 0
        self._lock = threading.Lock()
        self._pipe: tuple[int, int] | None = None
        self._previous_fd = -1

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self.previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals stay with their current handlers
                return
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self._pipe = (read_fd, write_fd)
        self._previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(read_fd,), name="stop-request", daemon=True).start()

    def uninstall(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}
        if self._pipe is not None:
            signal.set_wakeup_fd(self._previous_fd)
            os.close(self._pipe[1])  # the watcher reads end-of-file and ends (it closes the read end)
            self._pipe = None

    def _watch(self, read_fd: int) -> None:
        try:
            while data := os.read(read_fd, 64):
                for signum in data:
                    if signum in (signal.SIGTERM, signal.SIGINT):
                        self._note(signum)
        finally:
            os.close(read_fd)

    def _note(self, signum: int) -> None:
        with self._lock:
            if self.requested:
                return
            self.requested = True
        print(f"\nreceived {signal.Signals(signum).name}: stopping after the current step or evaluation segment "
              "and saving a checkpoint", file=sys.stderr, flush=True)
        self.on_request()

    def _handle(self, signum, frame):
        del frame
        if signum == signal.SIGINT:
            self._interrupts += 1
            if self._interrupts > 1:  # a second Ctrl-C stops at once
                raise KeyboardInterrupt
        self._note(signum)


RATE_PARTS = 0.7  # training below this share of its path's measured rate is said in the log, once


@dataclasses.dataclass(frozen=True)
class CheckpointManagers:
    """The managers a training run saves with: `latest` (the periodic checkpoints) and `best` (best/)."""

    latest: tf.train.CheckpointManager
    best: tf.train.CheckpointManager


def checkpoint_managers(checkpoint: tf.train.Checkpoint, model_dir: str, *, strategy: tf.distribute.Strategy,
                        step_counter: tf.Variable, keep: int) -> CheckpointManagers:
    """The CheckpointManagers of a training run: up to `keep` checkpoints in model_dir and one in model_dir/best/.

    On the chief they write into model_dir; on another worker of a multi-worker run (every worker saves, as
    tf.distribute asks) into its temporary folder inside model_dir (`distribute.worker_dir`, removed at the end).
    Make them after `resume_training`: a manager reads the state file when it is made and prunes only checkpoints
    newer than its preserved time, so the checkpoints that `resume_training` preserved are never deleted.
    """
    directory = distribute.worker_dir(model_dir, strategy)
    return CheckpointManagers(
        latest=tf.train.CheckpointManager(checkpoint, directory, max_to_keep=keep, step_counter=step_counter),
        best=tf.train.CheckpointManager(checkpoint, os.path.join(directory, run_dir.BEST_DIR), max_to_keep=1,
                                        step_counter=step_counter))


class Controller:
    """Trains `trainer` in model_dir until TrainConfig.train_steps or a stop request (`train()`).

    Args:
      trainer: the step (txl_tf.training.trainer.Trainer), restored already when the run resumes (the run starts at its
        step); its TrainConfig sets the cadence.
      checkpoints: the managers that save `trainer.checkpoint` (checkpoint_managers, made after
        the restore).
      model_dir: where config.gin and TensorBoard logs go (the chief's; the checkpoints go where `checkpoints`
        save them).
      level: the vocabulary's level, "char" or "word": the metric beside the loss (bits per character or
        perplexity).
      actions: run after host loops at their cadence (see `Action`; `default_actions` gives the evaluation and
        the text sample), in this order; `controller.actions` may be extended.
      config_str: the effective gin config to save as model_dir/config.gin (None: not written).
      log: where console lines go.
      data_dir: the prepared data the run trains on (default: the data its `EvaluateAndKeepBest` action
        evaluates; None: none): its vocabulary's fingerprint is checked against the one the run recorded (a resume)
        or the run TrainConfig.init_checkpoint names (fine-tuning), then recorded in model_dir.
    """

    def __init__(self, trainer: Trainer, checkpoints: CheckpointManagers, *, model_dir: str, level: str,
                 actions: Sequence[Action] = (), config_str: Optional[str] = None,
                 log: Callable[[str], None] = functools.partial(print, flush=True), data_dir: Optional[str] = None):
        if level not in ("char", "word"):
            raise ValueError(f"level must be 'char' or 'word' (the vocabulary's); got {level!r}")
        self.trainer, self.config, self.checkpoints = trainer, trainer.config, checkpoints
        self.model_dir, self.level, self.config_str, self.log = model_dir, level, config_str, log
        self.actions = list(actions)
        self.data_dir = data_dir or next(
            (action.evaluator.data_dir for action in self.actions if isinstance(action, EvaluateAndKeepBest)), None)
        self.chief = distribute.is_chief(trainer.strategy)
        self.train_writer = self.valid_writer = tf.summary.create_noop_writer()
        self._stop = _StopRequest()
        self._windows, self._rate_said = 0, False  # logged windows; whether the rate's parting was said

    # ---- cadence ----------------------------------------------------------------------------------------
    def next_boundary(self, step: int) -> int:
        """The step at which the host loop starting at `step` ends: the nearest multiple of steps_per_loop,
        log_every, checkpoint_every or an action's `every` after `step`, at most train_steps."""
        c = self.config
        candidates = [c.train_steps, (step // c.steps_per_loop + 1) * c.steps_per_loop,
                      (step // c.log_every + 1) * c.log_every]
        for every in [c.checkpoint_every] + [action.every for action in self.actions]:
            if every > 0:
                candidates.append((step // every + 1) * every)
        return min(candidates)

    # ---- checkpoints ------------------------------------------------------------------------------------
    def init_weights(self, path: str) -> str:
        """The model's weights (only) from `path`: a converted directory, a run directory or a checkpoint prefix.

        Returns the checkpoint prefix used; the architecture must match, and the vocabulary the run of `path`
        recorded must be this run's (one line naming the mismatch if not).
        """
        prefix = run_dir.find_checkpoint(path)
        if self.data_dir:
            run_dir.check_vocabulary(run_dir.run_folder(prefix), self.data_dir, "fine-tune from it")
        run_dir.check_architecture(run_dir.run_folder(prefix), architecture(self.trainer.model), "fine-tune from it")
        loading.restore_weights(self.trainer.model, prefix)
        return prefix

    def save(self, step: int, manager: Optional[tf.train.CheckpointManager] = None) -> str:
        """Saves the training state at `step` as ckpt-<step> with `manager` (default: the latest checkpoints';
        every worker must call it)."""
        self.trainer.sync_checkpoint(step)
        return (manager or self.checkpoints.latest).save(checkpoint_number=step)

    def write_config(self) -> None:
        if self.config_str is not None and self.chief:
            run_dir.write_config(self.model_dir, self.config_str, "Effective configuration of this run (written by "
                                 "txl_tf.train; read by evaluate/export/generate).")

    # ---- the run ----------------------------------------------------------------------------------------
    def stop_requested(self) -> bool:
        """Whether SIGTERM / SIGINT asked this process to stop (long actions poll it and raise StopRequested)."""
        return self._stop.requested

    def _agree_to_stop(self, local: bool) -> bool:
        """True when any worker wants to stop (an all-reduce across workers in multi-worker runs)."""
        strategy = self.trainer.strategy
        if self.trainer.replicas == 1 or not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
            return local
        flags = distribute.replica_values(strategy, lambda r: tf.constant(int(local)))
        return bool(strategy.reduce(tf.distribute.ReduceOp.SUM, flags, axis=None).numpy() > 0)

    def _start(self) -> int:
        """Initialises the run (the trainer's step: 0, or the restored one), writes its config and opens the
        summary writers; returns the step."""
        c = self.config
        start_step = int(self.trainer.step_var.numpy())
        if start_step > 0 and self.data_dir:  # resumed: the ids must mean the symbols they were trained on
            run_dir.check_vocabulary(self.model_dir, self.data_dir, "resume training")
        if c.init_checkpoint and start_step == 0:
            self.log(f"fine-tuning: weights from {self.init_weights(c.init_checkpoint)} "
                     "(TrainConfig.init_checkpoint); fresh optimizer, step 0, zero memory")
        elif c.init_checkpoint:
            self.log(f"TrainConfig.init_checkpoint={c.init_checkpoint!r} ignored: resuming this run's own checkpoint")
        if self.data_dir and self.chief:
            run_dir.record_vocabulary(self.model_dir, self.data_dir)
        if self.chief:  # what every later load of these checkpoints is compared with
            run_dir.record_architecture(self.model_dir, architecture(self.trainer.model))
        self.write_config()
        if self.chief:
            self.train_writer = tf.summary.create_file_writer(os.path.join(self.model_dir, "train"))
            self.valid_writer = tf.summary.create_file_writer(os.path.join(self.model_dir, "valid"))
        if start_step == 0 and self.config_str is not None:
            with self.train_writer.as_default():
                tf.summary.text("config", "```\n" + self.config_str + "\n```", step=0)
        self.trainer.start(start_step)
        return start_step

    def _model_line(self) -> str:
        c, trainer = self.config, self.trainer
        auto = " (the fastest measured here: txl_tf.training.autotune)" if trainer.path_measured else ""
        return (f"model: {trainer.num_parameters():,} parameters; {trainer.replicas} replica(s), global batch "
                f"{trainer.global_batch} x tgt_len {c.tgt_len} (mem_len {trainer.model.mem_len}), "
                f"{trainer.model.dtype_policy.name}{', XLA' if trainer.path.jit_compile else ''}; kernels "
                f"{trainer.kernels!r}: {fused.describe(trainer.kernels)}{auto}")

    def train(self) -> dict:
        """Trains until TrainConfig.train_steps (or a stop request); returns the last metrics and "step"."""
        c, trainer = self.config, self.trainer
        step = self._start()
        self.log(self._model_line())
        flops_per_token = flops.config_flops_per_token(trainer.model_config, trainer.n_token, tgt_len=c.tgt_len,
                                                       batch_size=trainer.global_batch // c.grad_accum_steps)
        precision = "bfloat16" if trainer.mixed_precision else "float32"
        peak = flops.measure_matmul_peak(precision, jit_compile=trainer.path.jit_compile) if c.measure_mfu \
            else float("nan")
        stop = self._stop = _StopRequest(on_request=trainer.request_stop)
        stop.install()
        window, last_metrics, loops = LoopStats(), {}, 0
        progress = keras.utils.Progbar(c.train_steps, stateful_metrics=["loss", metric_name(self.level), "lr"]) \
            if sys.stdout.isatty() and self.chief else None
        try:
            while step < c.train_steps:
                stats = trainer.train_loop(self.next_boundary(step) - step)
                loops += 1
                step += stats.steps
                if loops == 2 and c.measure_mfu:  # the first loop includes tracing
                    self.log(flops.utilisation_line(stats.tokens / stats.seconds, flops_per_token, peak, precision))
                if stats.nonfinite and c.nonfinite == "stop":
                    raise NonFiniteLossError(
                        f"non-finite loss or gradient at step {step}: the update was skipped and training "
                        f"stopped; the last good checkpoint is {tf.train.latest_checkpoint(self.model_dir)}. "
                        "Lower TrainConfig.learning_rate / clip_norm, or set TrainConfig.nonfinite='skip'")
                window.add(stats)
                if step % c.log_every == 0 or step == c.train_steps:
                    last_metrics = self._log_train(step, window, flops_per_token, peak, progress)
                    window = LoopStats()
                try:
                    for action in self.actions:
                        if action.due(step, c.train_steps) and not stop.requested:
                            last_metrics.update(action(self, step))
                except StopRequested as request:
                    self.log(f"{request} at step {step}: abandoned on the stop request")
                if (c.checkpoint_every > 0 and step % c.checkpoint_every == 0) or step == c.train_steps:
                    self.save(step)
                if self._agree_to_stop(stop.requested):
                    path = self.save(step)
                    self.log(f"stopped at step {step} on request; saved {path}. Re-run the same command to resume.")
                    break
        finally:
            stop.uninstall()
            for writer in (self.train_writer, self.valid_writer):
                writer.flush()
            distribute.cleanup_worker_dir(self.model_dir, trainer.strategy)
        last_metrics["step"] = step
        return last_metrics

    def _compare_with_measured(self, tokens_per_s: float) -> None:
        """Says once in the log when training runs well below the rate its "auto" path was measured at
        (`Trainer.path_measured`), from the second logged window on (the first holds tracing and compilation)."""
        self._windows += 1
        measured = (getattr(self.trainer, "path_measured", None) or {}).get(self.trainer.path.describe())
        if not measured or self._rate_said or self._windows < 2 or not self.chief or not math.isfinite(tokens_per_s):
            return
        per_replica = tokens_per_s / self.trainer.strategy.num_replicas_in_sync
        if per_replica < RATE_PARTS * measured:
            self._rate_said = True
            self.log(f"training at {per_replica:,.0f} tokens/s a replica, {1 - per_replica / measured:.0%} below the "
                     f"{measured:,.0f} its path ({self.trainer.path.describe()}) was measured at: a busy machine, or a "
                     f"cached choice that no longer holds ({MEASURE_ENV}=measure times every candidate again)")

    def _log_train(self, step: int, window: LoopStats, flops_per_token: float, peak: float, progress) -> dict:
        """Summaries and a console line (or the progress bar) of the steps in `window`; returns the metrics."""
        level = self.level
        name = metric_name(level)
        loss = window.loss
        lr = float(self.trainer.schedule(step - 1))  # the rate of the last step
        tokens_per_s = window.tokens / window.seconds if window.seconds else float("nan")
        self._compare_with_measured(tokens_per_s)
        metrics = {
            "loss": loss, name: level_metric(loss, level), "learning_rate": lr,
            "grad_norm": window.grad_norm_sum / max(window.steps, 1), "tokens_per_second": tokens_per_s,
            "step_time": window.seconds / max(window.steps, 1),
            "mfu": tokens_per_s * flops_per_token / peak, "nonfinite_steps": window.nonfinite,
        }
        with self.train_writer.as_default():
            for key, value in metrics.items():
                tf.summary.scalar(key, value, step=step)
        if progress is not None:
            progress.update(step, values=[("loss", loss), (name, metrics[name]), ("lr", lr)])
        elif self.chief:
            self.log(f"step {step:>7d}/{self.config.train_steps} | loss {loss:.4f} | {name} {metrics[name]:8.4f} | "
                     f"lr {lr:.3e} | grad norm {metrics['grad_norm']:.3f} | {tokens_per_s:8,.0f} tokens/s | "
                     f"{metrics['step_time']:.3f} s/step" + (f" | {window.nonfinite} skipped" if window.nonfinite
                                                             else ""))
        return metrics
