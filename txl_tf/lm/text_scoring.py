"""Text scored as streams with a model's evaluation protocol: `ScoreResult` (per-token log-probabilities and their
totals) and `ScoreStream` (piece by piece, the state kept between pieces), what
`txl_tf.TransformerXLCausalLM.score_text` and `stream_text` return.

A scored text is one stream: its first token is context, every later one is scored (natural log), in segments of
`EvalConfig.tgt_len` starting from a zero memory, the state carried from segment to segment. That is
`python -m txl_tf.evaluate` with `EvalConfig.batch_size=1` and `max_steps=0` on the same tokens.
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np

from txl_tf.base.errors import ConfigError
from txl_tf.configs import check_inference_size
from txl_tf.evaluation.loops import LossFigures
from txl_tf.model.inference import run_segments


@dataclasses.dataclass
class ScoreResult(LossFigures):
    """What a text scored: the log-probability of every token after the first and the totals.

    Attributes:
      log_probs: [T - 1] float32 natural-log probabilities of tokens 2..T of the text, in order.
      level: the vocabulary's level ("char": bpc is the figure; "word": perplexity).
    """

    log_probs: np.ndarray
    level: str

    @property
    def num_tokens(self) -> int:
        """Tokens scored (T - 1)."""
        return int(self.log_probs.size)

    @property
    def nats(self) -> float:
        """Total negative log-likelihood (natural log), summed in float64."""
        return float(-np.sum(self.log_probs, dtype=np.float64))

    @property
    def loss(self) -> float:
        """Mean negative log-likelihood per scored token (nats), evaluate's `loss`; NaN when none was scored."""
        return self.nats / self.num_tokens if self.num_tokens else float("nan")

    def summary(self) -> str:
        """One line: nats, tokens, and bpc (char level) or perplexity (word level)."""
        metric = f"bpc {self.bpc:.4f}" if self.level == "char" else f"ppl {self.perplexity:.3f}"
        return f"loss {self.loss:.5f}  {metric}  tokens {self.num_tokens}  nats {self.nats:.4f}"


class ScoreStream:
    """Scores text piece by piece with the model's state kept between the pieces (`TransformerXLCausalLM.stream_text`).

    The segments are those of one `score_text` call on the whole text (EvalConfig.tgt_len from the first token): a
    piece that ends inside a segment is scored at once from the state before that segment, and the segment is run
    again, whole, once the next pieces complete it. So the pieces' log-probabilities, concatenated, are those of
    scoring the concatenation in one call. Pieces are encoded one by one: at word level end them at a line end
    (a newline) or between words, so that their encodings concatenate to the whole text's.
    """

    def __init__(self, lm):
        if lm.eval_config.protocol != "xl":
            raise ConfigError(f"streaming needs the recurrent protocol; this model's EvalConfig.protocol is "
                              f"{lm.eval_config.protocol!r} (a window without memory): use score_text()")
        check_inference_size(lm.transformer_xl, batch_size=1, tgt_len=lm.eval_config.tgt_len,
                             mem_len=lm.eval_config.mem_len)
        self._lm = lm
        self.reset()

    def reset(self) -> None:
        """Starts a new text: a zero memory, nothing scored."""
        self._state = self._lm.scorer().initial_state(1)
        self._pending = np.zeros([0], np.int32)  # tokens from the start of the segment not yet run whole
        self._scored: list[np.ndarray] = []

    def score(self, piece: str) -> ScoreResult:
        """Scores the tokens `piece` adds (its first one too, when earlier pieces gave it a context)."""
        ids = self._lm.encode(piece, what="piece")
        tokens = np.concatenate([self._pending, ids])
        new = tokens.size - max(self._pending.size, 1)  # targets this piece adds
        nll = np.zeros([0], np.float32)
        if tokens.size >= 2:
            seg_len = self._lm.eval_config.tgt_len
            whole = (tokens.size - 1) // seg_len * seg_len  # inputs that fill segments: run, and the state kept
            parts = []
            if whole:
                outputs, self._state = run_segments(self._lm.scorer().score, self._state, tokens[None, :whole], seg_len,
                                                    targets=tokens[None, 1:whole + 1])
                parts += outputs
            if tokens.size - 1 > whole:  # the segment this piece ends inside: scored, its state not kept
                outputs, _ = run_segments(self._lm.scorer().score, self._state, tokens[None, whole:-1], seg_len,
                                          targets=tokens[None, whole + 1:])
                parts += outputs
            nll = keras.ops.convert_to_numpy(keras.ops.concatenate(parts, axis=1))[0]
            self._pending = tokens[whole:]
        else:
            self._pending = tokens
        log_probs = -nll[nll.size - new:] if new > 0 else np.zeros([0], np.float32)
        self._scored.append(log_probs)
        return ScoreResult(log_probs, self._lm.vocab.level)

    def result(self) -> ScoreResult:
        """Everything scored since the start (or `reset`)."""
        return ScoreResult(np.concatenate([np.zeros([0], np.float32), *self._scored]), self._lm.vocab.level)


def short_text(text) -> str:
    return repr(text if len(text) <= 40 else text[:37] + "...")


def _bytes_hint(value) -> str:
    return "; decode bytes first, e.g. data.decode('utf-8')" if isinstance(value, (bytes, bytearray, memoryview)) \
        else ""


def check_text(value, what: str) -> None:
    """TypeError naming the type unless `value` is a str (bytes are refused: decode them first)."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str; got {type(value).__name__}{_bytes_hint(value)}")


def as_texts(value, what: str) -> tuple[bool, list[str]]:
    """(whether `value` is one text, its texts): a str, or a list, tuple or 1-D array of str; anything else (bytes,
    a list of ids) is a TypeError naming the type."""
    if isinstance(value, str):
        return True, [value]
    if not (isinstance(value, (list, tuple)) or (isinstance(value, np.ndarray) and value.ndim == 1)):
        raise TypeError(f"{what} must be a str or a list of str; got {type(value).__name__}{_bytes_hint(value)}")
    for index, text in enumerate(value):
        check_text(text, f"{what}[{index}]")
    return False, [str(text) for text in value]
