"""The decoding engine's driver with txl_tf's settings (temperature, top_k, top_p, seed), and its host-side helpers.

`Generator(lm)` is the one function that `python -m txl_tf.generate`, the trainer's samples, the SavedModel's
`generate` signature and `txl_tf.TransformerXLCausalLM.generate(..., temperature=...)` run: a tf.function around
the keras-hub task's `generate_step` (`txl_tf.lm.hub.TransformerXLCausalLM`: the prompts consumed in segments, then
keras-hub's sampler loop over the recurrent state, where the encoding allows it in a ring of keys/values: a slot
written per token at batch 1, once per block of tokens for more rows, `_block_decode`). keras-hub's own `generate` runs the same `generate_step` with compile()'s sampler.

The settings choose keras-hub's samplers: temperature 0 is its `GreedySampler`, any other its `TopPSampler`
(`Sampling`: top_p of the probabilities at `temperature`, among the top_k likeliest tokens). They are variables
of the function, not constants traced into it, so one trace serves every setting, and the SavedModel takes them
per call: the same prompts, settings and seed give the same tokens in Python, from the command line and from the
SavedModel.

This module imports neither `txl_tf.lm.hub` nor `txl_tf.lm.generation` (the task is passed in).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import time
from collections.abc import Sequence

import keras
import keras_hub
import numpy as np
import tensorflow as tf

from txl_tf.base.errors import ConfigError
from txl_tf.model.attention import without_runtime_asserts


@dataclasses.dataclass
class GenerationResult:
    """tokens: int32 [B, max_tokens], each row's continuation; seconds: the wall time of the call (the prompt and
    the new tokens; a first call traces and compiles the function too)."""

    tokens: np.ndarray
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens.size / self.seconds if self.seconds > 0 else float("inf")


class Sampling(keras_hub.samplers.TopPSampler):
    """keras-hub's TopPSampler (the likeliest tokens that make up `top_p` of the probability at `temperature`),
    among the `top_k` likeliest tokens (0: all). The settings and the seed are variables: `set` them before a call.

    top_k is a mask on the probabilities (renormalised), not a slice: no shape depends on it (XLA). Without
    top_k and top_p nothing is sorted: the token is drawn from the probabilities at `temperature` as they are."""

    def __init__(self):
        super().__init__(p=1.0, k=None, seed=0)
        self.temperature = tf.Variable(1.0, trainable=False, name="temperature")
        self.p = tf.Variable(1.0, trainable=False, name="top_p")
        self.top_k = tf.Variable(0, trainable=False, name="top_k")

    @property
    def variables(self) -> list:
        """What a SavedModel holding this sampler must track: the settings and the random state."""
        return [self.temperature, self.p, self.top_k, self.seed_generator.state]

    def set(self, temperature, top_k, top_p, seed):
        """The settings of the next call; the random state restarts from `seed` (keras' SeedGenerator(seed))."""
        self.temperature.assign(temperature)
        self.top_k.assign(top_k)
        self.p.assign(top_p)
        state = self.seed_generator.state
        state.assign(tf.cast(tf.stack([seed, 0]), state.dtype))

    def compute_probabilities(self, logits):
        probabilities = super().compute_probabilities(logits)  # softmax(logits / temperature), float32 [B, V]
        vocab = tf.shape(probabilities)[-1]

        def top_k(probabilities):
            k = tf.minimum(self.top_k, vocab)
            kth = tf.gather(tf.sort(probabilities, direction="DESCENDING"), k - 1, axis=-1)  # [B]
            kept = tf.where(probabilities >= kth[:, None], probabilities, tf.zeros_like(probabilities))
            return kept / tf.reduce_sum(kept, axis=-1, keepdims=True)

        # A sort per token only where top_k keeps fewer than all (it is most of a step's sampling at batch 32).
        return tf.cond((self.top_k > 0) & (self.top_k < vocab), lambda: top_k(probabilities),
                       lambda: probabilities)

    def get_next_token(self, probabilities):
        """keras-hub's top-p choice where top_p < 1; otherwise a draw from all the probabilities without the sort
        that top-p needs (the same distribution): one uniform number per row against the cumulative
        probabilities, where keras' categorical draws a number per token (its 200 draws took ~0.1 ms of a ~1 ms
        decoding step at batch 1 under XLA; this draw cut the step by 7-13% on a 2-core Xeon, 2026-11-27)."""

        def everything(probabilities):
            uniform = keras.random.uniform([tf.shape(probabilities)[0], 1], seed=self.seed_generator)
            cumulative = tf.math.cumsum(probabilities, axis=-1)
            total = cumulative[:, -1:]
            below = tf.reduce_sum(tf.cast(cumulative <= uniform * total, tf.int32), axis=-1)
            # At most the last token of non-zero probability (uniform * total can round up to total).
            last = tf.reduce_sum(tf.cast(cumulative < total, tf.int32), axis=-1)
            return tf.minimum(below, last)

        return tf.cond(self.p < 1.0, lambda: super(Sampling, self).get_next_token(probabilities),
                       lambda: everything(probabilities))


PIECE_SECONDS = 0.025  # a time-sized stream's pieces: about this long each (40 a second)
MOST_PIECE = 4096  # and at most this many tokens


def next_piece(tokens: int, seconds: float) -> int:
    """A time-sized stream's next piece after one of `tokens` tokens that took `seconds`: the tokens that take about
    PIECE_SECONDS at that rate, at least 1, at most 8 times the last piece (one fast piece does not make the next
    one long) and MOST_PIECE."""
    rate = tokens / max(seconds, 1e-6)
    return int(min(max(1, round(rate * PIECE_SECONDS)), 8 * tokens, MOST_PIECE))


class Generator(tf.Module):
    """The generation function of a keras-hub `TransformerXLCausalLM` (`lm`: its `generate_step`, its weights):
    prompts consumed in segments of the backbone's `segment_len` under its generation protocol.

    `generate(token_ids [B, T] int32, padding_mask [B, T] int32, seed, temperature, top_k, top_p)` -> token_ids
    [B, T]: each row's prompt (its first padding_mask.sum() tokens, right-padded) followed by sampled tokens up to T.
    """

    def __init__(self, lm):
        super().__init__(name="generator")
        model = lm.backbone.transformer_xl
        object.__setattr__(self, "_lm", lm)  # untracked: the model's weights are its holder's to save
        self.sampling = Sampling()
        self.sampling_variables = self.sampling.variables
        self.greedy = keras_hub.samplers.GreedySampler()
        self.n_token = model.n_token
        # The task's defaults, never a compile() choice of its user: the command line's and the SavedModel's
        # speed does not depend on a compile call.
        self._ring = lm._decodes_in_a_ring(compiled=False)
        self._jit = lm._generate_jit(compiled=False)
        self._loop = tf.function(self._decode, jit_compile=self._jit)
        self.generate = tf.function(self._checked)
        # A stream's chunk: its sampler settings and random state, then the call (untracked: no state to save).
        object.__setattr__(self, "_lock", threading.Lock())
        self._start = tf.function(self._stream_start, jit_compile=self._jit)
        self._advance = tf.function(self._stream_advance, jit_compile=self._jit)

    def _decode(self, token_ids, padding_mask, sample):
        inputs = {"token_ids": token_ids, "padding_mask": padding_mask}

        def run(sampler):
            return self._lm.generate_step(inputs, ring=self._ring, sampler=sampler)["token_ids"]

        # Traced once; under XLA without the Assert ops it would drop with a warning each (as keras-hub's generate)
        with without_runtime_asserts() if self._jit else contextlib.nullcontext():
            return tf.cond(sample, lambda: run(self.sampling), lambda: run(self.greedy))

    def stream(self, prompt: Sequence[int], *, max_tokens: int, chunk: int | None = None, temperature: float = 1.0,
               top_k: int = 0, top_p: float = 1.0, seed: int = 0):
        """Yields `max_tokens` new token ids after one prompt (a list of ids), a piece at a time (int32 arrays):
        the tokens `generate` gives for the same settings and seed, as they are made, whatever the pieces.

        The prompt is read once; each piece is one call of a compiled loop that carries the decoding state (the
        ring of keys and values, or the model's cache) to the next call, so a piece costs its tokens' steps and
        one call, and the text can be shown while the rest is made. `chunk`: new tokens a piece; None (the
        default) sizes the pieces by time: the first is one token, each next one the tokens that take about
        PIECE_SECONDS at the rate of the piece before (`next_piece`), so the call's fixed cost is a small share
        of a piece whatever the model and the context. The settings are the caller's to check (`check_settings`)."""
        if max_tokens < 1 or (chunk is not None and chunk < 1) or not prompt:
            raise ValueError(f"stream needs a prompt, max_tokens >= 1 and chunk None or >= 1; got {len(prompt)} "
                             f"prompt tokens, max_tokens={max_tokens}, chunk={chunk}")
        token_ids, mask = padded([list(prompt)], len(prompt) + max_tokens)
        token_ids, mask = tf.constant(token_ids), tf.constant(mask, tf.bool)
        settings = (temperature if temperature > 0 else 1.0, top_k, top_p)
        sample = tf.constant(temperature > 0)
        # The sampler is not read before the first chunk; the ring's batch-1 kernels are arranged once, here, for
        # every chunk (`_row_kernels`): the weights as the stream starts.
        cache, position_keys, kernels = self._start(token_ids, mask)
        index, width = len(prompt), len(prompt) + max_tokens
        # Every chunk calls the loop's concrete function, traced once here: calling the `tf.function` instead adds
        # its dispatch over the ~40 tensors of the state and the kernels to every chunk (docs/performance.md).
        advance = self._advance.get_concrete_function(token_ids, mask, cache, position_keys, kernels,
                                                      tf.constant(index, tf.int32), tf.constant(index, tf.int32),
                                                      sample)
        # The sampler's settings and random state are this Generator's, shared by every call: a sampled stream
        # keeps its own and puts them back before each chunk, so that another stream read in between, or a
        # `generate` call, changes none of its tokens. A greedy one reads neither (keras-hub's GreedySampler).
        state = None  # the random state after the last chunk (None: the seed's)
        piece = chunk or 1
        while index < width:
            stop = min(index + piece, width)
            start = time.perf_counter()
            with self._lock if temperature > 0 else contextlib.nullcontext():
                if temperature > 0:
                    self.sampling.set(*settings, seed)
                    if state is not None:
                        self.sampling.seed_generator.state.assign(state)
                token_ids, cache = advance(token_ids, mask, cache, position_keys, kernels,
                                           tf.constant(index, tf.int32), tf.constant(stop, tf.int32), sample)
                if temperature > 0:
                    state = tf.identity(self.sampling.seed_generator.state)
            made = token_ids.numpy()[0, index:stop]  # one copy to the host, no slicing op
            if chunk is None:  # the call's time, not the reader's between pieces
                piece = next_piece(stop - index, time.perf_counter() - start)
            yield made
            index = stop

    def _stream_start(self, token_ids, padding_mask):
        """(the decoding state after the prompt, the position keys, the ring's batch-1 kernels or None):
        `_decode`'s start, kept between calls."""
        lm = self._lm
        lengths = tf.reduce_sum(tf.cast(padding_mask, tf.int32), axis=1)
        with without_runtime_asserts() if self._jit else contextlib.nullcontext():
            if not self._ring:
                return (*lm._build_cache(token_ids, lengths)[1:], None)
            width = token_ids.shape[1]
            _, cache, position_keys = lm._build_cache(token_ids, lengths, lm._ring_protocol(width))
            ring = lm._to_ring(cache, width)
            return ring, position_keys, lm._row_kernels(ring)

    def _stream_advance(self, token_ids, padding_mask, state, position_keys, kernels, index, stop, sample):
        """The tokens at index .. stop - 1 (keras-hub's sampler loop, one step per token) and the state after."""
        lm = self._lm
        next = lm._ring_next(position_keys, state, kernels) if self._ring else lm._cached_next(position_keys)

        def run(sampler):
            def body(prompt, cache, i):
                logits, _, cache = next(prompt, cache, i)
                token = tf.cast(sampler.get_next_token(sampler.compute_probabilities(logits)), prompt.dtype)
                token = tf.where(padding_mask[:, i], prompt[:, i], token)  # a prompt's own tokens stay
                return keras.ops.slice_update(prompt, [0, i], token[:, None]), cache, i + 1

            prompt, after, _ = tf.while_loop(lambda prompt, cache, i: i < stop, body, (token_ids, state, index))
            return prompt, after

        with without_runtime_asserts() if self._jit else contextlib.nullcontext():
            return tf.cond(sample, lambda: run(self.sampling), lambda: run(self.greedy))

    def _checked(self, token_ids, padding_mask, seed, temperature, top_k, top_p):
        n_token = self.n_token
        ids = f"token_ids: every token id must be in [0, n_token) = [0, {n_token})"
        same_shape = tf.debugging.assert_equal(tf.shape(padding_mask), tf.shape(token_ids),
                                               message="padding_mask: must have the shape of token_ids [B, T]")
        with tf.control_dependencies([same_shape]):  # before the checks that compare them element by element
            padding_mask = tf.identity(padding_mask)
        lengths = tf.reduce_sum(tf.cast(padding_mask, tf.int32), axis=1)
        temperature_range = "temperature must be finite and >= 0 (0: greedy)"
        top_k_range = f"top_k must be between 0 (all) and the vocabulary size {n_token}"
        top_p_range = "top_p must be in (0, 1] (1: all)"
        checks = [
            tf.debugging.assert_non_negative(token_ids, message=ids),
            tf.debugging.assert_less(token_ids, n_token, message=ids),
            tf.debugging.assert_positive(lengths, message="padding_mask: every row needs a prompt of >= 1 token"),
            tf.debugging.assert_equal(tf.cast(padding_mask, tf.int32),
                                      tf.sequence_mask(lengths, tf.shape(token_ids)[1], tf.int32),
                                      message="padding_mask: 1 over the prompt of each row, then 0 for right padding"),
            # NaN fails every comparison: refused by the first of each pair.
            tf.debugging.assert_greater_equal(temperature, 0.0, message=temperature_range),
            tf.debugging.assert_less_equal(temperature, np.finfo(np.float32).max, message=temperature_range),
            tf.debugging.assert_non_negative(top_k, message=top_k_range),
            tf.debugging.assert_less_equal(top_k, n_token, message=top_k_range),
            tf.debugging.assert_greater(top_p, 0.0, message=top_p_range),
            tf.debugging.assert_less_equal(top_p, 1.0, message=top_p_range)]
        with tf.control_dependencies(checks):  # nothing reads the inputs before every check has passed
            self.sampling.set(tf.where(temperature > 0, temperature, 1.0), top_k, top_p, seed)
            token_ids, padding_mask, sample = tf.identity(token_ids), tf.cast(padding_mask, tf.bool), temperature > 0
            if token_ids.shape[0] is not None:
                return self._loop(token_ids, padding_mask, sample)
            # A batch of unknown size (the SavedModel's signature): one row goes to a loop traced for one row,
            # whose projections run as two half-width products (`txl_tf.model.projection.dense_row`).
            return tf.cond(tf.equal(tf.shape(token_ids)[0], 1),
                           lambda: self._loop(tf.reshape(token_ids, [1, -1]), tf.reshape(padding_mask, [1, -1]),
                                              sample),
                           lambda: self._loop(token_ids, padding_mask, sample))


def padded(prompts: Sequence[Sequence[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
    """(token_ids [B, width] right-padded with 0, padding_mask [B, width] int32) of token prompts."""
    token_ids = np.zeros([len(prompts), width], np.int32)
    mask = np.zeros([len(prompts), width], np.int32)
    for row, prompt in enumerate(prompts):
        token_ids[row, :len(prompt)] = prompt
        mask[row, :len(prompt)] = 1
    return token_ids, mask


def generate_with(generate, prompts: Sequence[Sequence[int]], *, max_tokens: int, temperature: float = 1.0,
                  top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> GenerationResult:
    """`max_tokens` tokens after each of `prompts` (token id lists of any lengths >= 1) from `generate`
    (`Generator.generate`, or a SavedModel's `generate` signature: the same function)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive; got {max_tokens}")
    lengths = [len(prompt) for prompt in prompts]
    if not prompts or min(lengths) < 1:
        raise ValueError("every prompt needs at least one token")
    token_ids, mask = padded(prompts, max(lengths) + max_tokens)
    start = time.perf_counter()
    out = generate(token_ids=tf.constant(token_ids), padding_mask=tf.constant(mask),
                   seed=tf.constant(seed, tf.int32), temperature=tf.constant(temperature, tf.float32),
                   top_k=tf.constant(top_k, tf.int32), top_p=tf.constant(top_p, tf.float32))
    out = (out["token_ids"] if isinstance(out, dict) else out).numpy()
    seconds = time.perf_counter() - start
    tokens = np.stack([out[row, length:length + max_tokens] for row, length in enumerate(lengths)])
    return GenerationResult(tokens=tokens.astype(np.int32), seconds=seconds)


def with_prompt(vocab, prompt: str, continuation: str) -> str:
    """The prompt followed by its decoded continuation, as `python -m txl_tf.generate` prints it.

    Word level: `Vocab.decode` joins words with spaces, so the prompt's last word and the first new one get one
    space between them (none when either side already has whitespace there).
    """
    joiner = " " if vocab.level == "word" and prompt and not prompt[-1].isspace() and continuation \
        and not continuation[0].isspace() else ""
    return prompt + joiner + continuation


def text_pieces(vocab, prompt: str, chunks):
    """The prompt, then the text each chunk of new token ids (`Generator.stream`) adds to it: joined, the
    `with_prompt` text of all the chunks (`TransformerXLCausalLM.stream_generate`, `python -m txl_tf.generate
    --stream`)."""
    made, shown = [], prompt
    yield prompt
    for tokens in chunks:
        made += tokens.tolist()
        text = with_prompt(vocab, prompt, vocab.decode(made))
        yield text[len(shown):]
        shown = text


def check_settings(vocab, prompts: Sequence[str] | str, *, max_tokens: int, temperature: float, top_k: int,
                   top_p: float = 1.0) -> list:
    """Checks the sampling settings against the vocabulary; returns each prompt's ids (errors.ConfigError).

    temperature: >= 0 and finite (0 = greedy: always the most likely token; 1 = the model's distribution).
    top_k: 0 (all tokens) to the vocabulary size. top_p: in (0, 1] (1 = off). max_tokens: >= 1. Every prompt is a
    str (a TypeError names another type) and every symbol of it must be in the vocabulary (a word-level vocabulary
    with an unknown-word symbol maps unknown words to it).
    """
    if not math.isfinite(temperature) or temperature < 0:
        raise ConfigError(f"--temperature={temperature} must be >= 0 (0 = greedy, 1 = the model's distribution)")
    if not 0 <= top_k <= len(vocab):
        raise ConfigError(f"--top_k={top_k} must be between 0 (all tokens) and the vocabulary size {len(vocab)}")
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise ConfigError(f"--top_p={top_p} must be in (0, 1] (1 = off; 0.9 keeps the likeliest tokens that make "
                          "up 90% of the probability)")
    if max_tokens < 1:
        raise ConfigError(f"--max_tokens={max_tokens} must be >= 1")
    if isinstance(prompts, str):  # one prompt
        prompts = [prompts]
    if not prompts:
        raise ConfigError("give at least one --prompt")
    all_ids = []
    for prompt in prompts:  # bytes would encode as ids (or as that many zero bytes): refused by type
        all_ids.append(list(vocab.encode_prompt(prompt, f"--prompt={prompt!r}", "a prompt must be a str")))
    return all_ids
