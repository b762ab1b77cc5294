"""Autoregressive sampling with the recurrent state: a batch of prompts of different lengths, temperature, top-k
and nucleus (top-p) sampling.

The prompts are consumed in segments (`txl_tf.inference.run_segments`, the loop evaluation uses), right-padded to
the longest: each call carries every row's own token count, so a short row's padding never enters its state and
its continuation is the one it would get alone. Then every new token costs one call of a single position over
the state (the keys/values cache: the context is never projected again). The decode loop is one `tf.function` (a
`tf.while_loop` with the state as a loop variable), sampling with stateless RNG seeded by (seed, step): the same
seed gives the same text, from the Python model and from an exported SavedModel alike.

The model is reached through a `StepFn(tokens [B, L] int32, lengths [B] int32 or None, state) -> (log_probs
[B, V] float32 of the token after each row's last one, new state)`: `model_step` for a Python `TransformerXL`,
`saved_model_step` for a SavedModel written by `txl_tf.export`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from txl_tf.configs import check_inference_size
from txl_tf.errors import ConfigError, one_line
from txl_tf.inference import Recurrent, run_segments
from txl_tf.protocol import Protocol
from txl_tf.state import from_named

StepFn = Callable[[tf.Tensor, tf.Tensor | None, object], tuple]


@dataclasses.dataclass
class GenerationResult:
    """Generated tokens and speed.

    Attributes:
      tokens: [B, max_tokens] int32 sampled tokens (the prompts excluded).
      state: the recurrent state after the prompts and all generated tokens (to continue generating).
      prompt_seconds: time to consume the prompts (tracing included); decode_seconds: time of the sampling loop
        (traced and run once beforehand).
    """

    tokens: np.ndarray
    state: object
    prompt_seconds: float
    decode_seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens.size / self.decode_seconds if self.decode_seconds > 0 else float("nan")


def model_step(recurrent: Recurrent) -> StepFn:
    """`StepFn` of a Python model bound to a protocol and a state form (`txl_tf.inference.Recurrent`)."""

    def step(tokens, lengths, state):
        # Inside a graph (the decode loop) the uncompiled form is traced in: one flat graph, no nested call.
        call = recurrent.next_log_probs.python_function if tf.inside_function() else recurrent.next_log_probs
        return call(tokens, state, lengths)

    return step


def state_outputs(outputs, state):
    """The new state among a SavedModel signature's `outputs`, of the type and shapes of `state` (the one passed
    in: its named tensors went in as the signature's inputs)."""
    new_state = from_named({name: outputs[name] for name in state.named()})
    return tf.nest.map_structure(lambda new, old: tf.ensure_shape(new, old.shape), new_state, state)


def saved_model_step(loaded) -> tuple[StepFn, Callable, int]:
    """(`StepFn`, initial_state(batch_size), max segment length) of a SavedModel written by `txl_tf.export`; the
    state is a `txl_tf.state` value, passed to the signatures as its named tensors."""
    next_token = loaded.signatures["next_token_logits"]

    def step(tokens, lengths, state):
        if lengths is None:
            lengths = tf.fill(tf.shape(tokens)[:1], tf.shape(tokens)[1])
            out = next_token(tokens=tokens, lengths=lengths, **state.named())
            return out["logits"], state_outputs(out, state)
        # The signature refuses a row of no tokens (lengths 0: a prompt that ended in an earlier segment): such a
        # row is passed its first (padding) token and gets its state back; its log-probabilities are not read.
        idle = tf.equal(lengths, 0)  # [B]
        out = next_token(tokens=tokens, lengths=tf.maximum(lengths, 1), **state.named())
        return out["logits"], state.where_rows(idle, state_outputs(out, state))

    def initial_state(batch_size):
        return from_named(loaded.signatures["initial_state"](batch_size=tf.constant(batch_size, tf.int32)))

    return step, initial_state, int(loaded.max_len.numpy())


def sample_next(logits: tf.Tensor, seed: tf.Tensor, temperature, top_k=0, top_p=1.0) -> tf.Tensor:
    """Samples one token per row of `logits` [B, V]; temperature 0 is greedy. Returns [B] int32.

    The settings may be Python numbers or scalar tensors (the SavedModel's `generate` signature takes them as
    inputs), with the same result either way.

    Args:
      seed: [2] int32 stateless seed.
      temperature: softmax temperature; <= 0 picks the most likely token.
      top_k: keep only the k most likely tokens (0 = all).
      top_p: nucleus sampling: keep the most likely tokens whose probabilities (after temperature and top-k)
        first reach `top_p` in total, the token that crosses it included (1 = all).
    """
    logits = tf.cast(logits, tf.float32)
    temperature = tf.convert_to_tensor(temperature, tf.float32)
    top_k = tf.convert_to_tensor(top_k, tf.int32)
    top_p = tf.convert_to_tensor(top_p, tf.float32)
    blocked = tf.fill(tf.shape(logits), -1e30)

    def keep_top_k(scaled):
        kth = tf.math.top_k(scaled, k=top_k).values[:, -1:]  # [B, 1]
        return tf.where(scaled < kth, blocked, scaled)

    def keep_nucleus(scaled):
        ordered = tf.sort(scaled, axis=-1, direction="DESCENDING")  # [B, V]
        before = tf.cumsum(tf.nn.softmax(ordered, axis=-1), axis=-1, exclusive=True)  # mass of the likelier ones
        kept = tf.reduce_sum(tf.cast(before < top_p, tf.int32), axis=-1, keepdims=True)  # [B, 1] >= 1
        threshold = tf.gather(ordered, kept - 1, batch_dims=1)  # [B, 1]: the least likely kept logit
        return tf.where(scaled < threshold, blocked, scaled)

    def sample():
        scaled = logits / temperature
        scaled = tf.cond(top_k > 0, lambda: keep_top_k(scaled), lambda: scaled)
        scaled = tf.cond(top_p < 1.0, lambda: keep_nucleus(scaled), lambda: scaled)
        return tf.cast(tf.random.stateless_categorical(scaled, 1, seed=seed)[:, 0], tf.int32)

    return tf.cond(temperature > 0, sample, lambda: tf.argmax(logits, axis=-1, output_type=tf.int32))


def pad_prompts(prompts: Sequence[Sequence[int]] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads token sequences to one [B, P] int32 array (P = the longest); returns it and the lengths [B]."""
    rows = [np.asarray(row, np.int32).reshape(-1) for row in prompts]
    if not rows or any(row.size == 0 for row in rows):
        raise ValueError("every prompt needs at least one token")
    lengths = np.array([row.size for row in rows], np.int32)
    padded = np.zeros([len(rows), lengths.max()], np.int32)
    for index, row in enumerate(rows):
        padded[index, :row.size] = row
    return padded, lengths


def consume_prompts(step: StepFn, prompts, state, segment_len: int):
    """Feeds prompts (token sequences of any lengths) in segments of `segment_len`.

    Returns (log_probs [B, V] of the token after each prompt, state).
    """
    tokens, lengths = pad_prompts(prompts)
    last = {}

    def keep_last_rows(output):
        log_probs, counts = output
        active = (counts > 0)[:, None]  # rows with tokens in this segment
        last["log_probs"] = log_probs if not last else tf.where(active, log_probs, last["log_probs"])

    def prompt_step(segment, counts, current):
        log_probs, current = step(segment, counts, current)
        return (log_probs, counts), current

    _, state = run_segments(prompt_step, state, tokens, segment_len, lengths=lengths, on_output=keep_last_rows)
    return last["log_probs"], state


def sampling_checks(vocab_size, num_tokens, temperature, top_k, top_p) -> list:
    """Graph assertions of the sampling settings, with the rules of `check_settings` (the SavedModel's `generate`
    signature takes whatever a client sends): an InvalidArgumentError names the argument and its range.

    XLA compiles tf.Assert to nothing: a jit-compiled caller does not check.
    """
    temperature = tf.convert_to_tensor(temperature, tf.float32)
    top_k = tf.convert_to_tensor(top_k, tf.int32)
    top_p = tf.convert_to_tensor(top_p, tf.float32)
    num_tokens = tf.convert_to_tensor(num_tokens, tf.int32)
    return [
        tf.debugging.Assert(tf.math.is_finite(temperature) & (temperature >= 0), [
            "temperature must be finite and >= 0 (0 = greedy, 1 = the distribution of the model); got", temperature]),
        tf.debugging.Assert((top_k >= 0) & (top_k <= vocab_size), [
            "top_k must be between 0 (all tokens) and the vocabulary size", vocab_size, "; got", top_k]),
        tf.debugging.Assert((top_p > 0) & (top_p <= 1), [  # NaN fails both
            "top_p must be in (0, 1] (1 = off); got", top_p]),
        tf.debugging.Assert(num_tokens >= 1, ["num_tokens must be >= 1; got", num_tokens]),
    ]


def decode_loop(step: StepFn, first_log_probs, state, seed, num_tokens, temperature, top_k, top_p):
    """Samples `num_tokens` tokens in one `tf.while_loop` (trace it inside a tf.function): (tokens [B, T], state).

    The Python path (`make_decoder`) and the SavedModel's `generate` signature trace this same function, so they
    run the same graph and sample the same tokens. The settings are checked first (`sampling_checks`).
    """
    checks = sampling_checks(tf.shape(first_log_probs)[1], num_tokens, temperature, top_k, top_p)
    with tf.control_dependencies(checks):  # before the ops that would fail (or not) in TensorFlow's words
        first_log_probs, num_tokens = tf.identity(first_log_probs), tf.identity(num_tokens)
    generated = tf.TensorArray(tf.int32, size=num_tokens, element_shape=tf.TensorShape([None]))
    log_probs = first_log_probs
    for i in tf.range(num_tokens):
        token = sample_next(log_probs, tf.stack([seed, i]), temperature, top_k, top_p)  # [B]
        generated = generated.write(i, token)
        log_probs, state = step(token[:, None], None, state)  # one position attends to the state
    return tf.transpose(generated.stack()), state  # [B, T]


def make_decoder(step: StepFn):
    """A tf.function (first_log_probs [B, V], state, seed, num_tokens, temperature, top_k, top_p) -> (tokens
    [B, T], state), all scalars as tensors."""
    return tf.function(lambda *args: decode_loop(step, *args))


def saved_model_decoder(loaded):
    """The decoder of a SavedModel written by `txl_tf.export`: its `generate` signature (the loop in its graph)."""
    signature = loaded.signatures["generate"]

    def decode(first_log_probs, state, seed, num_tokens, temperature, top_k, top_p):
        out = signature(logits=first_log_probs, seed=seed, num_tokens=num_tokens, temperature=temperature,
                        top_k=top_k, top_p=top_p, **state.named())
        return out["tokens"], from_named({name: out[name] for name in state.named()})

    return decode


def generate(step: StepFn, prompts, initial_state, *, max_tokens: int, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, segment_len: int = 64, decoder=None) -> GenerationResult:
    """Samples `max_tokens` tokens after each prompt, starting from `initial_state`.

    Args:
      step: see the module docstring (`model_step` / `saved_model_step`).
      prompts: B token sequences (any lengths >= 1) or a [B, P] array.
      initial_state: the state for B rows (a zero memory: `Recurrent.initial_state(B)`).
      temperature: softmax temperature; 0 = greedy.
      top_k: sample among the k most likely tokens (0 = all).
      top_p: nucleus sampling (1 = off).
      seed: stateless RNG seed; the same seed gives the same tokens.
      segment_len: prompt segment length (at most the state's max_len).
      decoder: the sampling loop (default `make_decoder(step)`; a SavedModel's: `saved_model_decoder`).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive; got {max_tokens}")
    start = time.perf_counter()
    log_probs, state = consume_prompts(step, prompts, initial_state, segment_len)
    log_probs.numpy()  # wait for the prompt
    prompt_seconds = time.perf_counter() - start
    decode = decoder or make_decoder(step)
    settings = (tf.constant(temperature, tf.float32), tf.constant(top_k, tf.int32), tf.constant(top_p, tf.float32))
    seed = tf.constant(seed, tf.int32)
    # Run once first: TF instantiates and optimises a function's graph at its first call, which would otherwise
    # be timed as decoding.
    decode(log_probs, state, seed, tf.constant(1, tf.int32), *settings)[0].numpy()
    start = time.perf_counter()
    tokens, state = decode(log_probs, state, seed, tf.constant(max_tokens, tf.int32), *settings)
    tokens = tokens.numpy()
    return GenerationResult(tokens=tokens, state=state, prompt_seconds=prompt_seconds,
                            decode_seconds=time.perf_counter() - start)


def generation_protocol(model, protocol: Protocol | None = None) -> Protocol:
    """The default protocol of generation: the model's lengths without same_length (every token sees the whole
    state)."""
    return protocol or model.protocol.replace(same_length=False)


def generate_from_model(model, prompts, *, max_tokens: int, protocol: Protocol | None = None,
                        temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                        segment_len: int = 64, use_cache: bool = True) -> GenerationResult:
    """`generate` with a Python TransformerXL and `protocol` (default: `generation_protocol(model)`).

    `use_cache` carries the keys/values cache (the same tokens as the hidden-state memory, without projecting the
    memory again for every new token); `result.state` is in that form. A batch, segment or memory that would not
    fit in the machine's memory is a ConfigError before any tensor is made (`configs.check_inference_size`).
    """
    protocol = generation_protocol(model, protocol)
    check_inference_size(model, batch_size=len(prompts), tgt_len=segment_len, mem_len=protocol.mem_len)
    recurrent, step, decoder = _decoding(model, protocol, segment_len, use_cache)
    return generate(step, prompts, recurrent.initial_state(len(prompts)), max_tokens=max_tokens,
                    temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, segment_len=segment_len,
                    decoder=decoder)


def _decoding(model, protocol: Protocol, segment_len: int, use_cache: bool):
    """(Recurrent, StepFn, decoder) of a model, made once per protocol, segment length and state form and kept on
    the model (outside Keras's tracking): a later call traces nothing again. The trainer samples every few
    hundred steps; building them afresh retraced both functions at every sample."""
    made = model.__dict__.setdefault("_txl_tf_decoding", {})
    key = (protocol, int(segment_len), bool(use_cache))
    if key not in made:
        recurrent = Recurrent(model, protocol, max_len=segment_len, use_cache=use_cache)
        step = model_step(recurrent)
        made[key] = (recurrent, step, make_decoder(step))
    return made[key]


def generate_text(model, vocab, prompt: str, *, max_tokens: int = 200, **kwargs) -> str:
    """Samples a continuation of `prompt` (a string) and returns it decoded with `vocab` (the trainer's samples)."""
    ids = list(vocab.encode(prompt))
    if not ids:
        raise ValueError(f"the prompt {prompt!r} encodes to no tokens; give a longer prompt")
    result = generate_from_model(model, [ids], max_tokens=max_tokens, **kwargs)
    return vocab.decode(result.tokens[0].tolist())


def with_prompt(vocab, prompt: str, continuation: str) -> str:
    """The prompt followed by its decoded continuation, as `python -m txl_tf.generate` prints it.

    Word level: `Vocab.decode` joins words with spaces, so the prompt's last word and the first new one get one
    space between them (none when either side already has whitespace there).
    """
    joiner = " " if vocab.level == "word" and prompt and not prompt[-1].isspace() and continuation \
        and not continuation[0].isspace() else ""
    return prompt + joiner + continuation


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
    for prompt in prompts:
        if not isinstance(prompt, str):  # bytes would encode as ids (or as that many zero bytes)
            raise TypeError(f"a prompt must be a str; got {type(prompt).__name__}")
        try:
            ids = vocab.encode(prompt)
        except (KeyError, ValueError) as error:
            raise ConfigError(f"--prompt={prompt!r} has a symbol outside the {vocab.level}-level vocabulary "
                              f"({one_line(error).strip(chr(34))}); change the prompt") from None
        if not ids:
            raise ConfigError(f"--prompt={prompt!r} encodes to no tokens; give some text")
        all_ids.append(list(ids))
    return all_ids
