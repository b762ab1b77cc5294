"""One fixed set of scored tokens for every model and every attention length of a study.

A split is cut into `batch_size` contiguous streams (`txl_tf.evaluation.loops.corpus_streams`, without its tail) and
every stream's first `drop` predictions are scored but thrown away, so the tokens kept have at least `drop`
tokens of real context before them whatever the memory: with `drop` >= n_layer x the longest memory, no kept
token sees the zero memory of the start, and every cell of a table scores exactly the same tokens.

The vanilla model costs one forward pass per token (its window moves by one), so it is scored on `subset`: evenly
spaced blocks of consecutive kept tokens. Comparisons with it pair the other models' losses on the same subset.

Shapes: B streams, S predictions per stream, D dropped predictions per stream, W the vanilla window.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from txl_tf.model.protocol import Protocol


@dataclasses.dataclass(frozen=True)
class ScoredTokens:
    """The kept predictions of a split: stream b's predictions D .. S - 1 (stream-major order).

    Attributes:
      tokens: [N] the split.
      batch_size: B streams.
      drop: D predictions dropped at the start of every stream.
      block: tokens per block of the vanilla subset (and of the bootstrap).
      subset_blocks: blocks of the vanilla subset (0: every kept token).
    """

    tokens: np.ndarray
    batch_size: int
    drop: int
    block: int = 100
    subset_blocks: int = 0

    @property
    def stream_len(self) -> int:
        return (self.tokens.shape[0] - 1) // self.batch_size  # S

    @property
    def count(self) -> int:
        return self.batch_size * (self.stream_len - self.drop)

    def streams(self) -> np.ndarray:
        """[B, S + 1] int32: stream b predicts tokens b*S + 1 .. b*S + S."""
        from txl_tf.evaluation.loops import corpus_streams

        return corpus_streams(self.tokens, self.batch_size)[0]

    def positions(self) -> np.ndarray:
        """[count] the corpus position of every kept target, in the order of the kept losses."""
        s = self.stream_len
        return (np.arange(self.batch_size)[:, None] * s + np.arange(self.drop, s)[None, :] + 1).reshape(-1)

    def subset(self) -> np.ndarray:
        """Indices (into the kept losses) of the vanilla subset: `subset_blocks` evenly spaced blocks of `block`
        consecutive kept tokens inside one stream each (all of them when subset_blocks is 0)."""
        if not self.subset_blocks:
            return np.arange(self.count)
        per_stream = self.stream_len - self.drop
        blocks_per_stream = per_stream // self.block
        total = self.batch_size * blocks_per_stream
        if self.subset_blocks > total:
            raise ValueError(f"the split has {total} blocks of {self.block} kept tokens; {self.subset_blocks} asked")
        chosen = np.linspace(0, total - 1, self.subset_blocks).round().astype(np.int64)
        starts = (chosen // blocks_per_stream) * per_stream + (chosen % blocks_per_stream) * self.block
        return (starts[:, None] + np.arange(self.block)[None, :]).reshape(-1)

    def check(self) -> None:
        if self.stream_len <= self.drop:
            raise ValueError(f"{self.tokens.shape[0]:,} tokens in {self.batch_size} streams give {self.stream_len:,} "
                             f"predictions per stream, not more than the {self.drop:,} dropped")


def score_recurrent(model, scored: ScoredTokens, *, tgt_len: int, protocol: Protocol):
    """(kept per-token losses [count] float32 in nats, EvalResult) of the segment-recurrent protocol."""
    from txl_tf.evaluation import loops as evaluation

    result = evaluation.evaluate_streams(model, scored.streams(), tgt_len=tgt_len, protocol=protocol,
                                         return_token_losses=True)
    losses = result.token_losses.reshape(scored.batch_size, scored.stream_len)[:, scored.drop:]
    return losses.reshape(-1), result


def score_windows(model, tokens: np.ndarray, positions: np.ndarray, *, window: int, batch_size: int = 32,
                  clamp_len: int = -1) -> np.ndarray:
    """Losses [P] float32 (nats) of the vanilla model predicting tokens[p] from the `window` tokens before it, for
    every p of `positions` (each >= window)."""
    import tensorflow as tf

    from txl_tf.evaluation import loops as evaluation

    positions = np.asarray(positions, np.int64)
    if positions.min() < window:
        raise ValueError(f"position {positions.min()} has fewer than {window} tokens before it")
    tokens = np.asarray(tokens, np.int32)
    step = evaluation.make_window_step(model, Protocol(mem_len=0, clamp_len=clamp_len, same_length=False))
    offsets = np.arange(-window, 0)[None, :]
    pieces = []
    for start in range(0, positions.shape[0], batch_size):
        chunk = positions[start:start + batch_size]
        windows = tokens[chunk[:, None] + offsets]  # [b, W]
        pieces.append(step(tf.constant(windows), tf.constant(tokens[chunk])).numpy())
    return np.concatenate(pieces).astype(np.float32)


def bits(losses: np.ndarray) -> float:
    """Mean loss in bits per token (float64 sum)."""
    return float(np.mean(losses, dtype=np.float64) / math.log(2.0))
