"""Autoregressive sampling with Transformer-XL memory.

The prompt is consumed in segments (memory carried), then every new token costs one forward pass of a single
position that attends to the memory: the context is never recomputed. The decode loop is one `tf.function`
(a `tf.while_loop` with the memory as a loop variable), sampling with stateless RNG seeded by
(seed, step): the same seed gives the same text.

The model is reached through a `logits_fn(tokens [B, L] int32, mems) -> (log_probs [B, V] float32 of the
last position, new_mems)`, so the same loop drives a Python `TransformerXL` (`model_logits_fn`) and an exported
SavedModel's `next_token_logits` signature (`saved_model_logits_fn`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import numpy as np
import tensorflow as tf

from txl_tf.errors import ConfigError, one_line

LogitsFn = Callable[[tf.Tensor, tf.Tensor], tuple]


@dataclasses.dataclass
class GenerationResult:
    """Generated tokens and speed.

    Attributes:
      tokens: [B, max_tokens] int32 sampled tokens (the prompt excluded).
      mems: the memory state after the prompt and all generated tokens (to continue generating).
      prompt_seconds: time to consume the prompt; decode_seconds: time of the sampling loop (traced beforehand).
    """

    tokens: np.ndarray
    mems: tf.Tensor
    prompt_seconds: float
    decode_seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens.size / self.decode_seconds if self.decode_seconds > 0 else float("nan")


def model_logits_fn(model) -> LogitsFn:
    """`logits_fn` of a Python TransformerXL: log-probabilities of the last position."""

    def logits_fn(tokens, mems):
        hidden, new_mems = model(tokens, mems=mems, training=False)  # [B, L, D]
        return model.log_probs(hidden[:, -1:])[:, 0], new_mems  # [B, V]

    return logits_fn


def saved_model_logits_fn(loaded) -> LogitsFn:
    """`logits_fn` of a SavedModel written by `txl_tf.export` (its `next_token_logits` signature)."""
    signature = loaded.signatures["next_token_logits"]

    def logits_fn(tokens, mems):
        out = signature(tokens=tokens, mems=mems)
        return out["logits"], out["new_mems"]

    return logits_fn


def sample_next(logits: tf.Tensor, seed: tf.Tensor, temperature: float, top_k: int) -> tf.Tensor:
    """Samples one token per row of `logits` [B, V]; temperature 0 is greedy. Returns [B] int32.

    Args:
      seed: [2] int32 stateless seed.
      top_k: keep only the k most likely tokens (0 = all).
    """
    if temperature <= 0.0:
        return tf.argmax(logits, axis=-1, output_type=tf.int32)
    logits = tf.cast(logits, tf.float32) / temperature
    if top_k:
        kth = tf.math.top_k(logits, k=top_k).values[:, -1:]  # [B, 1]
        logits = tf.where(logits < kth, tf.fill(tf.shape(logits), -1e30), logits)
    return tf.cast(tf.random.stateless_categorical(logits, 1, seed=seed)[:, 0], tf.int32)


def consume_prompt(logits_fn: LogitsFn, prompt: np.ndarray, mems: tf.Tensor, segment_len: int):
    """Feeds the prompt [B, P] in segments of `segment_len`; returns (log_probs [B, V] of the next token, mems)."""
    prompt = np.asarray(prompt, np.int32)
    if prompt.ndim != 2 or prompt.shape[1] < 1:
        raise ValueError(f"the prompt must be [batch, length >= 1] tokens; got shape {prompt.shape}")
    step = tf.function(logits_fn)
    logits = None
    for start in range(0, prompt.shape[1], segment_len):
        logits, mems = step(tf.constant(prompt[:, start:start + segment_len]), mems)
    return logits, mems


def make_decoder(logits_fn: LogitsFn, temperature: float, top_k: int):
    """A tf.function (first_logits [B, V], mems, seed [] int32, num_tokens [] int32) -> (tokens [B, T], mems)."""

    @tf.function
    def decode(first_logits, mems, seed, num_tokens):
        generated = tf.TensorArray(tf.int32, size=num_tokens, element_shape=tf.TensorShape([None]))
        logits = first_logits
        for i in tf.range(num_tokens):
            token = sample_next(logits, tf.stack([seed, i]), temperature, top_k)  # [B]
            generated = generated.write(i, token)
            logits, mems = logits_fn(token[:, None], mems)  # one position attends to memory
        return tf.transpose(generated.stack()), mems  # [B, T]

    return decode


def generate(logits_fn: LogitsFn, prompt: np.ndarray, initial_mems: tf.Tensor, *, max_tokens: int,
             temperature: float = 1.0, top_k: int = 0, seed: int = 0, segment_len: int = 64) -> GenerationResult:
    """Samples `max_tokens` tokens after `prompt` [B, P], starting from `initial_mems`.

    Args:
      logits_fn: see the module docstring (`model_logits_fn` / `saved_model_logits_fn`).
      initial_mems: [n_layer, B, M, D] starting memory (zeros: `model.initial_mems(B)`).
      temperature: softmax temperature; 0 = greedy.
      top_k: sample among the k most likely tokens (0 = all).
      seed: stateless RNG seed; the same seed gives the same tokens.
      segment_len: prompt segment length (e.g. the evaluation tgt_len).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive; got {max_tokens}")
    start = time.perf_counter()
    logits, mems = consume_prompt(logits_fn, prompt, initial_mems, segment_len)
    logits.numpy()  # wait for the prompt
    prompt_seconds = time.perf_counter() - start
    decode = make_decoder(logits_fn, float(temperature), int(top_k))
    args = (logits, mems, tf.constant(seed, tf.int32), tf.constant(max_tokens, tf.int32))
    decode.get_concrete_function(*args)  # trace outside the timed region
    start = time.perf_counter()
    tokens, mems = decode(*args)
    tokens = tokens.numpy()
    return GenerationResult(tokens=tokens, mems=mems, prompt_seconds=prompt_seconds,
                            decode_seconds=time.perf_counter() - start)


def generate_from_model(model, prompt: np.ndarray, *, max_tokens: int, mem_len: int | None = None,
                        clamp_len: int | None = None, temperature: float = 1.0, top_k: int = 0, seed: int = 0,
                        segment_len: int = 64, kv_cache: bool = True) -> GenerationResult:
    """`generate` with a Python TransformerXL; mem_len / clamp_len (default: the model's) apply during it.

    With `kv_cache` (attn_type "xl" with memory) the memory is carried as keys/values (`txl_tf.kv_cache`):
    the same tokens, without re-projecting the memory for every new token; `result.mems` is then the
    (keys, values) state instead of the hidden-state memory.
    """
    from txl_tf import kv_cache as cached
    from txl_tf.evaluation import eval_protocol

    prompt = np.asarray(prompt, np.int32)
    with eval_protocol(model, mem_len=model.mem_len if mem_len is None else mem_len,
                       clamp_len=model.clamp_len if clamp_len is None else clamp_len, same_length=False):
        if kv_cache and model.attn_type == "xl" and model.mem_len > 0:
            logits_fn, state = cached.logits_fn(model), cached.initial_state(model, prompt.shape[0])
        else:
            logits_fn, state = model_logits_fn(model), model.initial_mems(prompt.shape[0])
        return generate(logits_fn, prompt, state, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                        seed=seed, segment_len=segment_len)


def generate_text(model, vocab, prompt: str, *, max_tokens: int = 200, **kwargs) -> str:
    """Samples a continuation of `prompt` (a string) and returns it decoded with `vocab` (the trainer's samples)."""
    ids = list(vocab.encode(prompt))
    if not ids:
        raise ValueError(f"the prompt {prompt!r} encodes to no tokens; give a longer prompt")
    result = generate_from_model(model, np.asarray([ids], np.int32), max_tokens=max_tokens, **kwargs)
    return vocab.decode(result.tokens[0].tolist())


def check_settings(vocab, prompt: str, *, max_tokens: int, temperature: float, top_k: int) -> list:
    """Checks the sampling settings against the vocabulary; returns the prompt's ids (errors.ConfigError).

    temperature: >= 0 and finite (0 = greedy: always the most likely token; 1 = the model's distribution).
    top_k: 0 (all tokens) to the vocabulary size. max_tokens: >= 1. Every prompt symbol must be in the
    vocabulary (a word-level vocabulary with an unknown-word symbol maps unknown words to it).
    """
    if not math.isfinite(temperature) or temperature < 0:
        raise ConfigError(f"--temperature={temperature} must be >= 0 (0 = greedy, 1 = the model's distribution)")
    if not 0 <= top_k <= len(vocab):
        raise ConfigError(f"--top_k={top_k} must be between 0 (all tokens) and the vocabulary size {len(vocab)}")
    if max_tokens < 1:
        raise ConfigError(f"--max_tokens={max_tokens} must be >= 1")
    try:
        ids = vocab.encode(prompt)
    except (KeyError, ValueError) as error:
        raise ConfigError(f"--prompt={prompt!r} has a symbol outside the {vocab.level}-level vocabulary "
                          f"({one_line(error).strip(chr(34))}); change the prompt") from None
    if not ids:
        raise ConfigError(f"--prompt={prompt!r} encodes to no tokens; give some text")
    return ids
