"""Feeding text through a model with its recurrent state: one protocol, one state, one segment loop.

Evaluation, attention maps and the prompt of generation all cut text into segments and carry the state from one
call of the model to the next. `Recurrent` binds a model to a `Protocol` and a state form and gives the calls
(`forward`, and the compiled `score` and `next_log_probs`); `run_segments` is the loop they share.

State forms (the types of `txl_tf.model.state`, which owns their layout):
  "cache" (the default whenever the model supports it): a `Cache`, the memory's keys and values plus the position
    keys (`TransformerXL.initial_cache`); each call projects only its own tokens.
  "memory": a `Memory`, the hidden states, as in training and in the authors' code; every call projects the whole
    memory.
Both give the same numbers (tests/test_model.py).

Shapes: B rows (streams or prompts), L segment length, T tokens per row, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from txl_tf.model import tensor_ops as T
from txl_tf.model.protocol import Protocol
from txl_tf.model.state import State


class Recurrent:
    """A model, the protocol of its calls and the form of its state.

    Args:
      model: a `TransformerXL`.
      protocol: the attention lengths (default: the model's training lengths).
      max_len: the longest segment a call will pass (sizes the cache's position keys).
      use_cache: carry keys/values when the model supports it (`model.supports_cache`); else the hidden memory.
      jit_compile: XLA for the compiled calls (TensorFlow's `tf.function`; on the other backends the calls run
        eagerly, PyTorch's without autograd).
    """

    def __init__(self, model, protocol: Protocol | None = None, *, max_len: int, use_cache: bool = True,
                 jit_compile: bool = False):
        self.model = model
        self.protocol = protocol or model.protocol
        self.max_len = int(max_len)
        self.use_cache = bool(use_cache) and model.supports_cache(self.protocol)
        self.score = _compiled(self._score, jit_compile)
        self.next_log_probs = _compiled(self._next_log_probs, jit_compile)

    @property
    def state_form(self) -> str:
        return "cache" if self.use_cache else "memory"

    def initial_state(self, batch_size: int) -> State:
        """The state of a zero memory for `batch_size` rows: a `Cache` or a `Memory` (`state_form`)."""
        if self.use_cache:
            return self.model.initial_cache(batch_size, self.protocol, max_len=self.max_len)
        return self.model.initial_memory(batch_size, self.protocol)

    def forward(self, tokens, state: State | None, lengths=None, return_probs: bool = False):
        """(hidden [B, L, d], new state[, probs [n, B, N, L, K]]) of one segment (traceable, not compiled)."""
        if return_probs:
            return self.model.call_with_attention(tokens, state, protocol=self.protocol)
        return self.model(tokens, state, protocol=self.protocol, lengths=lengths, training=False)

    def _score(self, inputs, targets, state):
        hidden, state = self.forward(inputs, state)
        return self.model.nll(hidden, targets), state  # [B, L] float32

    def _next_log_probs(self, tokens, state, lengths=None):
        """Log-probabilities [B, V] of the token after each row's last one (position lengths - 1), new state."""
        hidden, state = self.forward(tokens, state, lengths)  # [B, L, d]
        if lengths is None:
            last = hidden[:, -1]
        else:
            last = T.batch_gather(hidden, T.maximum(T.cast(lengths, T.int32) - 1, 0)[:, None], 1)[:, 0]  # [B, d]
        return self.model.log_probs(last[:, None])[:, 0], state


def _compiled(function, jit_compile: bool):
    """`function` as a `tf.function` on TensorFlow; elsewhere as it is (PyTorch: without recording gradients)."""
    if T.TENSORFLOW:
        import tensorflow as tf

        return tf.function(function, jit_compile=jit_compile)
    if T.BACKEND == "torch":
        import torch

        return torch.no_grad()(function)
    return function


def segment_bounds(length: int, seg_len: int, max_steps: int = 0) -> list[tuple[int, int]]:
    """(start, end) of each segment of `seg_len` covering `length` positions (the last may be shorter)."""
    bounds = [(start, min(start + seg_len, length)) for start in range(0, length, seg_len)]
    return bounds[:max_steps] if max_steps else bounds


def run_segments(step: Callable, state, tokens: np.ndarray, seg_len: int, *, targets: np.ndarray | None = None,
                 lengths: np.ndarray | None = None, max_steps: int = 0, on_output: Callable | None = None):
    """Feeds rows of tokens to `step` segment by segment, carrying the state.

    Args:
      step: called as step(tokens [B, L][, targets [B, L]][, lengths [B]], state) -> (output, new state).
      tokens: [B, T] int32; targets: optional [B, T] sliced like the tokens.
      lengths: optional [B] tokens per row (the rest is padding); each segment gets its rows' counts in it.
      max_steps: stop after this many segments (0 = all).
      on_output: called with each segment's output (progress, sums).

    Returns:
      (the outputs in order, the final state).
    """
    tokens = np.asarray(tokens, np.int32)
    outputs = []
    for start, end in segment_bounds(tokens.shape[1], seg_len, max_steps):
        args = [T.convert_to_tensor(tokens[:, start:end])]
        if targets is not None:
            args.append(T.convert_to_tensor(np.asarray(targets[:, start:end], np.int32)))
        if lengths is not None:
            args.append(T.convert_to_tensor(np.clip(np.asarray(lengths) - start, 0, end - start).astype(np.int32)))
        output, state = step(*args, state)
        outputs.append(output)
        if on_output is not None:
            on_output(output)
    return outputs, state
