"""The causal language model as one object: a model, its vocabulary and its evaluation protocol.

    from txl_tf import TransformerXLCausalLM

    lm = TransformerXLCausalLM.from_preset("runs/sample")            # a run, a converted model or a preset
    lm.generate("The history of ", max_length=120, temperature=0.8, top_p=0.9, seed=7)
    result = lm.score("The history of the memory.")                  # result.log_probs, result.nats, result.bpc
    stream = lm.stream()                                             # the recurrent state kept between pieces
    for piece in ("The history ", "of the memory."):
        stream.score(piece)
    stream.result().nats                                             # == lm.score(whole text).nats
    lm.save_to_preset("presets/sample")                              # config.json, model.weights.h5, vocab.json
    TransformerXLCausalLM.from_preset("presets/sample")              # no gin, no prepared data

Nothing here computes on its own: loading is `txl_tf.loading.load_model`, scoring the segment loop of
`txl_tf.inference` (`Recurrent.score` over `run_segments`, what `python -m txl_tf.evaluate` runs), generation
`txl_tf.generation.generate_from_model` (what `python -m txl_tf.generate` runs). The protocol (segment length,
memory and clamp lengths, same_length, the state form) is the run's `EvalConfig`, so `score` gives evaluate's
figures and `generate` the CLI's text for the same seed.

A scored text is one stream: its first token is context, every later one is scored (natural log), in segments of
`EvalConfig.tgt_len` starting from a zero memory, the state carried from segment to segment. That is
`python -m txl_tf.evaluate` with `EvalConfig.batch_size=1` and `max_steps=0` on the same tokens.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from txl_tf import errors, generation, paths, presets, staging
from txl_tf.configs import (
    EvalConfig,
    ModelConfig,
    architecture,
    check_generation_size,
    check_inference_size,
)
from txl_tf.data.vocab import Vocab
from txl_tf.errors import ConfigError
from txl_tf.evaluation import LossFigures
from txl_tf.inference import Recurrent, run_segments
from txl_tf.presets import (
    PRESET_CONFIG,
    PRESET_FORMAT,
    PRESET_KIND,
    PRESET_VERSION,
    PRESET_VOCAB,
    PRESET_WEIGHTS,
)
from txl_tf.protocol import Protocol


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
    """Scores text piece by piece with the model's state kept between the pieces (`TransformerXLCausalLM.stream`).

    The segments are those of one `score` call on the whole text (EvalConfig.tgt_len from the first token): a
    piece that ends inside a segment is scored at once from the state before that segment, and the segment is run
    again, whole, once the next pieces complete it. So the pieces' log-probabilities, concatenated, are those of
    scoring the concatenation in one call. Pieces are encoded one by one: at word level end them at a line end
    (a newline) or between words, so that their encodings concatenate to the whole text's.
    """

    def __init__(self, lm: TransformerXLCausalLM):
        if lm.eval_config.protocol != "xl":
            raise ConfigError(f"streaming needs the recurrent protocol; this model's EvalConfig.protocol is "
                              f"{lm.eval_config.protocol!r} (a window without memory): use score()")
        check_inference_size(lm.model, batch_size=1, tgt_len=lm.eval_config.tgt_len, mem_len=lm.eval_config.mem_len)
        self._lm = lm
        self.reset()

    def reset(self) -> None:
        """Starts a new text: a zero memory, nothing scored."""
        self._state = self._lm.scorer.initial_state(1)
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
                outputs, self._state = run_segments(self._lm.scorer.score, self._state, tokens[None, :whole], seg_len,
                                                    targets=tokens[None, 1:whole + 1])
                parts += outputs
            if tokens.size - 1 > whole:  # the segment this piece ends inside: scored, its state not kept
                outputs, _ = run_segments(self._lm.scorer.score, self._state, tokens[None, whole:-1], seg_len,
                                          targets=tokens[None, whole + 1:])
                parts += outputs
            nll = tf.concat(parts, axis=1).numpy()[0]
            self._pending = tokens[whole:]
        else:
            self._pending = tokens
        log_probs = -nll[nll.size - new:] if new > 0 else np.zeros([0], np.float32)
        self._scored.append(log_probs)
        return ScoreResult(log_probs, self._lm.vocab.level)

    def result(self) -> ScoreResult:
        """Everything scored since the start (or `reset`)."""
        return ScoreResult(np.concatenate([np.zeros([0], np.float32), *self._scored]), self._lm.vocab.level)


class TransformerXLCausalLM:
    """A Transformer-XL language model with its vocabulary and evaluation protocol: generate, score, stream, save.

    Usually made by `from_preset`. Args:
      model: a `txl_tf.TransformerXL` (the Keras model; `lm.model`).
      vocab: its `txl_tf.data.vocab.Vocab` (text <-> token ids; `lm.tokenizer` is the same as a Keras layer).
      model_config: the `ModelConfig` it was built from (saved in a preset).
      eval_config: the evaluation protocol (`EvalConfig`): segment length, attention lengths, state form.
    """

    def __init__(self, model, vocab: Vocab, model_config: ModelConfig, eval_config: EvalConfig):
        if len(vocab) != model.n_token:
            raise ConfigError(f"the vocabulary has {len(vocab)} symbols but the model n_token={model.n_token}; use "
                              "the vocabulary the model was trained with")
        self.model = model
        self.vocab = vocab
        self.model_config = model_config
        self.eval_config = eval_config
        self._scorer = None
        self._tokenizer = None

    def __repr__(self) -> str:
        return (f"TransformerXLCausalLM(n_layer={self.model.n_layer}, d_model={self.model.d_model}, "
                f"vocab={self.vocab.level} {len(self.vocab)}, protocol={self.protocol})")

    @property
    def protocol(self) -> Protocol:
        """The attention lengths of every call (EvalConfig's mem_len, clamp_len, same_length)."""
        return self.eval_config.attention_protocol()

    @property
    def tokenizer(self):
        """The vocabulary as a Keras layer (`txl_tf.tokenizer.TransformerXLTokenizer`: text -> ids in the graph,
        for tf.data pipelines); the same ids as `encode`."""
        if self._tokenizer is None:
            from txl_tf.tokenizer import TransformerXLTokenizer

            self._tokenizer = TransformerXLTokenizer.from_vocab(self.vocab)
        return self._tokenizer

    @property
    def scorer(self) -> Recurrent:
        """The model bound to the protocol and the state form evaluation uses (EvalConfig.kv_cache)."""
        if self._scorer is None:
            self._scorer = Recurrent(self.model, self.protocol, max_len=self.eval_config.tgt_len,
                                     use_cache=self.eval_config.kv_cache)
        return self._scorer

    # ---- loading --------------------------------------------------------------------------------------
    @classmethod
    def from_preset(cls, path, *, which: str = "latest", gin_file: str | Sequence[str] = (),
                    gin_param: str | Sequence[str] = (), dtype: str | None = None) -> TransformerXLCausalLM:
        """Loads a preset directory, a run directory or a converted checkpoint directory (`txl_tf.presets.load`:
        its arguments)."""
        loaded = presets.load(path, which=which, gin_file=gin_file, gin_param=gin_param, dtype=dtype)
        return cls(loaded.model, loaded.vocab, loaded.model_config, loaded.eval_config)

    # ---- saving ---------------------------------------------------------------------------------------
    def save_to_preset(self, directory, *, overwrite: bool = False) -> str:
        """Writes `directory`: config.json (ModelConfig and EvalConfig), model.weights.h5, vocab.json; returns it.

        `from_preset(directory)` needs nothing else (no gin files, no prepared data). The directory is written
        whole beside its target and then renamed into place; an existing preset is replaced only with
        `overwrite`, and a directory holding anything else (a file the user put there) never
        (`txl_tf.paths.replaceable_dir`).
        """
        directory = paths.replaceable_dir(directory, "the preset directory", kind=PRESET_KIND, overwrite=overwrite,
                                          overwrite_hint="overwrite=True")
        staging.remove_stale(directory)
        config = {"format": PRESET_FORMAT, "version": PRESET_VERSION,
                  "model": dataclasses.asdict(self.model_config), "eval": dataclasses.asdict(self.eval_config),
                  "architecture": architecture(self.model)}  # compared with "model" on every load
        with staging.staged_dir(directory, kind=PRESET_KIND, name="the preset directory", overwrite=overwrite,
                                overwrite_hint="overwrite=True") as tmp:  # checks again under its claim
            with open(os.path.join(tmp, PRESET_CONFIG), "w") as f:
                json.dump(config, f, indent=2)
                f.write("\n")
            self.model.save_weights(os.path.join(tmp, PRESET_WEIGHTS))
            self.vocab.save(os.path.join(tmp, PRESET_VOCAB))
        return directory

    # ---- text -----------------------------------------------------------------------------------------
    def encode(self, text: str, what: str = "text") -> np.ndarray:
        """Text (a str) -> int32 token ids; a symbol outside the vocabulary is a one-line ConfigError, anything but
        a str (bytes too) a one-line TypeError."""
        _check_text(text, f"the {what}")
        try:
            return self.vocab.encode_array(text)
        except (KeyError, ValueError) as error:
            raise ConfigError(f"the {what} {_short(text)} has a symbol outside the {self.vocab.level}-level "
                              f"vocabulary ({errors.one_line(error).strip(chr(34))}); change the {what}") from None

    def generate(self, prompts: str | Sequence[str], max_length: int, *, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None) -> str | list[str]:
        """Continues each prompt; returns the prompt and its continuation (a str for a str, a list for a list).

        Args:
          prompts: one prompt or a list of them (a batch; different lengths are fine).
          max_length: tokens per row in all, the prompt's included (as keras-hub's generate): a prompt of P
            tokens gets max_length - P new ones; it must exceed the longest prompt.
          temperature: >= 0; 0 is greedy, 1 the model's distribution.
          top_k: sample among the k most likely tokens (0 = all). top_p: nucleus sampling, in (0, 1] (1 = off).
          seed: stateless sampling seed (None: a random one). `python -m txl_tf.generate` with the same prompts,
            settings, `--seed` and `--max_tokens` = max_length - (the shortest prompt's tokens) prints the same
            text (each row there runs to that count).
        """
        single, texts = _texts(prompts, "prompts")
        ids = generation.check_settings(self.vocab, texts, max_tokens=1, temperature=temperature, top_k=top_k,
                                        top_p=top_p)
        lengths = [len(row) for row in ids]
        if isinstance(max_length, bool) or not isinstance(max_length, (int, np.integer)) \
                or max_length <= max(lengths):
            raise ConfigError(f"max_length={max_length!r} must be an int above the longest prompt's {max(lengths)} "
                              "tokens (it counts the prompt and the new tokens); raise it")
        # max_length and the batch against the memory this process can allocate, before any buffer is made
        check_generation_size(self.model, batch_size=len(ids), length=max(lengths) + int(max_length) - min(lengths),
                              given=int(max_length), name="max_length", batch_name="the number of prompts",
                              segment_len=self.eval_config.tgt_len, mem_len=self.eval_config.mem_len)
        if seed is None:
            seed = random.SystemRandom().randrange(2**31)
        result = generation.generate_from_model(
            self.model, ids, max_tokens=int(max_length) - min(lengths), protocol=self.protocol,
            segment_len=self.eval_config.tgt_len, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        outputs = [generation.with_prompt(self.vocab, text, self.vocab.decode(row[:max_length - length].tolist()))
                   for text, row, length in zip(texts, result.tokens, lengths, strict=True)]
        return outputs[0] if single else outputs

    def score(self, texts: str | Sequence[str]) -> ScoreResult | list[ScoreResult]:
        """Scores each text as one stream with the model's long-memory protocol (a list of results for a list).

        Every token after the first is scored in segments of EvalConfig.tgt_len from a zero memory, the state
        carried across segments; the texts of a list are the rows of one batch. With EvalConfig.protocol
        "vanilla" each prediction sees a window of tgt_len tokens instead (txl_tf.evaluation.evaluate_vanilla).
        """
        single, texts = _texts(texts, "texts")
        if not texts:
            raise ConfigError("score() needs at least one text; got an empty list")
        rows = [self.encode(text) for text in texts]
        for text, row in zip(texts, rows, strict=True):
            if row.size < 2:
                raise ConfigError(f"the text {_short(text)} encodes to {row.size} token(s); scoring needs at least "
                                  "2 (the first is context only)")
        if self.eval_config.protocol == "vanilla":
            log_probs = [-self._vanilla_nll(row) for row in rows]
        else:
            check_inference_size(self.model, batch_size=len(rows), tgt_len=self.eval_config.tgt_len,
                                 mem_len=self.eval_config.mem_len)
            log_probs = [-nll for nll in self._stream_nll(rows)]
        results = [ScoreResult(values, self.vocab.level) for values in log_probs]
        return results[0] if single else results

    def stream(self) -> ScoreStream:
        """A `ScoreStream`: `stream.score(piece)` scores text piece by piece, keeping the state in between."""
        return ScoreStream(self)

    def _stream_nll(self, rows: list[np.ndarray]) -> list[np.ndarray]:
        """[T_b - 1] NLL of each row, the rows right-padded into one batch (a row's padding comes after all its
        tokens, so causal attention keeps it out of their scores)."""
        lengths = [row.size for row in rows]
        tokens = np.zeros([len(rows), max(lengths)], np.int32)
        for index, row in enumerate(rows):
            tokens[index, :row.size] = row
        outputs, _ = run_segments(self.scorer.score, self.scorer.initial_state(len(rows)), tokens[:, :-1],
                                  self.eval_config.tgt_len, targets=tokens[:, 1:])
        nll = tf.concat(outputs, axis=1).numpy()
        return [nll[index, :length - 1] for index, length in enumerate(lengths)]

    def _vanilla_nll(self, row: np.ndarray) -> np.ndarray:
        from txl_tf import evaluation

        window = self.eval_config.tgt_len
        if row.size <= window:
            raise ConfigError(f"a text of {row.size} tokens is too short for the vanilla window of {window} "
                              "(EvalConfig.tgt_len); give a longer text")
        result = evaluation.evaluate_vanilla(self.model, row, window=window, batch_size=self.eval_config.batch_size,
                                             clamp_len=self.eval_config.clamp_len, return_token_losses=True)
        return result.token_losses


def _short(text) -> str:
    return repr(text if len(text) <= 40 else text[:37] + "...")


def _bytes_hint(value) -> str:
    return "; decode bytes first, e.g. data.decode('utf-8')" if isinstance(value, (bytes, bytearray, memoryview)) \
        else ""


def _check_text(value, what: str) -> None:
    """TypeError naming the type unless `value` is a str (bytes are refused: decode them first)."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str; got {type(value).__name__}{_bytes_hint(value)}")


def _texts(value, what: str) -> tuple[bool, list[str]]:
    """(whether `value` is one text, its texts): a str, or a list, tuple or 1-D array of str; anything else (bytes,
    a list of ids) is a TypeError naming the type."""
    if isinstance(value, str):
        return True, [value]
    if not (isinstance(value, (list, tuple)) or (isinstance(value, np.ndarray) and value.ndim == 1)):
        raise TypeError(f"{what} must be a str or a list of str; got {type(value).__name__}{_bytes_hint(value)}")
    for index, text in enumerate(value):
        _check_text(text, f"{what}[{index}]")
    return False, [str(text) for text in value]
