"""A long-range copy probe: a span of held-out text repeated at a known distance, against a control.

Every probe stream is a stretch of the test split (its start drawn with a seed) in which the last `span` tokens
are replaced by a copy of the `span` tokens that start `distance` tokens earlier. Its control is the same stream
with that earlier span replaced by other text of the split, so the last `span` tokens are identical in both and
have no earlier occurrence in the control. A model that can reach back `distance` tokens predicts the second copy
better than the control does; one that cannot scores the two alike. (The second copy against the first copy mixes
in the cost of the cut before the second copy, which starts mid-text: both figures are reported.) All streams
have the same length, with the second copy at the end and at least `lead` tokens before the first, so every
distance is scored in one batch of streams.

The figures per model, evaluation length and distance are the mean loss on the second copy minus that on the
control ("copy") and minus that on the first copy ("difference"), in bits per token over the copy's tokens after
its first, with 95% intervals from a bootstrap over the probe's examples.

Shapes: E examples per distance, G distances, B = E x G probe streams and B controls of T + 1 tokens each,
P = span - 1 scored copy tokens.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from txl_tf.model.protocol import Protocol
from txl_tf.study import scoring


@dataclasses.dataclass(frozen=True)
class Probe:
    """How the probe streams are made.

    Attributes:
      distances: tokens from the first copy's start to the second's (ascending).
      span: tokens per copy.
      examples: streams per distance.
      lead: the fewest tokens before the first copy.
      seed: draws the streams' starts in the split.
    """

    distances: tuple = (128, 256, 512, 1024, 2048)
    span: int = 40
    examples: int = 32
    lead: int = 640
    seed: int = 24

    @property
    def length(self) -> int:
        return self.lead + max(self.distances) + self.span  # T

    def streams(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(streams [2B, T + 1] int32: the B probe streams then their B controls, first [B] and second [B]
        positions of the copies' first tokens), example-major within each distance."""
        tokens = np.asarray(tokens, np.int32)
        room = tokens.shape[0] - self.length - 1
        if room <= 0 or any(d < self.span for d in self.distances):
            raise ValueError(f"the probe needs more than {self.length + 1:,} tokens and distances >= the span "
                             f"({self.span}); got {tokens.shape[0]:,} tokens and {self.distances}")
        rng = np.random.default_rng(self.seed)
        count = len(self.distances) * self.examples
        starts = rng.integers(0, room, size=count)
        others = rng.integers(0, tokens.shape[0] - self.span, size=count)  # the controls' replacement text
        rows, controls, first, second = [], [], [], []
        for index, start in enumerate(starts):
            distance = self.distances[index // self.examples]
            row = tokens[start:start + self.length + 1].copy()
            b = self.length - self.span + 1  # stream position of the second copy's first token
            a = b - distance
            row[b:b + self.span] = row[a:a + self.span]
            control = row.copy()
            control[a:a + self.span] = tokens[others[index]:others[index] + self.span]
            rows.append(row)
            controls.append(control)
            first.append(a)
            second.append(b)
        return np.stack(rows + controls), np.array(first), np.array(second)

    def copy_losses(self, losses: np.ndarray, first: np.ndarray, second: np.ndarray):
        """([B, P] losses on the first copy, [B, P] on the second, [B, P] on the control's last span) from
        per-prediction losses [2B, T] of `streams`; prediction j of a stream predicts its token j + 1."""
        offsets = np.arange(1, self.span)[None, :] - 1
        count = first.shape[0]
        rows = np.arange(count)[:, None]
        return (losses[rows, first[:, None] + offsets], losses[rows, second[:, None] + offsets],
                losses[rows + count, second[:, None] + offsets])


def score_recurrent(model, probe: Probe, tokens: np.ndarray, *, tgt_len: int, protocol: Protocol):
    """([B, P] x 3) losses (nats) on the two copies and the control with the segment-recurrent protocol."""
    from txl_tf.evaluation import loops as evaluation

    streams, first, second = probe.streams(tokens)
    result = evaluation.evaluate_streams(model, streams, tgt_len=tgt_len, protocol=protocol,
                                         return_token_losses=True)
    return probe.copy_losses(result.token_losses.reshape(streams.shape[0], -1), first, second)


def score_vanilla(model, probe: Probe, tokens: np.ndarray, *, window: int, batch_size: int = 32):
    """([B, P] x 3) losses (nats) on the two copies and the control with the vanilla window (only those are
    scored)."""
    streams, first, second = probe.streams(tokens)
    flat = streams.reshape(-1)
    width = streams.shape[1]
    count = first.shape[0]
    offsets = np.arange(1, probe.span)[None, :]
    out = []
    for rows, starts in ((0, first), (0, second), (count, second)):
        targets = ((rows + np.arange(count)) * width)[:, None] + starts[:, None] + offsets  # [B, P] in `flat`
        out.append(scoring.score_windows(model, flat, targets.reshape(-1), window=window,
                                         batch_size=batch_size).reshape(targets.shape))
    return tuple(out)


def _bootstrap(diff: np.ndarray, rng: np.random.Generator, samples: int) -> tuple[float, float]:
    means = diff[rng.integers(0, diff.shape[0], size=(samples, diff.shape[0]))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(low), float(high)


def summarize(first: np.ndarray, second: np.ndarray, control: np.ndarray, probe: Probe, *, samples: int = 2000,
              seed: int = 0) -> dict:
    """{distance: {first, second, control, copy (second - control), copy_low, copy_high, difference
    (second - first), low, high}} in bits per token; intervals are a bootstrap over the examples of that
    distance."""
    ln2 = np.log(2.0)
    out = {}
    rng = np.random.default_rng(seed)
    for g, distance in enumerate(probe.distances):
        rows = slice(g * probe.examples, (g + 1) * probe.examples)
        a, b, c = (x[rows].mean(axis=1, dtype=np.float64) / ln2 for x in (first, second, control))  # [E] each
        low, high = _bootstrap(b - a, rng, samples)
        copy_low, copy_high = _bootstrap(b - c, rng, samples)
        out[str(distance)] = {"first": float(a.mean()), "second": float(b.mean()), "control": float(c.mean()),
                              "copy": float((b - c).mean()), "copy_low": copy_low, "copy_high": copy_high,
                              "difference": float((b - a).mean()), "low": low, "high": high}
    return out
