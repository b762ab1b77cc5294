"""Gin-configurable settings shared by the entry points (train, evaluate, export, generate).

The library layers stay plain Keras; gin only reaches them through these small dataclasses, which the
entry points instantiate. Every `gin/<setup>.gin` file binds them (see `gin/common.gin`).

    ModelConfig  architecture + regularisation (argument names as in the authors' code)
    DataConfig   which prepared corpus to read (written by `python -m txl_tf.data.prepare`)
    TrainConfig  optimisation, loop and logging
    EvalConfig   the evaluation protocol (its own tgt_len, long mem_len, clamp_len, same_length, batch)

Every field is checked when a config is made (type, range, finite numbers; `validate`), and `parse_gin` rejects
unknown configurables and parameters, so a misspelt binding or a bad value stops a command with one line before it
writes anything. A model's sizes are bounded before it is built: `check_model_size` (every ModelConfig, and every
build with the vocabulary's size) and `check_inference_size` (the evaluation's lengths and batch) compare an
estimate of the bytes with the machine's memory; `check_generation_size` bounds every length a user gives to
generation by the memory the process can allocate now. `architecture` is the record of what defines a model's
function, saved beside checkpoints and in presets and compared on every load. `parse_configs` makes the four of them (`Configs`) from gin files
and bindings (a run's saved config.gin comes from txl_tf.runs.run_dir.read_configs); `compare_configs` checks a new set
against a run's saved one. `check_clamp` refuses a clamp_len > 0 (ModelConfig's or EvalConfig's) for an encoding
that ignores it (rope, shaw, al_rfou).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import math
import numbers
import os
import tokenize
import types
import typing
from collections.abc import Callable, Sequence
from typing import Optional

import gin
from gin import config_parser

from txl_tf.base import untrusted
from txl_tf.base.errors import ConfigError, one_line
from txl_tf.model import encodings, policy
from txl_tf.model.protocol import COMPUTE_DTYPES, LAYOUTS, PROTOCOLS, Protocol


@gin.configurable
@dataclasses.dataclass
class ModelConfig:
    """Architecture of `txl_tf.TransformerXL`; `n_token=None` takes the vocabulary size of the data."""

    n_layer: int = 12
    d_model: int = 512
    n_head: int = 8
    d_head: int = 64
    d_inner: int = 2048
    dropout: float = 0.1
    dropatt: float = 0.0
    mem_len: int = 512
    n_token: Optional[int] = None
    d_embed: Optional[int] = None
    cutoffs: tuple = ()
    div_val: int = 1
    tie_projs: Optional[tuple] = None
    proj_same_dim: bool = True
    untie_r: bool = False
    same_length: bool = False
    clamp_len: int = -1
    attn_type: str = "xl"
    pre_lnorm: bool = False
    layer_norm_epsilon: float = 1e-12
    init_std: float = 0.02
    proj_init_std: float = 0.01
    max_position: int = 1024  # rows of the learned tables of attn_type "shaw" (distances) and "al_rfou" (positions)

    def __post_init__(self):
        validate(self)
        problem = encodings.get(self.attn_type).problem(d_model=self.d_model, d_head=self.d_head)
        if problem:
            raise ConfigError(f"ModelConfig.attn_type={self.attn_type!r}: {problem}; change ModelConfig.d_head or "
                              "ModelConfig.attn_type")
        check_clamp(self.attn_type, self.clamp_len, "ModelConfig.clamp_len")
        check_model_size(self)

    def model_kwargs(self, n_token: Optional[int] = None) -> dict:
        """Keyword arguments for `TransformerXL`; `n_token` fills in when the config leaves it unset."""
        kwargs = dataclasses.asdict(self)
        if kwargs["n_token"] is None:
            if n_token is None:
                raise ValueError("ModelConfig.n_token is unset and no vocabulary size was given")
            kwargs["n_token"] = n_token
        elif n_token is not None and kwargs["n_token"] != n_token:
            raise ValueError(
                f"ModelConfig.n_token={kwargs['n_token']} does not match the data's vocabulary size "
                f"{n_token}; remove the n_token binding or point DataConfig.data_dir at matching data"
            )
        kwargs["cutoffs"] = tuple(kwargs["cutoffs"])
        if kwargs["tie_projs"] is not None:
            kwargs["tie_projs"] = tuple(kwargs["tie_projs"])
        check_model_size(self, kwargs["n_token"])  # every build passes here: the sizes with the vocabulary's
        return kwargs

    def build(self, n_token: Optional[int] = None):
        from txl_tf.model.transformer_xl import (
            TransformerXL,  # imported late: keeps this module light
        )

        return TransformerXL(**self.model_kwargs(n_token))


@gin.configurable
@dataclasses.dataclass
class DataConfig:
    """A corpus prepared by `python -m txl_tf.data.prepare --dataset=NAME --data_dir=DIR`."""

    dataset: str = "enwik8_sample"
    data_dir: str = "data/enwik8_sample"

    def __post_init__(self):
        validate(self)


@gin.configurable
@dataclasses.dataclass
class TrainConfig:
    """Optimisation (Adam, warm-up + cosine decay to a floor, global-norm clipping) and the loop."""

    batch_size: int = 22  # global batch = number of contiguous streams
    tgt_len: int = 512
    train_steps: int = 400_000
    learning_rate: float = 2.5e-4
    warmup_steps: int = 0
    min_lr_ratio: float = 0.004  # cosine floor as a fraction of learning_rate
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    clip_norm: float = 0.25
    grad_accum_steps: int = 1  # the batch is split into this many chunks, each with its own memory
    loss_recent_half: bool = False  # ablation: loss only over the most recent half of each segment
    # The training path. "auto" (the default) times the candidates on this machine at the run's model and batch
    # and trains on the fastest (txl_tf.training.autotune); config.gin records what was chosen and a resumed run keeps it.
    mixed_precision: bool | str = "auto"  # keras mixed_bfloat16 policy: True, False or "auto"
    jit_compile: bool | str = "auto"  # XLA: True, False or "auto"
    # The step's elementwise ops: "tf" (TensorFlow's), "fused" (txl_tf.model.fused's C++ CPU kernels; their dropout
    # draws other masks, so the two give different runs from one seed; not with jit_compile) or "auto". The
    # trainer falls back to "tf" with one warning where "fused" cannot run, and config.gin records what ran.
    kernels: str = "auto"
    # "block": the backward pass recomputes each block's activations from its inputs (tf.recompute_grad) instead of
    # keeping them: less memory for one more forward pass per step, same gradients as "none" (docs/training.md)
    recompute: str = "none"
    steps_per_loop: int = 10
    log_every: int = 10
    eval_every: int = 1000
    eval_steps: int = 0  # 0 = the whole validation split
    checkpoint_every: int = 1000
    keep_checkpoints: int = 3
    nonfinite: str = "stop"  # or "skip"
    rotate_streams: bool = False  # random per-epoch rotation of the training streams
    seed: int = 1234
    deterministic: bool = False  # tf.config.experimental.enable_op_determinism()
    sample_tokens: int = 200  # length of the text sample generated at each evaluation (0 = none)
    measure_mfu: bool = True  # time a square matmul at start-up and report model FLOPs utilisation
    checkpoint_memory: bool = True  # save every stream's memory (exact resume; n_layer*B*M*d values per checkpoint)
    # Fine-tuning: start from these weights (a `txl_tf.convert` output dir, a run dir or a checkpoint prefix) with a
    # fresh optimizer, step 0 and zero memory; ignored when model_dir has a checkpoint of its own (that resumes).
    init_checkpoint: Optional[str] = None

    def __post_init__(self):
        validate(self)
        check_together(self)


@gin.configurable
@dataclasses.dataclass
class EvalConfig:
    """The evaluation protocol: published defaults live in each `gin/<setup>.gin`."""

    tgt_len: int = 80
    mem_len: int = 2100
    clamp_len: int = 820
    same_length: bool = True
    batch_size: int = 10
    max_steps: int = 0  # 0 = the whole split
    protocol: str = "xl"  # "xl": segments + memory; "vanilla": al_rfou window of tgt_len shifted by one token
    compute_dtype: str = "float32"  # or "mixed_bfloat16" (where bfloat16 is native: docs/performance.md)
    layout: str = "corpus"  # "corpus": every token scored once; "original": the authors' batching
    kv_cache: bool = True  # carry the memory's keys/values (txl_tf.model.inference; same numbers, faster)

    def __post_init__(self):
        validate(self)

    def attention_protocol(self):
        """The attention lengths as the immutable value evaluation, generation and export hand to the model."""
        return Protocol(mem_len=self.mem_len, clamp_len=self.clamp_len, same_length=self.same_length)

    def generation_protocol(self):
        """The attention lengths of generation: `attention_protocol().for_generation()` (no same_length)."""
        return self.attention_protocol().for_generation()


# ---- validation: every field's type and range, checked when a config is made (before anything is written) ----
def _at_least(low):
    return (lambda v: v >= low), f">= {low}"


def _in_range(low, high, high_open=False):
    return ((lambda v: low <= v < high) if high_open else (lambda v: low <= v <= high),
            f"in [{low}, {high}{')' if high_open else ']'}")


def _positive():
    return (lambda v: v > 0), "> 0"


def _one_of(choices: tuple):
    """The value is one of `choices`: the tuple of the module that acts on the field, read here, never a copy."""
    return choices.__contains__, f"one of {', '.join(map(repr, choices))}"


def _or_auto():
    return (lambda v: v == policy.AUTO), f"True, False or {policy.AUTO!r}"


def _ascending_positive(high):
    return ((lambda v: all(0 < c <= high for c in v) and list(v) == sorted(set(v))),
            f"ascending positive integers up to {high}")


def _type_ok(value, hint) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if hint is tuple or origin is tuple:
        return isinstance(value, (tuple, list))
    return True  # a type this check does not know


def _type_name(hint) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(arg) for arg in typing.get_args(hint))
    return {type(None): "None", tuple: "a list"}.get(hint, getattr(hint, "__name__", str(hint)))


def validate(config) -> None:
    """Raises ConfigError naming the first field of `config` whose type or range is wrong."""
    name = type(config).__name__
    hints = typing.get_type_hints(type(config))
    rules = _RULES.get(name, {})
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        shown = repr(value)
        where = f"{name}.{field.name}={shown if len(shown) <= 60 else shown[:57] + '...'}"
        fix = f"fix the binding `{name}.{field.name} = ...` in the gin file or --gin_param"
        hint = hints.get(field.name)
        if hint is not None and not _type_ok(value, hint):
            raise ConfigError(f"{where} must be {_type_name(hint)}; {fix}")
        if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral) and not math.isfinite(value):
            raise ConfigError(f"{where} must be a finite number; {fix}")
        if field.name in _ELEMENTS.get(name, {}) and value is not None:
            element = _ELEMENTS[name][field.name]
            if not all(_type_ok(v, element) for v in value):
                raise ConfigError(f"{where} must be a list of {_type_name(element)}; {fix}")
        if field.name in rules and value is not None and not isinstance(value, bool):
            check, description = rules[field.name]
            if not check(value):
                raise ConfigError(f"{where} must be {description}; {fix}")


def check_clamp(attn_type: str, clamp_len: int, binding: str = "EvalConfig.clamp_len") -> None:
    """Raises ConfigError (one line naming the encoding, `binding` and its value) when `clamp_len` > 0 goes with an
    encoding that ignores it (`Encoding.clamps`: rope, shaw, al_rfou), instead of letting it pass unused."""
    problem = encodings.get(attn_type).clamp_problem(clamp_len)
    if problem:
        clamping = ", ".join(name for name in encodings.NAMES if encodings.get(name).clamps)
        raise ConfigError(f"{binding}={clamp_len}: {problem}; set {binding} to -1, or use an attn_type that clamps "
                          f"({clamping})")


def check_together(config: TrainConfig) -> None:
    """Raises ConfigError when fields of TrainConfig `config` cannot go together: XLA (`jit_compile`) compiles the
    step itself and cannot run the fused kernels, which are custom ops; the half loss needs two positions.

    The checks that need the run (the batch against the replicas and `grad_accum_steps`) are the trainer's.
    """
    if config.kernels == "fused" and config.jit_compile is True:
        raise ConfigError("TrainConfig.kernels='fused' cannot run under TrainConfig.jit_compile=True (XLA cannot "
                          "compile custom ops); set TrainConfig.kernels='tf' or TrainConfig.jit_compile=False")
    if config.loss_recent_half and config.tgt_len < 2:
        raise ConfigError(f"TrainConfig.loss_recent_half=True needs TrainConfig.tgt_len >= 2 (got {config.tgt_len}): "
                          "the loss is over the most recent half of each segment; raise tgt_len or drop the binding")


# ---- sizes: an estimate of a model's bytes (weights, and an evaluation's state and activations) against memory ----
LAYER_OVERHEAD = 1 << 19  # bytes of Python, Keras and TensorFlow objects per block besides its weights (~0.7 MiB)
_FLOAT_BYTES = 4  # weights and activations are float32 (bfloat16 computes, but its variables stay float32)


def _sizes(model, n_token: int | None = None) -> dict:
    """The sizes that make a model's weights, from a ModelConfig or a TransformerXL (the same attribute names);
    `n_token` stands in for an unset one (0: the vocabulary is not counted)."""
    sizes = {name: getattr(model, name) for name in ("n_layer", "d_model", "n_head", "d_head", "d_inner", "n_token",
                                                     "d_embed", "cutoffs", "div_val", "attn_type", "max_position",
                                                     "untie_r", "proj_same_dim")}
    sizes["n_token"] = n_token if n_token is not None else (sizes["n_token"] or 0)
    if sizes["d_embed"] == sizes["d_model"]:
        sizes["d_embed"] = None  # it follows d_model (a TransformerXL holds the resolved value)
    return sizes


def _weights(s: dict) -> int:
    """About how many weights a TransformerXL of sizes `s` holds (an upper estimate: every projection counted)."""
    d, width, d_embed = s["d_model"], s["n_head"] * s["d_head"], s["d_embed"] or s["d_model"]
    edges = [0, *s["cutoffs"], max(s["n_token"], *s["cutoffs"], 0)]
    rows = [max(b - a, 0) for a, b in zip(edges[:-1], edges[1:], strict=True)]
    if s["div_val"] == 1:
        tables, projections = s["n_token"] * d_embed, (d_embed * d if d_embed != d else 0)
    else:
        widths = [max(d_embed // s["div_val"] ** i, 1) for i in range(len(rows))]
        tables = sum(r * w for r, w in zip(rows, widths, strict=True))
        projections = sum(w * d for w in widths if w != d or s["proj_same_dim"])
    embedding = tables + projections
    softmax = s["n_token"] + len(s["cutoffs"]) * (d_embed + 1) + projections  # its own projections, untied
    encoding = encodings.get(s["attn_type"])
    per_layer = 4 * d * width + 2 * d * s["d_inner"] + s["d_inner"] + 5 * d  # q, k, v, o; feed-forward; norms
    per_layer += encoding.weights_per_layer(d_model=d, width=width, max_position=s["max_position"])
    stack = encoding.weights_of_stack(n_layer=s["n_layer"], width=width, untie_r=s["untie_r"])
    return embedding + softmax + s["n_layer"] * per_layer + stack


def _model_bytes(s: dict) -> int:
    return _FLOAT_BYTES * _weights(s) + s["n_layer"] * LAYER_OVERHEAD


def _inference_bytes(s: dict, batch_size: int, tgt_len: int, mem_len: int) -> int:
    """The model's bytes and those of scoring `batch_size` rows in segments of `tgt_len` over a memory of `mem_len`:
    the state (keys and values, or hidden states, of every layer), the attention scores and the logits."""
    width, keys = s["n_head"] * s["d_head"], mem_len + tgt_len
    state = s["n_layer"] * keys * (batch_size * max(s["d_model"], 2 * width) + width)
    attention = 4 * batch_size * s["n_head"] * tgt_len * keys  # scores, bias, probabilities and their dropout
    activations = batch_size * tgt_len * (s["d_inner"] + 4 * s["d_model"] + 2 * s["n_token"]) + 2 * keys * s["d_model"]
    return _model_bytes(s) + _FLOAT_BYTES * (state + attention + activations)


def _culprit(estimate, values: dict, typical: dict) -> str:
    """The field of `values` ({name: value}) to lower: of those whose halving saves a fifth of `estimate(values)` or
    more, the one furthest above its `typical` value (the largest shipped setups')."""
    total = estimate(values)
    weighty = [name for name in values if values[name] > 1
               and estimate({**values, name: values[name] // 2}) <= 0.8 * total]
    return max(weighty or [name for name in values if values[name]], key=lambda name: values[name] / typical[name])


def _too_large(needed: int, what: str) -> str | None:
    memory = untrusted.machine_memory()
    if needed <= memory:
        return None
    return (f"{what} needs about {untrusted.size_text(needed)} of memory, more than the "
            f"{untrusted.size_text(memory)} of this machine")


def model_bytes(model, n_token: int | None = None) -> int:
    """About how many bytes a TransformerXL of `model` (a ModelConfig or the model) takes once built: its float32
    weights and the objects of its blocks. `n_token`: the vocabulary's size, where the config leaves it unset."""
    return _model_bytes(_sizes(model, n_token))


def inference_bytes(model, *, batch_size: int, tgt_len: int, mem_len: int, n_token: int | None = None) -> int:
    """`model_bytes` and the state and activations of scoring `batch_size` rows in segments of `tgt_len` over a
    memory of `mem_len` (evaluation, `score`, generation)."""
    return _inference_bytes(_sizes(model, n_token), batch_size, tgt_len, mem_len)


# The sizes of the largest shipped setups (gin/*_large.gin), against which a culprit stands out.
_TYPICAL_MODEL = {"n_layer": 24, "d_model": 1280, "n_head": 16, "d_head": 80, "d_inner": 8192, "n_token": 793_472,
                  "d_embed": 1280, "max_position": 1024}
_TYPICAL_EVAL = (16, 128, 3800)  # batch_size, tgt_len, mem_len


def check_model_size(model, n_token: int | None = None, where: str = "ModelConfig") -> None:
    """Raises ConfigError naming the size to lower when a model of `model`'s sizes (a ModelConfig or a
    TransformerXL; `n_token` for an unset one) would not fit in this machine's memory: before anything is built."""
    s = _sizes(model, n_token)
    problem = _too_large(_model_bytes(s), "a model of these sizes")
    if problem is None:
        return
    fields = {name: s[name] for name in _TYPICAL_MODEL
              if (name != "max_position" or encodings.get(s["attn_type"]).uses_max_position)
              and s[name] is not None}
    name = _culprit(lambda values: _model_bytes({**s, **values}), fields, _TYPICAL_MODEL)
    if name == "n_token" and n_token is not None:  # the data's vocabulary, not a binding
        raise ConfigError(f"the vocabulary's {n_token} symbols ({where}.n_token): {problem}; use data with a smaller "
                          f"vocabulary, or adaptive embeddings ({where}.cutoffs with {where}.div_val > 1)")
    raise ConfigError(f"{where}.{name}={s[name]}: {problem}; lower {where}.{name} (its binding in the gin file or "
                      "--gin_param, or the preset's config.json)")


def check_inference_size(model, *, batch_size: int, tgt_len: int, mem_len: int, n_token: int | None = None,
                         names: tuple = ("EvalConfig.batch_size", "EvalConfig.tgt_len", "EvalConfig.mem_len")) -> None:
    """Raises ConfigError naming the length to lower when scoring `batch_size` rows in segments of `tgt_len` over a
    memory of `mem_len` with `model` (a ModelConfig or a TransformerXL) would not fit in this machine's memory.

    Run before any tensor of the evaluation is made. `names`: how the message calls the batch size, the segment
    length and the memory length (EvalConfig's by default).
    """
    s = _sizes(model, n_token)
    problem = _too_large(_inference_bytes(s, batch_size, tgt_len, mem_len),
                         f"scoring {batch_size} row(s) in segments of {tgt_len} over a memory of {mem_len}")
    if problem is None:
        return
    values = dict(zip(names, (batch_size, tgt_len, mem_len), strict=True))
    name = _culprit(lambda v: _inference_bytes(s, *v.values()), values, dict(zip(names, _TYPICAL_EVAL, strict=True)))
    raise ConfigError(f"{name}={values[name]}: {problem}; lower {name}")


def generation_bytes(model, *, batch_size: int, length: int, segment_len: int, mem_len: int, beams: int = 1,
                     n_token: int | None = None) -> int:
    """About how many bytes generating `length` positions (prompt and new tokens) for `batch_size` prompts takes,
    `beams` rows per prompt (keras-hub's BeamSampler): `inference_bytes` of every row (the model, the state, a
    segment's activations and logits) and the buffers that grow with the length: per row the token ids and the
    padding mask (int32, the caller's copy and the function's), per prompt its hidden states (time-first and
    transposed)."""
    s = _sizes(model, n_token)
    rows = batch_size * beams
    per_position = rows * 4 * 4 + batch_size * 2 * _FLOAT_BYTES * s["d_model"]
    return _inference_bytes(s, rows, segment_len, mem_len) + length * per_position


def check_generation_size(model, *, batch_size: int, length: int, segment_len: int, mem_len: int, beams: int = 1,
                          n_token: int | None = None, name: str = "max_length", given: int | None = None,
                          batch_name: str = "the number of prompts", beams_name: str = "num_beams") -> None:
    """The one bound on the lengths a user gives to generation (`--max_tokens`, `max_length`, a preprocessor's
    `sequence_length`, the number of prompts, keras-hub's `num_beams`): a ConfigError naming the value, the bound
    and the fix when `generation_bytes` is more than this process can allocate now (`untrusted.available_memory`),
    or the positions exceed int32. Run before any tensor of the generation is made.

    `length`: the positions of each row, prompt included; `name` and `given`: how the user gave it (e.g.
    "--max_tokens" and the new tokens alone: the bound is then said in those terms).
    """
    given = length if given is None else given
    offset = length - given  # positions the user's value does not count (the prompt, for --max_tokens)
    if beams == 1:  # the model, its state and a segment alone: the evaluation's lengths or the batch, named
        check_inference_size(model, batch_size=batch_size, tgt_len=segment_len, mem_len=mem_len, n_token=n_token,
                             names=(batch_name, "EvalConfig.tgt_len", "EvalConfig.mem_len"))
    if length > INT32_MAX:
        raise ConfigError(f"{name}={given} is more positions than generation can index (at most {INT32_MAX} in all); "
                          f"lower {name}")
    sizes = dict(batch_size=batch_size, segment_len=segment_len, mem_len=mem_len, beams=beams, n_token=n_token)
    need = generation_bytes(model, length=length, **sizes)
    free = untrusted.available_memory()
    if need <= free:
        return
    fixed = generation_bytes(model, length=0, **sizes)
    per_position = generation_bytes(model, length=1, **sizes) - fixed
    longest = (free - fixed) // per_position - offset if free > fixed else 0
    rows = f"{batch_size} prompt(s)" + (f" x {beams_name}={beams}" if beams > 1 else "")
    if longest >= 1:
        fix = f"at most about {longest} fit now: lower {name}"
    elif beams > 1:
        fix = f"lower {beams_name}"
    else:
        fix = f"lower {batch_name} (or the model's EvalConfig lengths)"
    raise ConfigError(f"{name}={given}: generating {length} positions for {rows} needs about "
                      f"{untrusted.size_text(need)} of memory, more than the {untrusted.size_text(free)} this process "
                      f"can allocate now; {fix}")


INT32_MAX = 2**31 - 1  # TensorFlow's shapes and positions are int32: no length or size may exceed it
MAX_LAYERS = 1024  # building a block takes ~40 ms and ~0.7 MiB besides its weights: deeper is a typo
SEED_MAX = 2**32 - 1  # NumPy's legacy seeding (keras.utils.set_random_seed) takes [0, 2**32 - 1]

_ELEMENTS = {"ModelConfig": {"cutoffs": int, "tie_projs": bool}}
_RULES = {
    "ModelConfig": {
        "n_layer": _in_range(1, MAX_LAYERS), "d_model": _in_range(1, INT32_MAX), "n_head": _in_range(1, INT32_MAX),
        "d_head": _in_range(1, INT32_MAX), "d_inner": _in_range(1, INT32_MAX),
        "dropout": _in_range(0, 1, high_open=True), "dropatt": _in_range(0, 1, high_open=True),
        "mem_len": _in_range(0, INT32_MAX), "n_token": _in_range(2, INT32_MAX), "d_embed": _in_range(1, INT32_MAX),
        "cutoffs": _ascending_positive(INT32_MAX),
        "div_val": _in_range(1, INT32_MAX), "clamp_len": _in_range(-1, INT32_MAX),
        "attn_type": _one_of(encodings.NAMES),
        "layer_norm_epsilon": _positive(), "init_std": _at_least(0), "proj_init_std": _at_least(0),
        "max_position": _in_range(1, INT32_MAX),
    },
    "DataConfig": {"dataset": ((lambda v: bool(v)), "a non-empty name"),
                   "data_dir": ((lambda v: bool(v)), "a non-empty path")},
    "TrainConfig": {
        "batch_size": _in_range(1, INT32_MAX), "tgt_len": _in_range(1, INT32_MAX),
        "train_steps": _in_range(1, INT32_MAX), "learning_rate": _positive(), "warmup_steps": _in_range(0, INT32_MAX),
        "min_lr_ratio": _in_range(0, 1),
        "adam_beta1": _in_range(0, 1, high_open=True), "adam_beta2": _in_range(0, 1, high_open=True),
        "adam_epsilon": _positive(), "clip_norm": _positive(), "grad_accum_steps": _in_range(1, INT32_MAX),
        "mixed_precision": _or_auto(), "jit_compile": _or_auto(),  # a bool, or AUTO (a bool skips the rules)
        "steps_per_loop": _in_range(1, INT32_MAX), "log_every": _in_range(1, INT32_MAX),
        "eval_every": _in_range(0, INT32_MAX), "eval_steps": _in_range(0, INT32_MAX),
        "checkpoint_every": _in_range(0, INT32_MAX), "keep_checkpoints": _in_range(1, INT32_MAX),
        "nonfinite": _one_of(policy.NONFINITE_MODES), "sample_tokens": _in_range(0, INT32_MAX),
        "kernels": _one_of((*policy.KERNELS, policy.AUTO)),
        "recompute": _one_of(policy.RECOMPUTE), "seed": _in_range(0, SEED_MAX),
    },
    "EvalConfig": {
        "tgt_len": _in_range(1, INT32_MAX), "mem_len": _in_range(0, INT32_MAX), "clamp_len": _in_range(-1, INT32_MAX),
        "batch_size": _in_range(1, INT32_MAX), "max_steps": _in_range(0, INT32_MAX),
        "protocol": _one_of(PROTOCOLS), "compute_dtype": _one_of(COMPUTE_DTYPES), "layout": _one_of(LAYOUTS),
    },
}


# ---- parsing gin files and bindings --------------------------------------------------------------------------
def _gin_dir() -> str:
    """The shipped gin files: the checkout's top-level gin/ beside the package, else the installed copy.

    A wheel installs gin/ as txl_tf/gin (pyproject.toml). The folder beside an installed package is another
    project's (gin-config's own package is site-packages/gin), so it counts only when it holds common.gin.
    """
    package = os.path.dirname(os.path.abspath(__file__))
    installed = os.path.join(package, "gin")
    checkout = os.path.join(os.path.dirname(package), "gin")
    if not os.path.isdir(installed) and os.path.isfile(os.path.join(checkout, "common.gin")):
        return checkout
    return installed


GIN_DIR = _gin_dir()


def resolve_gin_file(path: str) -> str:
    """`path` if it exists, else the file of that name in the shipped gin files (GIN_DIR; `gin/` may lead)."""
    if os.path.exists(path):
        return path
    parts = os.path.normpath(path).split(os.sep)
    inside = os.path.join(*parts[1:]) if len(parts) > 1 and parts[0] == "gin" else path
    for candidate in (os.path.join(GIN_DIR, inside), os.path.join(GIN_DIR, os.path.basename(path))):
        if os.path.exists(candidate):
            return candidate
    available = sorted(f for f in os.listdir(GIN_DIR) if f.endswith(".gin")) if os.path.isdir(GIN_DIR) else []
    raise ConfigError(f"gin file {path!r} not found (looked in the working directory and txl_tf's gin files, "
                      f"{GIN_DIR}); give an existing file{', e.g. one of ' + ', '.join(available) if available else ''}")


class _DropMessages(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def gin_error(error: BaseException, where: str = "") -> ConfigError:
    """A gin parsing or binding error as one ConfigError line."""
    text = " | ".join(line.strip() for line in str(error).strip().splitlines() if line.strip())
    return ConfigError(f"bad gin configuration{' in ' + where if where else ''}: {text}; check the spelling "
                       "against the fields of txl_tf/configs.py (ModelConfig, DataConfig, TrainConfig, EvalConfig)")


ALLOW_IMPORTS_ENV = "TXL_TF_GIN_ALLOW_IMPORTS"
_NO_IMPORTS = "gin files may not import modules (a run folder someone sends must be as safe as a checkpoint)"
_BINDING_FORM = "write each binding as Configurable.parameter = value, e.g. TrainConfig.learning_rate = 2.5e-4"


def imports_allowed() -> bool:
    """Whether gin `import` statements may run: only when $TXL_TF_GIN_ALLOW_IMPORTS is 1 (the user's opt-in)."""
    value = os.environ.get(ALLOW_IMPORTS_ENV, "").strip().lower()
    if value in ("", "0", "false", "no"):
        return False
    if value in ("1", "true", "yes"):
        return True
    raise ConfigError(f"{ALLOW_IMPORTS_ENV}={value!r} is not a switch: set it to 1 to let gin files import modules, "
                      "or unset it")


class _Inert(config_parser.ParserDelegate):
    """Stands in for gin's delegate: `@references` and `%macros` parse to nothing, so reading binds nothing."""

    def configurable_reference(self, scoped_configurable_name, evaluate):
        return None

    def macro(self, macro_name):
        return None


def _statements(text: str, where: Callable[[int | None], str], fix: str) -> list:
    """gin's own parser over `text`, acting on nothing (no import, include or binding happens): its statements.

    A syntax error is a ConfigError `<where(line)>: bad gin syntax (...); <fix>`.
    """
    try:
        return list(config_parser.ConfigParser(text, _Inert()))
    except SyntaxError as error:
        # gin appends "Failed to parse token 'x' in '...'" to Python's own message about a value: that part says it
        lines = [part.strip() for part in (error.msg or "").splitlines() if part.strip()]
        detail = next((part for part in lines if part.startswith("Failed to parse")), " ".join(lines))
        if error.text and error.text.strip() and " in '" not in detail:
            detail += f" in {error.text.strip()!r}"
        line = error.lineno
    except tokenize.TokenError as error:  # an unclosed bracket or string: Python names the end of the text
        line, detail = error.args[1][0] if len(error.args) > 1 else None, str(error.args[0])
        line = _unclosed_statement_line(text) if "statement" in detail else line
    except (ValueError, RecursionError) as error:
        line, detail = None, one_line(error)
    raise ConfigError(f"{where(line)}: bad gin syntax ({detail}); {fix}")


def _unclosed_statement_line(text: str) -> int | None:
    """The line where the statement that is still open at the end of `text` begins."""
    start = None
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type == tokenize.NEWLINE:
                start = None
            elif start is None and token.type not in (tokenize.NL, tokenize.COMMENT, tokenize.INDENT,
                                                        tokenize.DEDENT):
                start = token.start[0]
    except tokenize.TokenError:
        pass
    return start


def _find_included(name: str, search: Sequence[str]) -> str | None:
    """The file gin opens for `include name`: the first of gin's search paths that holds it."""
    prefixes = [""] if os.path.isabs(name) else (getattr(gin.config, "_LOCATION_PREFIXES", None) or ["", *search])
    for prefix in prefixes:
        candidate = os.path.join(prefix, name)
        if os.path.exists(candidate):  # a device or a folder too: reading it refuses it in one line
            return candidate
    return None


def _check_statements(statements: list, where: Callable[[int | None], str], allow_imports: bool,
                      search: Sequence[str], stack: tuple) -> None:
    for statement in statements:
        if isinstance(statement, config_parser.ImportStatement):
            if allow_imports or (statement.is_from and statement.module.startswith("__gin__.")):
                continue  # `from __gin__ import dynamic_registration` switches a gin feature on; it imports nothing
            text = (statement.location.line_content or statement.format()).strip()
            raise ConfigError(f"{where(statement.location.line_num)}: {text!r} — {_NO_IMPORTS}; remove the line or "
                              f"set {ALLOW_IMPORTS_ENV}=1 to allow it")
        if isinstance(statement, config_parser.IncludeStatement):
            path = _find_included(statement.filename, search)
            if path is None:
                raise ConfigError(f"{where(statement.location.line_num)}: include {statement.filename!r} not found "
                                  "(looked in the working directory, the including files' folders and txl_tf's "
                                  "gin files); fix the name or give the file")
            _check_file(os.path.abspath(path), allow_imports, search, stack)


def _check_file(path: str, allow_imports: bool, search: Sequence[str], stack: tuple = ()) -> None:
    real = os.path.realpath(path)
    if real in stack:
        raise ConfigError(f"{path} includes itself (through {' -> '.join(stack)}); remove one of the include lines")
    try:  # a regular file of at most GIN_LIMIT bytes (a link to /dev/zero or a 3 GB file is one line)
        text = untrusted.read_text(path, max_bytes=untrusted.GIN_LIMIT, what="gin file")
    except untrusted.UntrustedFileError as error:
        raise ConfigError(str(error)) from None
    except OSError as error:
        raise ConfigError(f"cannot read gin file {path}: {one_line(error)}; give a readable text file") from None
    statements = _statements(text, lambda line: f"{path}:{line}" if line else path,
                             "fix the line: " + _BINDING_FORM)
    _check_statements(statements, lambda line: f"{path}:{line}", allow_imports, search, (*stack, real))


def check_gin(files: Sequence[str] = (), bindings: Sequence[str] = (), *, allow_imports: bool | None = None,
              search: Sequence[str] = ()) -> None:
    """Reads gin `files` (and every file they include) and `bindings` with gin's parser, acting on nothing.

    Raises ConfigError (one line naming the file and line, or the binding) on a syntax error, an include that is
    not found, a file that is not a regular file or holds more than `untrusted.GIN_LIMIT` bytes, and an `import`
    statement unless `allow_imports` (default: `imports_allowed()`). gin imports a
    module when it parses the statement, so this runs before gin parses anything. `search` are the folders gin
    looks in for included files besides its own search paths.
    """
    allow = imports_allowed() if allow_imports is None else allow_imports
    for path in files:
        _check_file(path, allow, search)
    for binding in bindings:
        statements = _statements(binding, lambda line, binding=binding: f"gin binding {binding!r}",
                                 _BINDING_FORM)
        _check_statements(statements, lambda line, binding=binding: f"gin binding {binding!r}", allow, search, ())
    # gin parses the bindings as one text, one per line: what holds for each must hold for them together.
    joined = _statements("\n".join(bindings), lambda line: f"gin bindings (line {line} of them together)",
                         "give each binding whole in one --gin_param: " + _BINDING_FORM)
    _check_statements(joined, lambda line: f"gin bindings (line {line} of them together)", allow, search, ())


def parse_gin(files=(), bindings=(), *, lenient_files=(), allow_imports: bool | None = None) -> list:
    """Parses gin `files` (found as given or in gin/) and then `bindings`; returns the files' paths.

    Unknown configurables and parameters are errors, except in `lenient_files` (parsed first, e.g. a run's
    config.gin, which may bind configurables of modules this program does not import). Everything is first read
    by `check_gin`: a syntax error is one line, and an `import` statement (in any file, included file or binding)
    is refused unless `allow_imports` or $TXL_TF_GIN_ALLOW_IMPORTS=1.
    """
    paths = [resolve_gin_file(p) for p in files]
    search = list(dict.fromkeys([os.path.dirname(os.path.abspath(p)) for p in (*lenient_files, *paths)]
                                + [GIN_DIR]))
    for directory in search:
        gin.add_config_file_search_path(directory)
    check_gin([*lenient_files, *paths], bindings, allow_imports=allow_imports, search=search)
    quiet = _DropMessages("Path not found")  # gin logs every search-path miss of an include before a hit
    logging.getLogger().addFilter(quiet)
    try:
        for path in lenient_files:
            try:
                gin.parse_config_file(path, skip_unknown=True)
            except (ValueError, SyntaxError, KeyError, TypeError) as error:
                raise gin_error(error, path) from None
        try:
            gin.parse_config_files_and_bindings(paths, list(bindings), finalize_config=False)
        except ConfigError:
            raise
        except (ValueError, SyntaxError, KeyError, TypeError) as error:
            raise gin_error(error) from None
    finally:
        logging.getLogger().removeFilter(quiet)
    return list(lenient_files) + paths


def make_configs() -> dict:
    """The four configs as the parsed gin bindings make them: {"ModelConfig": ModelConfig(...), ...}."""
    made = {}
    for cls in (ModelConfig, DataConfig, TrainConfig, EvalConfig):
        try:
            made[cls.__name__] = cls()
        except ConfigError:
            raise
        except (ValueError, RuntimeError, TypeError) as error:  # e.g. a %gin.REQUIRED value not given
            raise gin_error(error) from None
    return made



@dataclasses.dataclass
class Configs:
    """The four gin dataclasses as one set of bindings makes them, and the gin files read for it."""

    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    eval: EvalConfig
    files: tuple = ()

    def values(self) -> dict:
        """{"ModelConfig.n_layer": 12, ...}: every field of the four configs by its gin name."""
        values = {}
        for config in (self.model, self.data, self.train, self.eval):
            for field in dataclasses.fields(config):
                value = getattr(config, field.name)
                values[f"{type(config).__name__}.{field.name}"] = tuple(value) if isinstance(value, list) else value
        return values


def parse_configs(gin_files: Sequence[str] = (), gin_params: Sequence[str] = (), *,
                  base_files: Sequence[str] = ()) -> Configs:
    """Clears gin, parses `base_files`, then `gin_files`, then `gin_params` (later values win); returns the configs.

    `base_files` (a run's saved config.gin: txl_tf.runs.run_dir.read_configs) may bind configurables of modules not
    imported here; an unknown configurable or parameter in `gin_files` or `gin_params` is an error (ConfigError).
    """
    gin.clear_config()
    files = parse_gin(gin_files, gin_params, lenient_files=base_files)
    made = make_configs()
    check_clamp(made["ModelConfig"].attn_type, made["EvalConfig"].clamp_len)  # the protocol evaluation hands it
    return Configs(model=made["ModelConfig"], data=made["DataConfig"], train=made["TrainConfig"],
                   eval=made["EvalConfig"], files=tuple(files))


# The ModelConfig fields that define the function a model computes (its weights' shapes and what it does with
# them): a checkpoint or preset cannot be loaded into a model whose value differs. `architecture` records them.
ARCHITECTURE_FIELDS = ("n_layer", "d_model", "n_head", "d_head", "d_inner", "n_token", "d_embed", "cutoffs", "div_val",
                       "tie_projs", "proj_same_dim", "untie_r", "attn_type", "pre_lnorm", "layer_norm_epsilon",
                       "max_position")
ARCHITECTURE = tuple(f"ModelConfig.{name}" for name in ARCHITECTURE_FIELDS)
# Fields that shape the rest of the saved training state (a run's checkpoints hold them).
SAVED_STATE = ("ModelConfig.mem_len", "TrainConfig.batch_size", "TrainConfig.checkpoint_memory")


def architecture(model, n_token: int | None = None) -> dict:
    """The architecture of `model` (a ModelConfig or a built TransformerXL) as one canonical, JSON-ready dict: the
    ARCHITECTURE_FIELDS, with the defaults a model resolves filled in (d_embed None is d_model, tie_projs None is
    the softmax's default) and max_position kept only where the encoding has tables of it. `n_token` stands in
    for an unset one. The record that travels with every checkpoint folder, preset and export
    (`txl_tf.runs.run_dir.record_architecture`) and is compared on every load (`differing_architecture`)."""
    values = {name: getattr(model, name) for name in ARCHITECTURE_FIELDS}
    if values["n_token"] is None:
        values["n_token"] = n_token
    values["d_embed"] = values["d_embed"] or values["d_model"]
    values["cutoffs"] = [int(c) for c in values["cutoffs"]]
    if values["tie_projs"] is None:  # AdaptiveSoftmax's default
        values["tie_projs"] = [not values["cutoffs"]] + [True] * len(values["cutoffs"])
    values["tie_projs"] = [bool(t) for t in values["tie_projs"]]
    if not encodings.get(values["attn_type"]).uses_max_position:
        values["max_position"] = None
    return values


def differing_architecture(recorded: dict, current: dict) -> str | None:
    """'ModelConfig.F: A recorded, B here' for the first architecture field whose values differ between the record
    `recorded` (read from a file: any fields) and `current` (`architecture(...)`), or None when they agree."""
    for name in ARCHITECTURE_FIELDS:
        if name in recorded and recorded[name] != current.get(name):
            return f"ModelConfig.{name} is {recorded[name]!r} there but {current.get(name)!r} here"
    return None


def compare_configs(model_dir: str, saved: Configs, new: Configs) -> list[str]:
    """Checks a new configuration against the one a run in `model_dir` saved; returns the changed bindings.

    Raises ConfigError when a field in ARCHITECTURE or SAVED_STATE differs (the checkpoints cannot be restored).
    """
    old_values, new_values = saved.values(), new.values()
    changed = [name for name in new_values if name in old_values and old_values[name] != new_values[name]]
    fixed = [name for name in changed if name in ARCHITECTURE + SAVED_STATE]
    if fixed:
        what = ", ".join(f"{name}={old_values[name]!r}" for name in fixed)
        now = ", ".join(f"{new_values[name]!r}" for name in fixed)
        raise ConfigError(
            f"{model_dir} was trained with {what} (its config.gin) but this command gives {now}: its "
            "checkpoints cannot be restored into a different architecture or state; drop the changed bindings, "
            "or pass another --model_dir for a new run")
    return [f"{name}: {old_values[name]!r} -> {new_values[name]!r}" for name in changed]
