"""Evaluation loops: Transformer-XL's segment-recurrent protocol and the vanilla sliding window.

Transformer-XL protocol (section 3.2 of the paper; the authors' TF code, tf/train_gpu.py): the split is cut into `batch_size`
contiguous streams; each step scores the next `tgt_len` tokens of every stream while the memory (`mem_len`
long, zeros at the start: the TF original's convention) carries the context across segments. The state (the
keys/values cache, or the hidden memory: `txl_tf.model.inference`) stays a TF tensor between the compiled steps (never a
host array), and the step is traced at most once per segment shape (full segment, the final shorter one, and the
1-stream tail). The attention lengths are a `Protocol` value handed to the model's calls.

Every token of the split after the first is scored exactly once: stream b covers predictions
`b*S + 1 .. b*S + S` (S = (N - 1) // batch_size, so stream b's last target is stream b + 1's first input) and
the `(N - 1) % batch_size` leftover predictions continue the last stream with its memory. Per-token losses
therefore come back in corpus order whatever the batch size, which RECL needs.

Vanilla protocol (Al-Rfou et al., 2018; the paper's Table 7 baseline): a window of `tgt_len` tokens shifted by
one token per prediction; the first window scores all its positions, every later forward pass one token.

Shapes: B streams (batch), L segment length, M = mem_len, n_layer layers, D = d_model, N tokens in the split.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable, Iterable

import numpy as np
import tensorflow as tf

from txl_tf.base.errors import ConfigError
from txl_tf.configs import check_inference_size
from txl_tf.model.inference import Recurrent, run_segments
from txl_tf.model.protocol import LAYOUTS, Protocol


class LossFigures:
    """bpc and perplexity of a result whose `loss` is a mean negative log-likelihood per token (nats)."""

    @property
    def bpc(self) -> float:
        """Bits per token (per character at char level)."""
        return self.loss / math.log(2.0)

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 700.0))


@dataclasses.dataclass
class EvalResult(LossFigures):
    """Token-weighted evaluation metrics.

    Attributes:
      loss: mean negative log-likelihood per scored token (nats).
      num_tokens: number of tokens scored.
      seconds: wall time of the loop.
      protocol: the settings used (tgt_len, mem_len, clamp_len, same_length, batch_size, protocol, ...).
      token_losses: [num_tokens] float32 per-token NLL in corpus order, when requested.
    """

    loss: float
    num_tokens: int
    seconds: float
    protocol: dict
    token_losses: np.ndarray | None = None

    def summary(self, level: str | None = None) -> str:
        """One line: loss, bpc (character level) or perplexity (word level), tokens, speed."""
        if level == "char":
            metric = f"bpc {self.bpc:.4f}"
        elif level == "word":
            metric = f"ppl {self.perplexity:.3f}"
        else:
            metric = f"bpc {self.bpc:.4f}  ppl {self.perplexity:.3f}"
        speed = self.num_tokens / self.seconds if self.seconds > 0 else float("nan")
        return f"loss {self.loss:.5f}  {metric}  tokens {self.num_tokens}  ({speed:.0f} tokens/s)"

    def protocol_line(self) -> str:
        return "protocol: " + ", ".join(f"{k}={v}" for k, v in self.protocol.items())


def check_streams(num_tokens: int, batch_size: int, layout: str = "corpus", name: str = "batch_size") -> None:
    """Raises ConfigError (naming `name` and how many streams fit) unless `num_tokens` tokens give every one of
    `batch_size` streams at least one prediction in `layout` (see `corpus_streams`)."""
    most = num_tokens - 1 if layout == "corpus" else num_tokens // 2
    if batch_size > most:
        raise ConfigError(f"{name}={batch_size}: {num_tokens} tokens are too few for {batch_size} streams; at most "
                          f"{max(most, 0)} fit (layout {layout!r}): lower {name}")


def check_split(data_dir: str, split: str, batch_sizes: Iterable[int] = (), layout: str = "corpus",
                name: str = "EvalConfig.batch_size") -> int:
    """Raises ConfigError unless the prepared `data_dir` has `split` with tokens enough for each of `batch_sizes`
    streams (EvalConfig.batch_size); returns its token count. From the metadata: before a model is loaded."""
    from txl_tf.data.pipeline import load_metadata

    splits = load_metadata(data_dir)["splits"]
    if split not in splits:
        raise ConfigError(f"--split={split!r}: {data_dir} has no such split; pass one of {', '.join(sorted(splits))}")
    num_tokens = int(splits[split]["num_tokens"])
    for batch_size in batch_sizes:
        check_streams(num_tokens, batch_size, layout, name=name)
    return num_tokens


def corpus_streams(tokens: np.ndarray, batch_size: int, layout: str = "corpus") -> tuple[np.ndarray, np.ndarray]:
    """Splits a 1-D token array into `batch_size` contiguous streams.

    Layouts:
      "corpus" (default): together the streams predict every token after the first exactly once. Row b holds
        tokens[b*S : b*S + S + 1] with S = (N - 1) // B (its last target is the next row's first input), and
        the tail holds the R = (N - 1) % B leftover predictions continuing the last row.
      "original": the authors' batching: S + 1 = N // B tokens per row, rows do not overlap, and the B - 1
        tokens that start rows 1.. and the N % B leftover tokens are not predicted (empty tail).

    Returns:
      streams: [B, S + 1] int32 (inputs row[:-1], targets row[1:]); tail: [R + 1] int32 (R may be 0).
    """
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive; got {batch_size}")
    if layout not in LAYOUTS:
        raise ValueError(f"stream layout must be one of {LAYOUTS}; got {layout!r}")
    check_streams(tokens.shape[0], batch_size, layout)
    stream_len = (tokens.shape[0] - 1) // batch_size if layout == "corpus" else tokens.shape[0] // batch_size - 1
    if layout == "original":
        return tokens[:batch_size * (stream_len + 1)].reshape(batch_size, stream_len + 1), tokens[:0]
    index = np.arange(batch_size)[:, None] * stream_len + np.arange(stream_len + 1)[None, :]
    return tokens[index], tokens[batch_size * stream_len:]


class StopRequested(Exception):
    """An evaluation abandoned because its `stop()` callback asked for it (a SIGTERM during training)."""


class _Progress:
    """Progress that can be turned off: a keras Progbar on a terminal, else a plain line on stderr every few
    seconds (txl_tf.data.progress.Progress) with the rate and the time left.

    `enabled`: True, False, or "long": plain lines only, and only once the evaluation has run a few seconds (the
    training loop's periodic validation: a short one prints nothing). `stop() -> True` between updates raises
    StopRequested.
    """

    def __init__(self, total: int, enabled: bool | str, unit: str = "token", stop=None):
        self.bar = self.lines = None
        self.stop, self.unit = stop, unit
        if enabled is True and sys.stdout.isatty():  # keras writes its bar to stdout
            import keras

            self.bar = keras.utils.Progbar(total, unit_name=unit, stateful_metrics=["loss"])
        elif enabled:
            from txl_tf.data.progress import Progress

            self.lines = Progress("evaluating", total or None, unit=f"{unit}s", quiet_if_fast=enabled == "long")
        self.done = 0

    def update(self, count: int, loss: float | None = None) -> None:
        self.done += count
        if self.bar is not None:
            self.bar.update(self.done, values=[] if loss is None else [("loss", loss)])
        elif self.lines is not None:
            self.lines.update(count, "" if loss is None else f"loss {loss:.4f}")
            if self.lines.total and self.done >= self.lines.total:
                self.lines.close()
        if self.stop is not None and self.stop():
            if self.lines is not None:
                self.lines.close()
            raise StopRequested(f"the evaluation (stopped after {self.done:,} {self.unit}s)")


def _score_streams(recurrent, streams, state, tgt_len: int, max_steps: int, progress, totals, pieces):
    """Scores [B, S + 1] streams segment by segment, carrying the state; appends [B, L] NLL to `pieces`."""

    def count(nll):
        totals[0] += float(tf.reduce_sum(tf.cast(nll, tf.float64)))
        totals[1] += int(nll.shape[0] * nll.shape[1])
        pieces.append(nll)
        progress.update(int(nll.shape[0] * nll.shape[1]), totals[0] / totals[1])

    _, state = run_segments(recurrent.score, state, streams[:, :-1], tgt_len, targets=streams[:, 1:],
                            max_steps=max_steps, on_output=count)
    return state


def evaluate_streams(model, streams: np.ndarray, *, tgt_len: int, protocol: Protocol, max_steps: int = 0,
                     tail: np.ndarray | None = None, return_token_losses: bool = False,
                     progress: bool | str = False, jit_compile: bool = False, kv_cache: bool = True,
                     stop: Callable[[], bool] | None = None) -> EvalResult:
    """Transformer-XL evaluation of explicit streams with the state carried across segments.

    A batch, segment or memory length that would not fit in the machine's memory is a ConfigError naming it before
    any tensor is made (`configs.check_inference_size`; `evaluate_vanilla` checks its window the same way).

    Args:
      model: a `TransformerXL`.
      streams: [B, S + 1] int32 token streams; stream b predicts streams[b, 1:] from streams[b, :-1].
      tgt_len: segment length L; the last segment of a stream may be shorter.
      protocol: the attention lengths (mem_len, clamp_len, same_length) of every call.
      max_steps: score only the first `max_steps` segments (0 = all).
      tail: optional [R + 1] tokens continuing the LAST stream (R predictions), scored with that stream's state.
      return_token_losses: keep per-token NLL, in order stream 0, stream 1, ..., then the tail.
      progress: show progress (tokens scored of the total, rate, time left): True, or "long" for plain lines
        once it has run a few seconds.
      stop: called after every segment; True abandons the evaluation (raises StopRequested).
      jit_compile: XLA (faster on GPU/TPU, slower for bf16 on CPUs with AMX).
      kv_cache: carry the memory's keys/values (same numbers, much faster at long memories); False carries the
        hidden states and projects them again every segment, as the authors' code does.
    """
    streams = np.asarray(streams, np.int32)
    if streams.ndim != 2 or streams.shape[1] < 2:
        raise ValueError(f"streams must be [batch, length >= 2]; got shape {streams.shape}")
    batch_size, length = streams.shape[0], streams.shape[1] - 1
    check_inference_size(model, batch_size=batch_size, tgt_len=tgt_len, mem_len=protocol.mem_len)
    steps = math.ceil(length / tgt_len)
    truncated = bool(max_steps) and max_steps < steps
    steps = max_steps if truncated else steps
    with_tail = tail is not None and len(tail) > 1 and not truncated  # the tail follows the whole last stream
    recurrent = Recurrent(model, protocol, max_len=tgt_len, use_cache=kv_cache, jit_compile=jit_compile)
    settings = dict(protocol="xl", tgt_len=tgt_len, **protocol.as_dict(), batch_size=batch_size,
                    state=recurrent.state_form)
    start_time = time.perf_counter()
    totals, pieces, tail_pieces = [0.0, 0], [], []
    total = batch_size * min(length, steps * tgt_len) + (len(tail) - 1 if with_tail else 0)
    bar = _Progress(total, progress, stop=stop)
    state = _score_streams(recurrent, streams, recurrent.initial_state(batch_size), tgt_len, max_steps, bar,
                           totals, pieces)
    if with_tail:  # the last stream's state continues into the tail
        tail_state = state.select_rows(batch_size - 1, batch_size)
        _score_streams(recurrent, np.asarray(tail, np.int32)[None], tail_state, tgt_len, 0, bar, totals,
                       tail_pieces)
    seconds = time.perf_counter() - start_time
    token_losses = None
    if return_token_losses:
        per_stream = tf.concat(pieces, axis=1).numpy().reshape(-1)  # stream-major = corpus order
        tail_losses = [p.numpy().reshape(-1) for p in tail_pieces]
        token_losses = np.concatenate([per_stream, *tail_losses]).astype(np.float32)
    return EvalResult(loss=totals[0] / totals[1], num_tokens=totals[1], seconds=seconds, protocol=settings,
                      token_losses=token_losses)


def evaluate_tokens(model, tokens: np.ndarray, *, tgt_len: int, protocol: Protocol, batch_size: int = 10,
                    max_steps: int = 0, layout: str = "corpus", return_token_losses: bool = False,
                    progress: bool | str = False, jit_compile: bool = False, kv_cache: bool = True,
                    stop: Callable[[], bool] | None = None) -> EvalResult:
    """Transformer-XL evaluation of a whole split (1-D tokens); with the default layout every token after
    the first is scored exactly once, in corpus order.

    See `corpus_streams` for the layouts and `evaluate_streams` for the other arguments.
    """
    streams, tail = corpus_streams(tokens, batch_size, layout)
    result = evaluate_streams(model, streams, tgt_len=tgt_len, protocol=protocol, max_steps=max_steps, tail=tail,
                              return_token_losses=return_token_losses, progress=progress,
                              jit_compile=jit_compile, kv_cache=kv_cache, stop=stop)
    result.protocol["layout"] = layout
    return result


def evaluate_dataset(model, dataset: Iterable, *, protocol: Protocol | None = None, max_steps: int = 0,
                     progress_total: int | None = None, kv_cache: bool = True) -> EvalResult:
    """Evaluates any iterable of (inputs [B, L], targets [B, L]) batches whose rows continue each other.

    The state starts at a zero memory and is carried from batch to batch; a batch whose size differs from the
    previous one restarts it. `protocol` None keeps the model's training lengths (the trainer's periodic
    validation). Segments are weighted by their token count.
    """
    protocol = protocol or model.protocol
    start_time = time.perf_counter()
    total, count, batch_size, state, recurrent = 0.0, 0, None, None, None
    bar = _Progress(progress_total or max_steps or 0, progress_total is not None, unit="segment")
    for index, (inputs, targets) in enumerate(dataset):
        if max_steps and index >= max_steps:
            break
        if recurrent is None or inputs.shape[1] > recurrent.max_len:
            recurrent = Recurrent(model, protocol, max_len=int(inputs.shape[1]), use_cache=kv_cache)
            batch_size = None
        if inputs.shape[0] != batch_size:
            batch_size = int(inputs.shape[0])
            state = recurrent.initial_state(batch_size)
        nll, state = recurrent.score(tf.cast(inputs, tf.int32), tf.cast(targets, tf.int32), state)
        total += float(tf.reduce_sum(tf.cast(nll, tf.float64)))
        count += int(nll.shape[0] * nll.shape[1])
        bar.update(1, total / count)
    if not count:
        raise ValueError("the evaluation dataset yielded no batches")
    settings = dict(protocol="xl", **protocol.as_dict(), batch_size=batch_size, state=recurrent.state_form)
    return EvalResult(loss=total / count, num_tokens=count, seconds=time.perf_counter() - start_time,
                      protocol=settings)


def make_window_step(model, protocol: Protocol, jit_compile: bool = False):
    """A compiled vanilla step: windows [B, W] int32, targets [B] -> NLL [B] of each window's next token."""

    @tf.function(jit_compile=jit_compile)
    def step(windows, targets):
        hidden, _ = model(windows, protocol=protocol, training=False)  # [B, W, D]
        return model.nll(hidden[:, -1:], targets[:, None])[:, 0]  # [B]

    return step


def evaluate_vanilla(model, tokens: np.ndarray, *, window: int, batch_size: int = 10, max_steps: int = 0,
                     clamp_len: int = -1, return_token_losses: bool = False, progress: bool | str = False,
                     jit_compile: bool = False, stop: Callable[[], bool] | None = None) -> EvalResult:
    """The vanilla model's evaluation: a `window`-token context shifted by one token per prediction.

    The first window scores its `window` positions in one pass (contexts 1 .. window); then each forward pass
    of a window predicts one token. `batch_size` windows at consecutive positions share a forward pass.
    Per-token losses come back in corpus order (tokens 1 .. N - 1).
    """
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    if tokens.shape[0] <= window:
        raise ValueError(f"the split has {tokens.shape[0]} tokens; the vanilla window ({window}) needs more")
    check_inference_size(model, batch_size=min(batch_size, tokens.shape[0]), tgt_len=window, mem_len=0)
    settings = dict(protocol="vanilla", window=window, clamp_len=clamp_len, batch_size=batch_size)
    protocol = Protocol(mem_len=0, clamp_len=clamp_len, same_length=False)
    start_time = time.perf_counter()
    first = Recurrent(model, protocol, max_len=window, use_cache=False, jit_compile=jit_compile)
    nll0, _ = first.score(tf.constant(tokens[None, :window]), tf.constant(tokens[None, 1:window + 1]), None)
    pieces = [nll0[0]]
    total, count = float(tf.reduce_sum(tf.cast(nll0, tf.float64))), window
    windows = np.lib.stride_tricks.sliding_window_view(tokens, window + 1)[1:]  # [N - W - 1, W + 1]
    num_batches = math.ceil(windows.shape[0] / batch_size)
    if max_steps:
        num_batches = min(num_batches, max_steps)
    step = make_window_step(model, protocol, jit_compile=jit_compile)
    bar = _Progress(num_batches, progress, unit="batch", stop=stop)
    for index in range(num_batches):
        batch = windows[index * batch_size:(index + 1) * batch_size]
        nll = step(tf.constant(batch[:, :-1]), tf.constant(batch[:, -1]))
        total += float(tf.reduce_sum(tf.cast(nll, tf.float64)))
        count += int(nll.shape[0])
        pieces.append(nll)
        bar.update(1, total / count)
    token_losses = tf.concat(pieces, 0).numpy().astype(np.float32) if return_token_losses else None
    return EvalResult(loss=total / count, num_tokens=count, seconds=time.perf_counter() - start_time,
                      protocol=settings, token_losses=token_losses)


def save_token_losses(path: str, losses: np.ndarray) -> None:
    """Writes per-token NLL in corpus order: `.npy` (float32), otherwise text with one value per line."""
    from txl_tf.base import paths

    path = paths.output_file(path, "the token-loss file", "token_losses.npy")
    with paths.atomic_file(path, "wb") as f:  # written beside, renamed into place: never through a link
        if path.endswith(".npy"):
            np.save(f, np.asarray(losses, np.float32))
        else:
            np.savetxt(f, np.asarray(losses, np.float64), fmt="%.7g")


def print_result(result: EvalResult, level: str | None = None, file=sys.stdout) -> None:
    print(result.summary(level), file=file)
    print(result.protocol_line(), file=file)
