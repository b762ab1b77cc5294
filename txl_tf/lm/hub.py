"""Transformer-XL as keras-hub models: a Backbone, a CausalLM, its preprocessor and its tokenizer.

    import txl_tf.lm.hub  # registers the classes with Keras, so that keras-hub's loaders find them
    lm = keras_hub.models.CausalLM.from_preset("my_preset")    # a preset written by save_to_preset
    lm.compile(sampler="beam")                                 # any keras-hub sampler
    lm.generate("The meaning of", max_length=64)

The recurrent state is keras-hub's generation cache: a tuple of tensors with the batch first (the keys and values
of each layer's memory, [B, n, N, M, D], or the hidden-state memory [B, n, M, d] where a keys/values cache cannot
carry the model), of a fixed length M = the evaluation's mem_len. So every sampler that repeats or gathers rows
(beam, contrastive) works, and generation runs past any window: each new token attends to the last M positions
of every layer, the model's point. The prompt is consumed in segments of the evaluation's tgt_len before the
sampler's loop; rows whose prompts are longer than the shortest one feed their remaining prompt tokens through
the loop one at a time (the same state: incremental decoding equals a full pass).

Layout of a preset (keras-hub's): config.json (the backbone: `model_config`, the architecture as
`txl_tf.configs.ModelConfig`, and `eval_config`, the evaluation protocol as `EvalConfig`, which travels with the
model), model.weights.h5, tokenizer.json with assets/tokenizer/vocab.json, preprocessor.json, task.json,
metadata.json (with the vocabulary's fingerprint). The file names are fixed (a preset's `config_file` fields are
ignored), and every file of a local preset is checked before keras-hub reads it by the classes' `from_preset`
(and, wherever txl_tf's code runs first, by keras-hub's own loaders): `txl_tf.lm.hub_files`.
`TransformerXLCausalLM.from_preset` (which `txl_tf.TransformerXLCausalLM` is: one class per name) also loads run
folders, best/, averaged/, converted authors' checkpoints and presets of txl_tf's earlier format
(`txl_tf.lm.presets.load`).

A stream language model has no end-of-text token: `generate` runs to `max_length` unless `stop_token_ids` are
given (a word-level vocabulary's "<eos>" is a line end, not the end of a text).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import os
import random
import re
from collections.abc import Sequence

import keras
import keras_hub
import numpy as np
import tensorflow as tf

from txl_tf.base import paths, staging, untrusted
from txl_tf.base.errors import ConfigError, UserError, one_line
from txl_tf.configs import (
    EvalConfig,
    ModelConfig,
    check_clamp,
    check_generation_size,
    check_inference_size,
    differing_architecture,
)
from txl_tf.configs import architecture as configs_architecture
from txl_tf.data.vocab import Vocab
from txl_tf.evaluation.loops import evaluate_vanilla
from txl_tf.lm import hub_files
from txl_tf.lm.sampling import Generator, check_settings, generate_with, text_pieces, with_prompt
from txl_tf.lm.text_scoring import ScoreResult, ScoreStream, as_texts, check_text, short_text
from txl_tf.lm.tokenizer import GraphTokenizer
from txl_tf.model import tensor_ops as T
from txl_tf.model.attention import without_runtime_asserts
from txl_tf.model.inference import Recurrent, run_segments
from txl_tf.model.protocol import Protocol
from txl_tf.model.state import Cache, Memory
from txl_tf.model.transformer_xl import TransformerXL
from txl_tf.runs.loading import check_dtype, check_weights_file

# Keras registered names ("txl_tf.hub>TransformerXLCausalLM", ...): the package the classes registered under
# before the package had stage folders, kept so that every preset and .keras file saved since loads.
PACKAGE = "txl_tf.hub"
VOCAB_ASSET = "vocab.json"
PRESET_KIND = "keras-hub preset"  # the kind in the folder's manifest (txl_tf.base.paths)
# Positions per block of the ring's decoding loop (`TransformerXLCausalLM._block_decode`): the ring is written once
# a block. A batch-32 step at memory 2,000 took 14.6 ms at 32 against 17.1-17.3 at 8 and 16 and 21-22 with a write
# per token (products, softmax and writes in an XLA loop, 2-core AMD EPYC AVX2, 2026-11-29, issue 55).
DECODE_BLOCK = 32


def _config(kind, fields, what: str):
    """A validated ModelConfig / EvalConfig from a dict read from a file (one-line ConfigError otherwise)."""
    if isinstance(fields, kind):
        return fields
    known = {field.name for field in dataclasses.fields(kind)}
    if not isinstance(fields, dict) or set(fields) - known:
        unknown = sorted(set(fields) - known)[:5] if isinstance(fields, dict) else type(fields).__name__
        raise ConfigError(f"{what} must map {kind.__name__} fields to values (unknown: {unknown}); save the preset "
                          "again with save_to_preset")
    fields = dict(fields)
    for key in ("cutoffs", "tie_projs"):
        if isinstance(fields.get(key), list):
            fields[key] = tuple(fields[key])
    return kind(**fields)  # validated: types, ranges, the model's size against this machine's memory


def model_config_of(model: TransformerXL) -> ModelConfig:
    """The ModelConfig of a built `TransformerXL` (its architecture, from its Keras config)."""
    fields = {field.name for field in dataclasses.fields(ModelConfig)}
    return _config(ModelConfig, {key: value for key, value in model.get_config().items() if key in fields},
                   "the model's config")


def _with_padding_mask(inputs):
    """The model's inputs as a dict; token ids [B, L] alone have no padding."""
    if isinstance(inputs, dict):
        return inputs
    token_ids = keras.ops.convert_to_tensor(inputs) if not isinstance(inputs, keras.KerasTensor) else inputs
    return {"token_ids": token_ids, "padding_mask": keras.ops.ones_like(token_ids, "int32")}


def _row_lengths(padding_mask):
    """[B] tokens of each right-padded row: the padding mask's count of ones."""
    return keras.ops.sum(T.cast(padding_mask, T.int32), axis=1)


def _draws_token_by_token(sampler) -> bool:
    """Whether `sampler` runs keras-hub's plain loop (one token a step from `compute_probabilities` and
    `get_next_token`: greedy, top-k, top-p, random, txl_tf's `Sampling`), which `_block_decode` runs in blocks; beam
    and contrastive search have loops of their own."""
    base = keras_hub.samplers.Sampler
    return type(sampler).__call__ is base.__call__ and type(sampler).run_loop is base.run_loop


def _generated(token_ids, padding_mask, stop_token_ids):
    """generate_step's output: the token ids and the mask of what to keep (up to each row's first new stop)."""
    ops = keras.ops
    if stop_token_ids is None:
        return {"token_ids": token_ids, "padding_mask": ops.ones_like(token_ids, "bool")}
    stops = ops.convert_to_tensor(list(stop_token_ids), token_ids.dtype)
    ends = ops.any(ops.equal(token_ids[..., None], stops), axis=-1) & ops.logical_not(padding_mask)  # new stops
    ends = T.cast(ends, T.int32)
    after = ops.cumsum(ends, axis=-1) - ends  # positions after the first new stop token
    return {"token_ids": token_ids, "padding_mask": ops.equal(after, 0)}


def _projections(layer) -> bool:
    """Keras' quantize() filter: the model's dense projections."""
    return type(layer) is keras.layers.Dense


def _file_name(name: str) -> property:
    """keras-hub's `config_file` attribute, fixed to `name`. keras-hub keeps the value a preset's JSON holds,
    joins the output folder with it on save and reads the assets from the folder it names: a name taken from a
    file someone sent could write or read anywhere. The value a preset holds is dropped on load (`__init__`);
    setting another one is refused."""

    def get(self) -> str:
        return name

    def set(self, value) -> None:
        if value != name:
            raise ConfigError(f"config_file={str(value)[:60]!r}: txl_tf's keras-hub classes are saved as {name} "
                              "only; leave config_file unset")

    return property(get, set, doc=f"The JSON file this object is saved as in a preset: always {name}.")


def _length(value, what: str) -> int:
    """A number of tokens given by a user or read from a preset: a whole number >= 1 (one-line ConfigError)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ConfigError(f"{what} must be a whole number of tokens >= 1 (prompt and continuation), got "
                          f"{str(value)[:40]!r}; give a positive integer")
    return int(value)


@keras.saving.register_keras_serializable(package=PACKAGE)
class TransformerXLBackbone(keras_hub.models.Backbone):
    """The Transformer-XL network as a keras-hub Backbone: token ids -> hidden states [B, L, d_model].

    Args:
      model_config: the architecture, a `txl_tf.configs.ModelConfig` or its dict (n_token set).
      eval_config: the evaluation protocol (segment, memory and clamp lengths, same_length), an `EvalConfig` or
        its dict; generation and scoring use it. Required: EvalConfig's defaults (memory 2,100, clamp 820) are the
        published large models', not this model's, so a config (a preset's config.json) without one is refused.
      dtype: the Keras dtype policy of the layers (e.g. "mixed_bfloat16").
      transformer_xl: a built `txl_tf.TransformerXL` to wrap (its weights, not a copy; model_config and dtype
        default to its own), as `txl_tf.lm.generation.Generator` serves a trained model; None: a new one.

    A functional model, as keras-hub builds its backbones (gpt2_backbone.py): symbolic inputs {"token_ids",
    "padding_mask"} [B, L] through one layer, `self.transformer_xl` (a `txl_tf.TransformerXL`), to the hidden
    states; so it lives beside keras-hub's own models in one process. `backbone(token_ids)` alone (no padding) is
    taken too. The memory is a call argument and a return value of `call_with_state`, which calls the same layer.
    """

    def __init__(self, model_config=None, eval_config=None, dtype=None, *, transformer_xl=None, architecture=None,
                 **kwargs):
        if transformer_xl is not None:  # around a built model: its weights, not a copy
            model_config = model_config or model_config_of(transformer_xl)
            dtype = dtype or transformer_xl.dtype_policy.name
        if model_config is None:  # Keras would wrap a missing argument's TypeError in another
            raise ConfigError("the backbone has no model_config (the architecture, a ModelConfig or its dict); pass "
                              "model_config=ModelConfig(...), or save the preset again with save_to_preset")
        check_dtype(dtype)
        model_config = _config(ModelConfig, model_config, "the backbone's model_config")
        if architecture is not None:  # a config saved since the record exists: what its weights were saved from
            difference = differing_architecture(architecture, configs_architecture(model_config)) \
                if isinstance(architecture, dict) else f"'architecture' is a {type(architecture).__name__}"
            if difference:
                raise ConfigError(f"the backbone's model_config is not the architecture its weights were saved from "
                                  f"({difference}; config.json's 'model_config' against its 'architecture'); save "
                                  "the preset again with save_to_preset")
        lengths = ("tgt_len", "mem_len", "clamp_len")  # the protocol's lengths: never EvalConfig's defaults
        if eval_config is None or isinstance(eval_config, dict) and not set(lengths) <= set(eval_config):
            what = "no eval_config" if eval_config is None else \
                f"an eval_config without {', '.join(sorted(set(lengths) - set(eval_config)))}"
            raise ConfigError(f"the backbone has {what}: the evaluation protocol the model was trained for, whose "
                              "lengths EvalConfig's defaults (memory 2,100, clamp 820, another model's) must not "
                              "fill; pass eval_config=EvalConfig(...), or save the preset again with save_to_preset")
        eval_config = _config(EvalConfig, eval_config, "the backbone's eval_config")
        if model_config.n_token is None:
            raise ConfigError("the backbone's model_config has no n_token; set it to the vocabulary's size")
        check_inference_size(model_config, batch_size=1, tgt_len=eval_config.tgt_len, mem_len=eval_config.mem_len)
        check_clamp(model_config.attn_type, eval_config.clamp_len)  # generation's protocol: no clamp it ignores
        quantized = dtype if isinstance(dtype, keras.dtype_policies.DTypePolicyMap) else None
        # === Layers ===
        self.transformer_xl = transformer_xl or TransformerXL(**model_config.model_kwargs(), name="transformer_xl",
                                                              dtype=quantized.default_policy if quantized else dtype)
        # === Functional model ===
        token_ids = keras.Input(shape=(None,), dtype="int32", name="token_ids")
        padding_mask = keras.Input(shape=(None,), dtype="int32", name="padding_mask")
        lengths = keras.ops.sum(keras.ops.cast(padding_mask, "int32"), axis=1)  # right padding
        hidden, _ = self.transformer_xl(token_ids, lengths=lengths, protocol=eval_config.generation_protocol())
        super().__init__(inputs={"token_ids": token_ids, "padding_mask": padding_mask}, outputs=hidden, dtype=dtype,
                         **kwargs)
        # === Config ===
        self.model_config = model_config
        self.eval_config = eval_config
        self.token_embedding = self.transformer_xl.embedding
        if quantized:  # a quantized backbone's config (keras-hub's get_config): quantize the same layers again
            self._quantize_as(quantized)

    def __call__(self, inputs, *args, **kwargs):
        return super().__call__(_with_padding_mask(inputs), *args, **kwargs)

    def _quantize_as(self, policy_map):
        """Quantizes each layer `policy_map` (a DTypePolicyMap by layer path) names with a quantized policy, so
        that the weights of a quantized backbone load (their int8 kernels and scales)."""
        for layer in self.transformer_xl._flatten_layers(include_self=False):
            policy = policy_map[layer.path] if layer.path in policy_map else None
            if getattr(policy, "quantization_mode", None):
                layer.quantize(policy.quantization_mode)

    @staticmethod
    def get_layout_map(device_mesh, model_parallel_dim_name="model", data_parallel_dim_name="batch"):
        """A `keras.distribution.LayoutMap` that shards the large weights along the mesh's model axis (keras-hub's
        backbones' method of that name), for `keras.distribution.ModelParallel`:

            mesh = keras.distribution.DeviceMesh((1, 8), ("batch", "model"), keras.distribution.list_devices())
            layout_map = TransformerXLBackbone.get_layout_map(mesh)
            keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map,
                                                                                  batch_dim_name="batch"))
            lm = keras_hub.models.CausalLM.from_preset(PRESET)  # weights made after the distribution is set

        Attention: the query, key, value and position projections by their output columns, the output projection
        by its input rows; the feed-forward's inner layer by its columns (and bias), its outer layer by its rows;
        the adaptive embedding's tables by their columns (d_embed / div_val**i: a table's row count, a cluster's
        size, need not divide by the mesh). The rest (LayerNorms, biases of d_model, the adaptive softmax's
        cluster weights, the relative-position biases) is replicated. Each sharded dimension must divide by the
        model axis's size."""
        if not isinstance(device_mesh, keras.distribution.DeviceMesh):
            raise ConfigError(f"get_layout_map takes a keras.distribution.DeviceMesh, not a "
                              f"{type(device_mesh).__name__}")
        for name in (model_parallel_dim_name, data_parallel_dim_name):
            if name not in device_mesh.axis_names:
                raise ConfigError(f"the device mesh has no axis {name!r} (its axes: {list(device_mesh.axis_names)}); "
                                  "name the mesh's axes or pass model_parallel_dim_name / data_parallel_dim_name")
        model = model_parallel_dim_name
        layout_map = keras.distribution.LayoutMap(device_mesh)
        layout_map[r"transformer_xl/embedding/table_\d+"] = (None, model)
        layout_map[r"transformer_xl/layer_\d+/attention/(query|key|value|position)/kernel"] = (None, model)
        layout_map[r"transformer_xl/layer_\d+/attention/attention_output/kernel"] = (model, None)
        layout_map[r"transformer_xl/layer_\d+/feed_forward/inner/kernel"] = (None, model)
        layout_map[r"transformer_xl/layer_\d+/feed_forward/inner/bias"] = (model,)
        layout_map[r"transformer_xl/layer_\d+/feed_forward/outer/kernel"] = (model, None)
        return layout_map

    def quantize(self, mode=None, config=None, filters=None, **kwargs):
        """Keras' `Model.quantize`; by default of the dense projections only (attention: query, key, value,
        attention_output, xl's position; feed-forward: inner, outer), without a warning for each layer that holds
        no projection (dropout, the adaptive embedding and softmax, whose tables stay in the float dtype)."""
        super().quantize(mode, config=config, filters=_projections if filters is None else filters, **kwargs)

    @property
    def protocol(self) -> Protocol:
        """The attention lengths of generation: the evaluation's memory and clamp lengths; every token sees the
        whole memory (no same_length)."""
        return self.eval_config.generation_protocol()

    @property
    def segment_len(self) -> int:
        """Prompt segment length: the evaluation's tgt_len."""
        return self.eval_config.tgt_len

    def call_with_state(self, token_ids, state, padding_mask=None, protocol=None, training=False,
                        memory_lengths=None):
        """(hidden [B, L, d], new state): one segment with a `txl_tf.model.state` Memory or Cache (None: no memory);
        padding (padding_mask 0, right-aligned) does not enter the state; `memory_lengths` [B]: the positions each
        row's memory holds (the rest masked: generation's memory starts empty; `TransformerXL.call`)."""
        lengths = None
        if padding_mask is not None:
            lengths = _row_lengths(padding_mask)
        return self.transformer_xl(token_ids, state, protocol=protocol or self.protocol, lengths=lengths,
                                   training=training, memory_lengths=memory_lengths)

    def get_config(self):
        return {**super().get_config(), "model_config": dataclasses.asdict(self.model_config),
                "eval_config": dataclasses.asdict(self.eval_config),
                "architecture": configs_architecture(self.model_config)}  # compared with model_config on load

    @classmethod
    def from_preset(cls, preset, load_weights=True, **kwargs):
        """keras-hub's `Backbone.from_preset`, every file of a local preset checked first (`txl_tf.lm.hub_files`)."""
        _check_local(preset, load_weights=load_weights)
        return super().from_preset(preset, load_weights=load_weights, **kwargs)

    def load_weights(self, filepath, *args, **kwargs):
        """Keras' `load_weights` (keras-hub's loaders call it with a preset's weights), the file checked first: a
        regular file within the machine's memory, or a sharded index whose shards are (`hub_files.check_weights`)."""
        hub_files.check_weights(filepath)
        fix = "save the preset again with save_to_preset"
        if not os.fspath(filepath).endswith(".json"):  # exactly this model's variables (Keras skips the file's others)
            check_weights_file(self.weights, os.fspath(filepath), f"it does not fit this backbone's model_config: {fix}")
        try:
            return super().load_weights(filepath, *args, **kwargs)
        except (OSError, ValueError, KeyError) as error:
            raise UserError(f"{os.fspath(filepath)} does not load into this backbone ({one_line(error)}); "
                            f"{fix}") from None

    def save_to_preset(self, preset_dir, max_shard_size=10, *, overwrite=False):
        """keras-hub's backbone preset (config.json, the weights, metadata.json), written as
        `TransformerXLCausalLM.save_to_preset` writes a whole preset (see there)."""
        if self.__dict__.get("_txl_tf_in_task_save"):  # keras-hub's task saver, inside the staged folder
            return super().save_to_preset(preset_dir, max_shard_size=max_shard_size)
        return _staged_save(preset_dir, overwrite, lambda tmp: super(TransformerXLBackbone, self).save_to_preset(
            tmp, max_shard_size=max_shard_size))


@keras.saving.register_keras_serializable(package=PACKAGE)
class TransformerXLTokenizer(keras_hub.tokenizers.Tokenizer):
    """A Transformer-XL vocabulary (character or word level) as a keras-hub Tokenizer, tokenizing inside the
    TensorFlow graph (tensorflow-text; the ids equal `Vocab.encode`'s).

    Args:
      vocabulary: a `txl_tf.data.vocab.Vocab`, its `to_json()` dict, or the path of a vocab.json (not in a config
        read from a file: `from_config`); None until `load_assets` (a preset's assets/tokenizer/vocab.json).

    No start or end token (a stream language model has none). The pad id is 0, which is a real symbol (a trained
    vocabulary has no spare id): padding is told by the padding mask, never by its id, so it never reaches the
    state and a generated id 0 is kept. Tokens are str, as keras-hub's tokenizers give them (`get_vocabulary`).
    """

    backbone_cls = TransformerXLBackbone
    config_file = _file_name(hub_files.TOKENIZER)

    def __init__(self, vocabulary=None, **kwargs):
        kwargs.pop("config_file", None)  # a preset's record of its file name: ours is fixed (`_file_name`)
        super().__init__(**kwargs)
        self.file_assets = [VOCAB_ASSET]
        self.start_token_id = None
        self.end_token_id = None
        self.pad_token_id = 0
        self._graph = None
        self.set_vocabulary(vocabulary)

    @classmethod
    def from_vocab(cls, vocab: Vocab, **kwargs) -> TransformerXLTokenizer:
        """The tokenizer of a `Vocab`."""
        return cls(vocab, **kwargs)

    @classmethod
    def from_vocab_file(cls, path, **kwargs) -> TransformerXLTokenizer:
        """The tokenizer of a vocabulary file (`vocab.json`, as `python -m txl_tf.data.prepare` writes it)."""
        return cls(Vocab.load(os.fspath(path)), **kwargs)

    @classmethod
    def from_data_dir(cls, data_dir, **kwargs) -> TransformerXLTokenizer:
        """The tokenizer of a prepared data directory (its vocabulary, checked against its metadata)."""
        from txl_tf.data.pipeline import load_vocab

        return cls(load_vocab(os.fspath(data_dir)), **kwargs)

    def set_vocabulary(self, vocabulary) -> None:
        if vocabulary is None:
            self._graph = None
            return
        if isinstance(vocabulary, str):
            vocabulary = Vocab.load(vocabulary)  # a regular file, size-limited, schema-checked
        self._graph = GraphTokenizer(vocabulary, dtype=self.compute_dtype if self.compute_dtype in ("int32", "int64")
                                      else "int32")

    def _tokenizer(self) -> GraphTokenizer:
        if self._graph is None:
            raise ConfigError("the tokenizer has no vocabulary; pass one (a Vocab or a vocab.json path) or load a "
                              "preset with TransformerXLTokenizer.from_preset(DIR)")
        return self._graph

    @property
    def vocab(self) -> Vocab:
        return self._tokenizer().vocab

    def vocabulary_size(self) -> int:
        return self._tokenizer().vocabulary_size()

    def get_vocabulary(self) -> list:
        """Every token in id order, as str (keras-hub's tokenizers' type): words, or at character level each byte
        as a one-character str (a byte of 128..255, part of a UTF-8 character, as a lone surrogate, the
        "surrogateescape" form that `token_to_id` takes back)."""
        return [_token_str(token) for token in self._tokenizer().get_vocabulary()]

    def id_to_token(self, id):
        """The token of one id as str (see `get_vocabulary`)."""
        return _token_str(self._tokenizer().id_to_token(id))

    def token_to_id(self, token):
        """The id of a token of `get_vocabulary` (at character level also a byte value 0..255 or one byte)."""
        if isinstance(token, str) and self._tokenizer().level == "char" and len(token) == 1 \
                and "\udc80" <= token <= "\udcff":
            token = token.encode("utf-8", "surrogateescape")
        return self._tokenizer().token_to_id(token)

    def tokenize(self, inputs, *args, **kwargs):
        return self._tokenizer().tokenize(inputs)

    def detokenize(self, inputs, *args, **kwargs):
        text = self._tokenizer().detokenize(inputs)
        if not tf.executing_eagerly():
            return text
        text = text.numpy()  # Python strings, as keras-hub's tokenizers give eagerly
        if isinstance(text, bytes) or text.ndim == 0:  # one sequence [T] gives one string
            return (text if isinstance(text, bytes) else text.item()).decode("utf-8", "replace")
        return [row.decode("utf-8", "replace") for row in text.tolist()]

    def save_assets(self, dir_path):
        self.vocab.save(os.path.join(dir_path, VOCAB_ASSET))

    def load_assets(self, dir_path):
        self.set_vocabulary(os.path.join(dir_path, VOCAB_ASSET))

    def load_preset_assets(self, preset):
        """keras-hub's loaders call this with the preset they read (`Tokenizer.from_preset`, and through the
        preprocessor `CausalLMPreprocessor.from_preset` and `CausalLM.from_preset`, before the weights): a local
        preset is checked whole first (`hub_files.check`: every file, the vocabulary against the model's n_token
        and recorded fingerprint), and the vocabulary is its assets/tokenizer/vocab.json."""
        if not hub_files.is_local(preset):  # a kaggle:// or hf:// handle: keras-hub's download
            return super().load_preset_assets(preset)
        self.set_vocabulary(hub_files.check(preset, load_weights=False, tokenizer=True).vocab)

    @classmethod
    def from_preset(cls, preset, config_file=hub_files.TOKENIZER, **kwargs):
        """keras-hub's `Tokenizer.from_preset`, every file of a local preset checked first (`txl_tf.lm.hub_files`)."""
        _check_local(preset, load_weights=False, tokenizer=True)
        return super().from_preset(preset, config_file=config_file, **kwargs)

    @classmethod
    def from_config(cls, config):
        if isinstance(config.get("vocabulary"), (str, os.PathLike)):  # read from a file: it may not name another
            raise ConfigError(f"the tokenizer's config names the vocabulary file {str(config['vocabulary'])[:60]!r}; "
                              "a preset's vocabulary is its assets/tokenizer/vocab.json: save the preset again with "
                              "save_to_preset")
        return super().from_config(config)

    def get_config(self):
        return {**super().get_config(), "vocabulary": None}  # the vocabulary is an asset (vocab.json)


@keras.saving.register_keras_serializable(package=PACKAGE)
class TransformerXLCausalLMPreprocessor(keras_hub.models.CausalLMPreprocessor):
    """Text -> token ids (and shifted labels for `fit`), no start or end token; `sequence_length` is the default
    `max_length` of `generate` (prompt and continuation)."""

    backbone_cls = TransformerXLBackbone
    tokenizer_cls = TransformerXLTokenizer
    config_file = _file_name(hub_files.PREPROCESSOR)

    def __init__(self, tokenizer, sequence_length=256, add_start_token=False, add_end_token=False, **kwargs):
        kwargs.pop("config_file", None)  # a preset's record of its file name: ours is fixed (`_file_name`)
        super().__init__(tokenizer, sequence_length=_length(sequence_length, "the preprocessor's sequence_length"),
                         add_start_token=add_start_token, add_end_token=add_end_token, **kwargs)

    @classmethod
    def from_preset(cls, preset, config_file=hub_files.PREPROCESSOR, **kwargs):
        """keras-hub's `CausalLMPreprocessor.from_preset`, every file of a local preset checked first
        (`txl_tf.lm.hub_files`)."""
        _check_local(preset, load_weights=False, tokenizer=True)
        return super().from_preset(preset, config_file=config_file, **kwargs)


def _token_str(token) -> str:
    """A vocabulary symbol as keras-hub's tokenizers give tokens: a word as it is, a byte value as a one-character
    str (bytes 128..255 as lone surrogates, `bytes.decode("utf-8", "surrogateescape")`)."""
    return bytes([token]).decode("utf-8", "surrogateescape") if isinstance(token, int) else token


def _to_hub(state):
    """A `txl_tf.model.state` value -> (keras-hub's cache: a tuple with the batch first, the position keys or ())."""
    if isinstance(state, Cache):
        return (T.transpose(state.keys, [2, 0, 1, 3, 4]), T.transpose(state.values, [2, 0, 1, 3, 4])), \
            state.position_keys
    return (T.transpose(state.hidden, [1, 0, 2, 3]),), ()


def _from_hub(cache, position_keys):
    if len(cache) == 2:
        return Cache(T.transpose(cache[0], [1, 2, 0, 3, 4]), T.transpose(cache[1], [1, 2, 0, 3, 4]), position_keys)
    return Memory(T.transpose(cache[0], [1, 0, 2, 3]))


class _LogProbabilities(keras.layers.Layer):
    """The task's head: hidden states [B, L, d] -> log-probabilities [B, L, V] float32 by the adaptive softmax of
    `transformer_xl` (the backbone's layer, whose weights these are: the head holds none of its own)."""

    def __init__(self, transformer_xl, **kwargs):
        super().__init__(**kwargs)
        object.__setattr__(self, "_transformer_xl", transformer_xl)  # untracked: the backbone's weights
        self.built = True

    def call(self, hidden):
        return self._transformer_xl.log_probs(hidden)

    def compute_output_spec(self, hidden):
        return keras.KerasTensor([*hidden.shape[:-1], self._transformer_xl.n_token], "float32")


@keras.saving.register_keras_serializable(package=PACKAGE)
class TransformerXLCausalLM(keras_hub.models.CausalLM):
    """Transformer-XL as a keras-hub CausalLM: `generate` with every keras-hub sampler, the memory as the cache.

    Args:
      backbone: a `TransformerXLBackbone`.
      preprocessor: a `TransformerXLCausalLMPreprocessor` or None (then `generate` takes token ids).

    `lm(inputs)` returns log-probabilities [B, L, V] (keras-hub's logits; a softmax of them is the model's
    distribution). A functional model, as keras-hub builds its tasks (gpt2_causal_lm.py): the backbone's inputs,
    the backbone, then its adaptive softmax (`_LogProbabilities`).
    """

    backbone_cls = TransformerXLBackbone
    preprocessor_cls = TransformerXLCausalLMPreprocessor

    def __init__(self, backbone, preprocessor=None, **kwargs):
        tokenizer = getattr(preprocessor, "tokenizer", None)
        if isinstance(tokenizer, TransformerXLTokenizer) and tokenizer._graph is not None \
                and tokenizer.vocabulary_size() != backbone.model_config.n_token:  # loading: vocabulary not yet read
            raise ConfigError(f"the tokenizer's vocabulary holds {tokenizer.vocabulary_size()} symbols but the "
                              f"backbone's model has n_token={backbone.model_config.n_token}; give the vocabulary the "
                              "model was trained on")
        length = getattr(preprocessor, "sequence_length", None)
        if isinstance(length, int) and not isinstance(length, bool) and length >= 1:  # generate's default length
            check_generation_size(backbone.transformer_xl, batch_size=1, length=length, segment_len=backbone.segment_len,
                                  mem_len=backbone.protocol.mem_len, name="the preprocessor's sequence_length")
        # === Layers ===
        self.backbone = backbone
        self.preprocessor = preprocessor
        # === Functional model ===
        inputs = backbone.input
        hidden = backbone(inputs)
        outputs = _LogProbabilities(backbone.transformer_xl, name="log_probabilities")(hidden)
        super().__init__(inputs=inputs, outputs=outputs, **kwargs)

    def __call__(self, inputs, *args, **kwargs):
        return super().__call__(_with_padding_mask(inputs), *args, **kwargs)

    def _obj_type(self):
        """Keras' saver walks the task by its attributes, as it walked the earlier subclassed task: the weights
        of a `.keras` file stay under backbone/layers/transformer_xl/..., so that files written before load."""
        return "Layer"

    def quantize(self, mode=None, config=None, filters=None, **kwargs):
        """The backbone's `quantize` (its dense projections by default; see there)."""
        super().quantize(mode, config=config, filters=_projections if filters is None else filters, **kwargs)

    # ---- generation ---------------------------------------------------------------------------------------
    def _initial_state(self, batch_size, protocol=None):
        model, protocol = self.backbone.transformer_xl, protocol or self.backbone.protocol
        if model.supports_cache(protocol):
            return model.initial_cache(batch_size, protocol, max_len=self.backbone.segment_len)
        return model.initial_memory(batch_size, protocol)

    def call_with_cache(self, token_ids, cache, position_keys=(), padding_mask=None, memory_lengths=None):
        """(log-probs [B, L, V], hidden [B, L, d], new cache) of `token_ids` [B, L] after the state in `cache`
        (keras-hub's cache: see the module docstring); `memory_lengths` [B]: the positions each row's memory holds
        (None: all of it)."""
        hidden, state = self.backbone.call_with_state(token_ids, _from_hub(cache, position_keys), padding_mask,
                                                      memory_lengths=memory_lengths)
        cache, _ = _to_hub(state)
        return self.backbone.transformer_xl.log_probs(hidden), hidden, cache

    def _build_cache(self, token_ids, lengths, protocol=None):
        """Feeds each row's prompt (its first `lengths` tokens) in segments, as txl_tf's decoder does, under
        `protocol` (None: the backbone's; the ring's: `_ring_protocol`).

        Generation's memory starts empty (the authors' PyTorch convention): a row's first segments attend to the
        positions it has read, not to a zero memory's (`memory_lengths`), so the tokens after a prompt do not depend
        on the memory's length once it holds the whole text, and the ring that decodes them can be that short.

        Returns (hidden [B, T, d] of the prompt positions, zeros after; keras-hub's cache; the position keys).
        The cache holds the state's tensors, then each row's log-probs [B, V] and hidden [B, d] after its prompt
        and the prompt lengths [B]: the loop's `next` takes a row's prompt tokens from there instead of feeding
        them again. The segments run in a `tf.while_loop` on TensorFlow, a `keras.ops.while_loop` under jax.jit,
        and a Python loop where the lengths are numbers (PyTorch, JAX eagerly)."""
        segment, model = self.backbone.segment_len, self.backbone.transformer_xl
        batch, total = T.shape(token_ids)[0], T.shape(token_ids)[1]
        padded = T.pad(token_ids, [[0, 0], [0, segment]])
        protocol = protocol or self.backbone.protocol
        state, position_keys = _to_hub(self._initial_state(batch, protocol))
        hidden_states = T.zeros([total + segment, batch, model.d_model], self.compute_dtype)  # time first
        last_logits = T.zeros([batch, model.n_token], T.float32)
        last_hidden = T.zeros([batch, model.d_model], self.compute_dtype)
        longest = keras.ops.max(lengths)
        eager = not T.TENSORFLOW and T.concrete(longest)
        if eager:
            longest = int(keras.ops.convert_to_numpy(longest))
        elif model.encoding.absolute and not T.TENSORFLOW:  # a last segment of a traced width: refused by XLA
            raise ConfigError(f"generate with attn_type={model.attn_type!r} on {T.BACKEND} runs eagerly only; "
                              "compile(generate_jit_compile=False)")
        count = (longest + segment - 1) // segment

        def body(i, state, hidden_states, last_logits, last_hidden):
            # Segments as txl_tf's decoder cuts them. The absolute encodings' numbers depend on the window's length,
            # so their last segment is shorter; the relative ones give the same numbers for a padded segment,
            # whose static width XLA needs.
            start = i * segment
            width = T.minimum(segment, longest - start) if model.encoding.absolute else segment
            chunk = T.slice(padded, [0, start], [-1, width])
            used = T.clip_by_value(lengths - start, 0, width)  # [B] prompt tokens of each row in this chunk
            mask = T.cast(T.arange(width)[None, :] < used[:, None], T.int32)
            read = T.minimum(lengths, start)  # [B] positions of each row before this chunk: its memory's real ones
            hidden, new_state = self.backbone.call_with_state(chunk, _from_hub(state, position_keys), mask,
                                                              protocol=protocol, memory_lengths=read)
            state, _ = _to_hub(new_state)
            hidden = T.cast(hidden, hidden_states.dtype)
            if T.TENSORFLOW:
                hidden_states = tf.tensor_scatter_nd_update(hidden_states, (start + tf.range(width))[:, None],
                                                            tf.transpose(hidden, [1, 0, 2]))
            else:
                hidden_states = keras.ops.slice_update(hidden_states, [start, 0, 0], T.transpose(hidden, [1, 0, 2]))
            ends = (used > 0)[:, None]  # rows whose prompt goes on in this chunk: their last token so far
            last = T.batch_gather(hidden, T.maximum(used - 1, 0)[:, None], 1)[:, 0]  # [B, d]
            # Log-probabilities of the last position only: never [B, L, V] for a prompt segment.
            logits = T.cast(model.log_probs(last[:, None])[:, 0], T.float32)
            last_logits = T.where(ends, logits, last_logits)
            last_hidden = T.where(ends, last, last_hidden)
            # The loop's tensors keep their static shapes (a batch of 1 stays 1 through the gather).
            return (i + 1, *T.map_structure(lambda new, old: T.ensure_shape(new, old.shape),
                                            (state, hidden_states, last_logits, last_hidden), loop_vars[1:]))

        loop_vars = (0, state, hidden_states, last_logits, last_hidden)
        if eager:
            for i in range(count):
                loop_vars = body(i, *loop_vars[1:])
        elif T.TENSORFLOW:
            loop_vars = tf.while_loop(lambda i, *_: i < count, body, (tf.constant(0), *loop_vars[1:]))
        else:
            loop_vars = keras.ops.while_loop(lambda i, *_: i < count, body, (T.constant(0, T.int32), *loop_vars[1:]))
        _, state, hidden_states, last_logits, last_hidden = loop_vars
        cache = (*state, last_logits, last_hidden, lengths)
        return T.transpose(hidden_states[:total], [1, 0, 2]), cache, position_keys

    def _decodes_in_a_ring(self, compiled: bool = True) -> bool:
        """Whether the loop's tokens go through `RelativeMultiHeadAttention.decode_ring` (the encodings whose
        scores have position rows only: xl, shaw) rather than the cached call; `compiled`: as compile's
        `generate_ring` says (False: the default, whatever compile said)."""
        model = self.backbone.transformer_xl
        possible = (T.TENSORFLOW and model.encoding.position_keys_cached  # decode_ring's scatter: TensorFlow's
                    and model.supports_cache(self.backbone.protocol) and self.backbone.protocol.mem_len > 0)
        return possible and (not compiled or getattr(self, "generate_ring", None) is not False)

    def _generate_jit(self, compiled: bool = True) -> bool:
        """Whether generation runs under XLA: compile's `generate_jit_compile` (with `compiled`), by default for
        the relative encodings, whose prompt segments have a static width (measured faster on CPU,
        `scripts/benchmark_generate.py`)."""
        jit = getattr(self, "generate_jit_compile", None) if compiled else None
        return not self.backbone.transformer_xl.encoding.absolute if jit is None else bool(jit)

    def _ring_protocol(self, width):
        """The protocol a ring generation's prompt is read under, for a generation that ends at position `width`
        (an int: the traced width; else unknown): the backbone's, with a memory of min(mem_len, width) positions.
        The memory starts empty and the ring keeps the last min(mem_len, width) positions anyway, so the slots cut
        here are ones no position would fill: the same numbers, but a short prompt's segments no longer attend over
        a memory of mem_len masked slots (at mem_len 2,000 most of a short generation's time, issue 55)."""
        protocol = self.backbone.protocol
        if isinstance(width, int) and 0 < width < protocol.mem_len:
            return protocol.replace(mem_len=width)
        return protocol

    def _ring_loop(self, cache, position_keys, width=None):
        """(`next`, its cache) of the ring decoding step, from the prompt's cache (`_build_cache`); `width`: the
        positions the generation ends at (the token ids' width; None: unknown).

        The ring cache is (per layer keys [B, N, D, R + 1], per layer values, last log-probs, last hidden, prompt
        lengths), R = min(M, width) + 1, position p of each row in slot p mod R
        (`RelativeMultiHeadAttention.decode_ring`): each row's last R - 1 kept positions rolled there once, the free
        slot the one its first new token writes, and the scratch slot last. One tensor per layer: a step writes one
        slot of each and copies none. A slot no position has written yet is masked (the memory starts empty), so a
        generation of `width` positions needs no more than `width` slots: a short text reads a short ring.
        """
        ring_cache = self._to_ring(cache, width)
        return self._ring_next(position_keys, ring_cache), ring_cache

    def _to_ring(self, cache, width=None, blocks=False):
        """The ring cache (`_ring_loop`) of the prompt's cache, for a generation that ends at position `width`;
        `blocks`: the block loop's ring instead (`_block_decode`): S = M + 1 rounded up to a multiple of
        `DECODE_BLOCK` slots, position p in slot p mod S, no scratch slot."""
        model = self.backbone.transformer_xl
        keys, values, last_logits, last_hidden, lengths = cache
        memory = keys.shape[3]
        if width is not None:  # the last `width` positions are all a row will attend to
            kept = min(memory, width) if isinstance(width, int) else tf.minimum(memory, width)
            keys, values = keys[:, :, :, memory - kept:], values[:, :, :, memory - kept:]
            memory = kept
        ring = (memory + DECODE_BLOCK) // DECODE_BLOCK * DECODE_BLOCK if blocks else memory + 1
        # Row b keeps positions lengths[b] - M .. lengths[b] - 1 in order (those below 0 none: masked until
        # written): position p goes to slot p mod R, and the slots no kept position maps to read the zero slot M.
        order = tf.minimum(tf.math.floormod(tf.range(ring)[None, :] - (lengths[:, None] - memory), ring), memory)
        spare = tf.zeros_like(keys[:, 0, :, :1])  # [B, N, 1, D]

        def in_ring(x):  # [B, N, M, D] in order -> [B, N, D, R (+ 1)] by slot (then the scratch slot)
            by_slot = tf.gather(tf.concat([x, spare], axis=2), order, axis=2, batch_dims=1)
            if not blocks:
                by_slot = tf.concat([by_slot, spare], axis=2)
            return tf.transpose(by_slot, [0, 1, 3, 2])

        keys = tuple(in_ring(keys[:, i]) for i in range(model.n_layer))
        values = tuple(in_ring(values[:, i]) for i in range(model.n_layer))
        return keys, values, last_logits, last_hidden, lengths

    def _row_kernels(self, ring_cache):
        """(attention's, feed-forward's) kernels per layer for the ring's step at batch 1: each projection as two
        half-width products (`projection.dense_row`), arranged once before a loop; None: the layer's own call
        (also every layer where the ring has more than one row)."""
        blocks = self.backbone.transformer_xl.blocks
        one_row = ring_cache[0][0].shape[0] == 1
        return ([block.attention.row_kernels() if one_row else None for block in blocks],
                [block.feed_forward.row_kernels() if one_row else None for block in blocks])

    def _ring_next(self, position_keys, ring_cache, row_kernels=None):
        """The ring decoding step `next(prompt, ring cache, index)` for a ring cache of `ring_cache`'s shapes;
        `row_kernels`: `_row_kernels(ring_cache)` made earlier (a stream's, once for all its pieces; None: here)."""
        model = self.backbone.transformer_xl
        ring = T.dim(ring_cache[0][0], 3) - 1
        rows = tf.unstack(position_keys[:, :, -ring:])  # per layer [N, R, D]: distances R - 1 .. 0
        # A sampler may repeat the rows (beam search): the step checks that it gets one row.
        attention_rows, feed_forward_rows = row_kernels or self._row_kernels(ring_cache)

        def next(prompt, cache, index):
            keys, values, last_logits, last_hidden, lengths = cache
            token = tf.slice(prompt, [0, index - 1], [-1, 1])
            fresh = index - 1 >= lengths  # [B]: the token at index - 1 is not in the ring yet (not the prompt's)
            slot = tf.math.floormod(index - 1, ring)
            filled = tf.minimum(index, ring)  # slots 0 .. filled - 1 hold positions (with this step's token)
            h = model.embedding(token)  # [B, 1, d]
            one = h.shape[0] == 1
            new_keys, new_values = [], []
            for i, block in enumerate(model.blocks):
                u, v = model.encoding.layer_biases(model, i)
                h, layer_keys, layer_values = block.attention.decode_ring(
                    h, keys[i], values[i], slot, fresh, rows[i], u, v, row_kernels=attention_rows[i] if one else None,
                    filled=filled)
                if one and feed_forward_rows[i] is not None:
                    h = block.feed_forward.decode_row(h, feed_forward_rows[i])
                else:
                    h = block.feed_forward(h)
                new_keys.append(layer_keys)
                new_values.append(layer_values)
            logits = tf.cast(model.log_probs(h)[:, 0], tf.float32)
            logits = tf.where(fresh[:, None], logits, last_logits)
            hidden = tf.where(fresh[:, None], tf.cast(h[:, 0], last_hidden.dtype), last_hidden)
            return logits, hidden, (tuple(new_keys), tuple(new_values), last_logits, last_hidden, lengths)

        return next

    def generate_step(self, inputs, stop_token_ids=None, ring=None, sampler=None):
        """keras-hub's generation step; `ring`: decode in a ring of keys/values (None: `_decodes_in_a_ring()`):
        in blocks (`_block_decode`) for the samplers that draw a token a step (keras-hub's greedy, top-k, top-p,
        random and txl_tf's `Sampling`) over more than one row, one slot a token (`_ring_loop` in keras-hub's own
        loop) at batch 1 and for the samplers that reorder rows (beam, contrastive); `sampler`: a keras-hub sampler
        instead of compile()'s.

        At batch 1 a token's write is one row's N*D numbers and the block's extra work costs more than it saves: the
        loop alone took 0.37 against 0.31 ms a token at context 100 (200 new tokens) and the same at context 2,000;
        at batch 32, 7.96 against 9.15 ms at context 100 and 22.5 against 23.7 ms at 2,000 (4 x 192, memory
        2,000, XLA, 2-core AMD EPYC AVX2, 2026-11-29)."""
        token_ids, padding_mask = inputs["token_ids"], inputs["padding_mask"]
        padding_mask = T.cast(padding_mask, "bool")
        lengths = _row_lengths(padding_mask)  # prompts: right-padded
        sampler = sampler or self.sampler
        if self._decodes_in_a_ring() if ring is None else ring:
            width = T.dim(token_ids, 1)
            hidden_states, cache, position_keys = self._build_cache(token_ids, lengths, self._ring_protocol(width))
            if _draws_token_by_token(sampler) and token_ids.shape[0] != 1:
                ring_cache = self._to_ring(cache, width, blocks=True)
                index = tf.maximum(tf.reduce_min(lengths), 1)
                token_ids, _ = self._block_decode(token_ids, padding_mask, ring_cache, position_keys, index, width,
                                                  sampler, stop_token_ids)
                return _generated(token_ids, padding_mask, stop_token_ids)
            return self._finish(token_ids, padding_mask, stop_token_ids, hidden_states,
                                *self._ring_loop(cache, position_keys, width), sampler=sampler)

        hidden_states, cache, position_keys = self._build_cache(token_ids, lengths)
        return self._finish(token_ids, padding_mask, stop_token_ids, hidden_states, self._cached_next(position_keys),
                            cache, sampler=sampler)

    def _block_decode(self, token_ids, padding_mask, ring, position_keys, index, stop, sampler, stop_token_ids=None):
        """(token_ids with the tokens at index .. stop - 1 drawn by `sampler`, the ring after): keras-hub's sampler
        loop (its `compute_probabilities` and `get_next_token` a step, a prompt's own tokens kept, the loop ended
        once every row has made one of `stop_token_ids`), run in blocks of `DECODE_BLOCK` positions.

        The ring (`_to_ring(..., blocks=True)`: S slots, position p in slot p mod S, S - 1 >= M, the memory
        of min(mem_len, width) positions) is written once per block: the steps of the block cW .. cW + W - 1 read
        it and write their keys/values into a side buffer of W slots (`decode_block`), which goes into the ring's
        slots cW mod S .. + W - 1 (contiguous: S is a multiple of W) after the block's last step, for the rows
        whose token it is (a row still reading its prompt keeps the prompt's). A token attends to the positions
        at distances 0 .. M: in the ring those below its row's limit max(the call's first position, the row's
        prompt length), in the side buffer those from it on. A step's ring writes (one number per slot apart)
        took about a third of a batch-32 step at memory 2,000; a block's flush is one contiguous write (issue 55).
        Generation runs it over more than one row (`generate_step`), so a step takes the layers' own projections
        (not batch 1's `_row_kernels`). TensorFlow only, like the ring.
        """
        model = self.backbone.transformer_xl
        block = DECODE_BLOCK
        keys, values, last_logits, last_hidden, lengths = ring
        width = T.dim(token_ids, 1)
        memory = (min(self.backbone.protocol.mem_len, width) if isinstance(width, int)
                  else tf.minimum(self.backbone.protocol.mem_len, width))
        slots = T.dim(keys[0], 3)
        longest = max(slots, block) if isinstance(slots, int) else tf.maximum(slots, block)
        # Position keys of distances longest - 1 .. 0: the memory's M + 1, zeros beyond (their slots are masked).
        rows = position_keys[:, :, T.dim(position_keys, 2) - (memory + 1):]
        rows = tf.pad(rows, [[0, 0], [0, 0], [longest - (memory + 1), 0], [0, 0]])
        ring_rows = tf.unstack(rows[:, :, longest - slots:], num=model.n_layer)  # sliced once, not in a step
        side_rows = tf.unstack(rows[:, :, longest - block:], num=model.n_layer)
        blocked = tf.constant(float("-inf"))
        stops = None if stop_token_ids is None else tf.constant(list(stop_token_ids), token_ids.dtype)
        index, stop = tf.cast(index, tf.int32), tf.cast(stop, tf.int32)

        def going(prompt, i, end):
            if stops is None:
                return i < end
            made = tf.reduce_any(tf.equal(prompt[..., None], stops), axis=-1) & tf.logical_not(padding_mask)
            return (i < end) & tf.logical_not(tf.reduce_all(tf.reduce_any(made, axis=-1)))

        def run_block(prompt, keys, values, i):
            first = i - 1  # the block's first position in this call
            base = first // block * block
            end = tf.minimum(stop, base + block + 1)  # its steps write positions first .. base + W - 1
            limit = tf.maximum(first, lengths)[:, None]  # [B, 1]: the ring holds each row's positions below it
            sides = tuple(tf.zeros_like(keys[n][..., :block]) for n in range(model.n_layer))

            def step(prompt, side_keys, side_values, i):
                position = i - 1
                j = position - base
                fresh = position >= lengths  # [B]: the token at `position` is not the prompt's
                distance = tf.math.floormod(position - tf.range(slots), slots)  # [S]: of the position slot s holds
                held = position - distance
                ring_bias = tf.where((distance <= memory) & (held >= 0) & (held < limit), 0.0, blocked)  # [B, S]
                k = tf.range(block)
                side_bias = tf.where((k <= j) & (j - k <= memory) & (base + k >= limit), 0.0, blocked)  # [B, W]
                h = model.embedding(tf.slice(prompt, [0, position], [-1, 1]))  # [B, 1, d]
                side_keys, side_values = list(side_keys), list(side_values)
                for n, layer in enumerate(model.blocks):
                    u, v = model.encoding.layer_biases(model, n)
                    h, side_keys[n], side_values[n] = layer.attention.decode_block(
                        h, (keys[n], values[n]), (side_keys[n], side_values[n]), j, position, ring_bias, side_bias,
                        ring_rows[n], side_rows[n], u, v)
                    h = layer.feed_forward(h)
                logits = tf.where(fresh[:, None], tf.cast(model.log_probs(h)[:, 0], tf.float32), last_logits)
                token = tf.cast(sampler.get_next_token(sampler.compute_probabilities(logits)), prompt.dtype)
                token = tf.where(tf.gather(padding_mask, i, axis=1), tf.gather(prompt, i, axis=1), token)
                prompt = keras.ops.slice_update(prompt, [0, i], token[:, None])
                return prompt, tuple(side_keys), tuple(side_values), i + 1

            prompt, side_keys, side_values, after = tf.while_loop(
                lambda prompt, side_keys, side_values, i: going(prompt, i, end), step, (prompt, sides, sides, i))
            # Into the ring: the positions this block's steps wrote, of the rows whose tokens they are.
            written = ((base + tf.range(block) >= limit) & (base + tf.range(block) <= after - 2))[:, None, None, :]
            start = tf.math.floormod(base, slots)

            def flush(ring, side):  # sizes given: a size of -1 after a traced start is XLA's pad of the whole ring
                kept = tf.slice(ring, [0, 0, 0, start], tf.concat([tf.shape(ring)[:3], [block]], axis=0))
                return keras.ops.slice_update(ring, [0, 0, 0, start], tf.where(written, side, kept))

            keys = tuple(flush(ring, side) for ring, side in zip(keys, side_keys, strict=True))
            values = tuple(flush(ring, side) for ring, side in zip(values, side_values, strict=True))
            return prompt, keys, values, after

        token_ids, keys, values, _ = tf.while_loop(
            lambda prompt, keys, values, i: going(prompt, i, stop), run_block, (token_ids, keys, values, index))
        return token_ids, (keys, values, last_logits, last_hidden, lengths)

    def _cached_next(self, position_keys):
        """The decoding step `next(prompt, cache, index)` of the model's cached call (`call_with_cache`)."""

        def next(prompt, cache, index):
            *state, last_logits, last_hidden, lengths = cache
            token = T.slice(prompt, [0, index - 1], [-1, 1])
            fresh = index - 1 >= lengths  # [B]: the token at index - 1 is not in the state yet (not the prompt's)
            read = T.zeros_like(lengths) + (index - 1)  # [B] positions before it: its memory's real ones
            logits, hidden, state = self.call_with_cache(token, tuple(state), position_keys,
                                                         T.cast(fresh, T.int32)[:, None], memory_lengths=read)
            logits = T.where(fresh[:, None], T.cast(logits[:, 0], T.float32), last_logits)
            hidden = T.where(fresh[:, None], T.cast(hidden[:, 0], last_hidden.dtype), last_hidden)
            return logits, hidden, (*state, last_logits, last_hidden, lengths)

        return next

    def _finish(self, token_ids, padding_mask, stop_token_ids, hidden_states, next, cache, sampler=None):
        """The sampler's loop from `cache` with `next`, and the padding mask of what it generated."""
        ops = keras.ops
        lengths = _row_lengths(padding_mask)
        index = ops.maximum(ops.min(lengths), 1)
        sampler = sampler or self.sampler
        token_ids = sampler(next=next, prompt=token_ids, cache=cache, index=index, mask=padding_mask,
                            stop_token_ids=stop_token_ids, hidden_states=hidden_states, model=self)
        return _generated(token_ids, padding_mask, stop_token_ids)

    def generate(self, inputs, max_length=None, stop_token_ids="auto", strip_prompt=False, *, temperature=None,
                 top_k=None, top_p=None, seed=None):
        """keras-hub's `generate` (compile's sampler, every keras-hub sampler); with any of txl_tf's settings given,
        the sampling engine of `python -m txl_tf.generate` and the SavedModel instead (the same tokens for the same
        prompts, settings and seed).

        Args:
          inputs: text (a str or a list of str; token ids when the model has no preprocessor), or a dataset.
          max_length: tokens per row in all, the prompt's included (None: the preprocessor's sequence_length).
          stop_token_ids, strip_prompt: keras-hub's (a stream language model has no end token: "auto" is none).
          temperature: >= 0; 0 is greedy, 1 the model's distribution (1 when another setting is given).
          top_k: sample among the k likeliest tokens (0: all). top_p: nucleus sampling, in (0, 1] (1: off).
          seed: the sampling seed, in [0, 2**31) (None: a random one). `python -m txl_tf.generate` with the same
            prompts, settings, `--seed` and `--max_tokens` = max_length - (the shortest prompt's tokens) prints the
            same text (each row there runs to that count).
        """
        if max_length is not None:  # keras-hub takes 0 for "not given": the preprocessor's sequence_length
            max_length = _length(max_length, "generate's max_length")
        if any(setting is not None for setting in (temperature, top_k, top_p, seed)):
            if not (stop_token_ids is None or isinstance(stop_token_ids, str) and stop_token_ids == "auto"):
                raise ConfigError("generate's stop_token_ids go with compile's sampler, not with temperature, top_k, "
                                  "top_p or seed; drop one of them")
            return self._generate_with_settings(
                inputs, max_length, strip_prompt, temperature=1.0 if temperature is None else temperature,
                top_k=0 if top_k is None else top_k, top_p=1.0 if top_p is None else top_p,
                seed=random.SystemRandom().randrange(2**31) if seed is None else seed)
        self._check_generation(inputs, max_length)
        if isinstance(stop_token_ids, str) and stop_token_ids == "auto":
            tokenizer = self.preprocessor.tokenizer if self.preprocessor is not None else None
            end = getattr(tokenizer, "end_token_id", None)
            stop_token_ids = None if end is None else [end]  # a stream LM has no end-of-text token
        return super().generate(inputs, max_length=max_length, stop_token_ids=stop_token_ids,
                                strip_prompt=strip_prompt)

    def _check_generation(self, inputs, max_length) -> None:
        """generate's prompts and lengths, before keras-hub makes any tensor of them: text of the vocabulary (or
        token ids without a preprocessor), and the positions of each row (max_length, else the preprocessor's
        sequence_length), the number of prompts and the sampler's beams against the memory this process can
        allocate (`configs.check_generation_size`); a sampler's top-k at most the vocabulary."""
        model, sampler = self.backbone.transformer_xl, self.sampler
        k = getattr(sampler, "k", None)
        if isinstance(k, numbers.Integral) and not isinstance(k, bool) and not 1 <= k <= model.n_token:
            raise ConfigError(f"{type(sampler).__name__}(k={k}) must keep between 1 and the vocabulary's "
                              f"{model.n_token} tokens; compile with a sampler of a k in that range")
        beams = getattr(sampler, "num_beams", 1)
        if isinstance(beams, bool) or not isinstance(beams, numbers.Integral) or beams < 1:
            raise ConfigError(f"{type(sampler).__name__}(num_beams={str(beams)[:40]}) must be a whole number >= 1; "
                              "compile with another sampler")
        rows, width = _prompt_rows(inputs, self.preprocessor)
        if rows is None:  # a tf.data.Dataset: keras-hub generates batch by batch
            return
        name = "generate's max_length"
        if max_length is None and self.preprocessor is not None:
            max_length, name = self.preprocessor.sequence_length, "the preprocessor's sequence_length"
        check_generation_size(model, batch_size=rows, length=max_length or width, segment_len=self.backbone.segment_len,
                              mem_len=self.backbone.protocol.mem_len, beams=int(beams), name=name,
                              batch_name="the number of prompts", beams_name=f"{type(sampler).__name__}'s num_beams")

    # ---- fit(), evaluate() and score() -------------------------------------------------------------------
    def compile(self, optimizer="auto", loss="auto", *, metrics=None, weighted_metrics=None, sampler="top_k",
                generate_jit_compile=None, generate_ring=None, **kwargs):
        """keras-hub's compile. loss "auto": the adaptive softmax's negative log-likelihood (nats), computed without
        [B, L, V] logits; any other Keras loss is applied to the log-probabilities as logits (keras-hub's
        `from_logits=True` losses give the same numbers), as are `metrics` and `weighted_metrics` (none by default:
        a metric on logits makes them).

        generate_jit_compile: XLA for `generate` (None: on for the relative encodings, whose prompt segments have
        a static width; measured faster on CPU, `scripts/benchmark_generate.py`). `jit_compile` is fit's, as in
        Keras.
        generate_ring: each new token writes one slot of a ring of keys/values instead of moving the memory's
        (`RelativeMultiHeadAttention.decode_ring`; None: for the encodings it serves, xl and shaw; the same tokens).
        """
        self.generate_jit_compile = generate_jit_compile
        self.generate_ring = generate_ring
        object.__setattr__(self, "_txl_tf_own_loss", isinstance(loss, str) and loss == "auto")
        super().compile(optimizer=optimizer, loss=loss, metrics=metrics, weighted_metrics=weighted_metrics,
                        sampler=sampler, **kwargs)
        if metrics is None and weighted_metrics is None:
            self._compile_metrics = None  # Keras keeps an earlier compile's metrics otherwise
        self.train_function = self.test_function = None  # traced with the earlier loss and metrics
        _check_learning_rate(self.optimizer)

    def make_generate_function(self):
        if self.generate_function is not None or self.run_eagerly:
            return super().make_generate_function()
        if not T.TENSORFLOW:  # keras-hub's: jax.jit of a stateless step, PyTorch eagerly; jax eagerly if not jit
            if T.BACKEND == "jax" and not self._generate_jit():
                self.generate_function = self.generate_step
                return self.generate_function
            return super().make_generate_function()
        jit = self._generate_jit()
        # The choices of this compile() are fixed now: the function traces at its first call.
        ring = self._decodes_in_a_ring()

        def step(*args, **kwargs):  # traced at the first call; under XLA without the Assert ops it would drop
            with without_runtime_asserts() if jit else contextlib.nullcontext():
                return self.generate_step(*args, ring=ring, **kwargs)

        self.generate_function = tf.function(step, jit_compile=bool(jit))
        return self.generate_function

    def preprocess_samples(self, x, y=None, sample_weight=None):
        """Text goes through the preprocessor; token ids pass as they are (a dict of token_ids and padding_mask),
        token ids [B, T] alone as texts without padding."""
        if self.preprocessor is not None and _is_text(x):
            return super().preprocess_samples(x, y, sample_weight)
        return keras.utils.pack_x_y_sample_weight(_with_padding_mask(x), y, sample_weight)

    def fit(self, x=None, y=None, *, epochs=1, callbacks=None, validation_data=None, **kwargs):
        """keras-hub's fit, on texts or on a stream-ordered corpus.

        Texts (a list of str, a `tf.data.Dataset` of str, or the preprocessor's output: {"token_ids",
        "padding_mask"} with targets and sample weights): each row is a text of its own. It is cut into segments
        of `backbone.segment_len` tokens read in order, the memory (the model's training mem_len) carried from one
        segment to the next and starting from zeros for each text; no memory passes between texts, and padding
        never enters it. The preprocessor's `sequence_length` is the tokens of a text trained on.

        A stream-ordered corpus: a `tf.data.Dataset` yielding (tokens [B, L], targets [B, L][, sample_weight])
        (tokens without a padding_mask) with row i of each batch continuing row i of the batch before, as
        `txl_tf.data.pipeline.make_dataset` gives them, every batch of the same B rows. The memory ([n_layer, B,
        mem_len, d_model]) lives in the model between steps and starts from zeros at each epoch (the TF
        original's first segment). The custom trainer (`python -m txl_tf.train`: tf.distribute, exact resume,
        the fused kernels) stays the path for long runs; it trains the same `TransformerXL`.

        The loss (compile's "auto") is the mean negative log-likelihood (nats) of the adaptive softmax.
        """
        _check_learning_rate(self.optimizer)  # a NaN rate would turn every weight into NaN without a word
        if not _is_stream(x):
            return super().fit(x, y, epochs=epochs, callbacks=callbacks, validation_data=validation_data,
                               **kwargs)
        rows = _stream_rows(x, "fit")
        if self._recurrence.reset("train", rows, self.backbone.transformer_xl):
            self.train_function = None
        if validation_data is not None and self._recurrence.reset(
                "test", _stream_rows(validation_data, "fit's validation_data"), self.backbone.transformer_xl):
            self.test_function = None
        n_token = self.backbone.transformer_xl.n_token
        x = _checked_ids(x, n_token)
        if validation_data is not None:
            validation_data = _checked_ids(validation_data, n_token)
        callbacks = [*(callbacks or []), _ResetMemory(self._recurrence)]
        kwargs.setdefault("shuffle", False)  # the stream's order is the point
        # keras.Model's fit: the batches are token ids already, checked in range on the host.
        with _ids_in_range("fit", n_token):
            return keras.Model.fit(self, x, y, epochs=epochs, callbacks=callbacks, validation_data=validation_data,
                                   **kwargs)

    def evaluate(self, x=None, y=None, **kwargs):
        """The loss (and compiled metrics) of texts or of a stream-ordered dataset, as `fit` takes them; a
        stream's memory is carried from batch to batch from zeros."""
        if kwargs.get("_use_cached_eval_dataset"):  # fit's validation: set up by fit, zeroed by _ResetMemory
            return keras.Model.evaluate(self, x, y, **kwargs)
        if not _is_stream(x):
            return super().evaluate(x, y, **kwargs)
        n_token = self.backbone.transformer_xl.n_token
        if self._recurrence.reset("test", _stream_rows(x, "evaluate"), self.backbone.transformer_xl):
            self.test_function = None
        with _ids_in_range("evaluate", n_token):
            return keras.Model.evaluate(self, _checked_ids(x, n_token), y, **kwargs)

    @property
    def _recurrence(self):
        holder = self.__dict__.get("_recurrence_holder")
        if holder is None:  # outside Keras's tracking: the memory is no weight of the model
            holder = _Recurrence()
            object.__setattr__(self, "_recurrence_holder", holder)
        return holder

    def _text_hidden(self, token_ids, padding_mask, protocol, training):
        """Hidden states [B, T, d] of texts (one a row, right-padded) read in segments of `segment_len` with the
        memory carried from zeros: the text's own recurrence, no state from any other row or batch."""
        model, segment = self.backbone.transformer_xl, self.backbone.segment_len
        total = token_ids.shape[1]
        if total is None:
            raise ConfigError("fit/evaluate/score on texts: the batches' sequence length is unknown; pad them to a "
                              "fixed length (the preprocessor's sequence_length does)")
        lengths = _row_lengths(padding_mask)
        state, hidden = model.initial_memory(T.shape(token_ids)[0], protocol), []
        for start in range(0, total, segment):
            width = min(segment, total - start)
            used = T.clip_by_value(lengths - start, 0, width)  # each row's tokens in this segment
            out, state = model(token_ids[:, start:start + width], state, protocol=protocol, lengths=used,
                               training=training)
            hidden.append(out)
        return T.concat(hidden, axis=1)

    def _loss_and_state(self, data, training):
        """(loss, y, y_pred or None, sample_weight, the stream's new memory and its variable, or None) of a batch."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        model = self.backbone.transformer_xl
        if isinstance(x, dict) and "padding_mask" in x:  # texts
            if y is None:
                raise ConfigError("fit/evaluate on token ids: give the targets y (the preprocessor gives them)")
            hidden = self._text_hidden(x["token_ids"], x["padding_mask"], model.protocol, training)
            carried = None
        else:  # a stream-ordered corpus
            if not T.TENSORFLOW:
                raise ConfigError(f"fit/evaluate on a stream-ordered corpus (token ids without a padding_mask) runs "
                                  f"on TensorFlow only (the memory between batches is a tf.Variable), not "
                                  f"{T.BACKEND}; give texts (the preprocessor's token_ids and padding_mask)")
            tokens = x["token_ids"] if isinstance(x, dict) else x
            memory = self._recurrence.memory("train" if training else "test")
            hidden, state = self.backbone.call_with_state(tokens, Memory(memory.value()), protocol=model.protocol,
                                                          training=training)
            carried = (state.hidden, memory)
        y_pred = None
        if self._own_loss:
            nll = model.nll(hidden, y)  # [B, L] float32
            weights = keras.ops.ones_like(nll) if sample_weight is None else T.cast(sample_weight, T.float32)
            loss = keras.ops.sum(nll * weights) / keras.ops.maximum(keras.ops.sum(weights), 1.0)
        else:  # compile's loss on the log-probabilities as logits, as keras-hub's CausalLM
            y_pred = model.log_probs(hidden)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training)
        if y_pred is None and self._compile_metrics is not None:
            y_pred = model.log_probs(hidden)  # only for metrics asked for
        return loss, (x, y, y_pred, sample_weight), carried

    @property
    def _own_loss(self) -> bool:
        """Whether the loss is compile's "auto" (the adaptive softmax's NLL without logits)."""
        return self.__dict__.get("_txl_tf_own_loss", True)

    def _results(self, loss, batch, carried):
        x, y, y_pred, sample_weight = batch
        if carried is not None:
            carried[1].assign(carried[0])
        self._loss_tracker.update_state(loss, sample_weight=T.shape(y)[0])
        if y_pred is not None:
            return self.compute_metrics(x, y, y_pred, sample_weight)
        return self.get_metrics_result()

    # The loss of a batch is `_loss_and_state`'s on every backend (texts read in segments with the memory carried,
    # the adaptive softmax's NLL without [B, L, V] logits); each backend's trainer calls it its own way.
    def train_step(self, *args):
        if T.BACKEND == "jax":  # stateless: Keras's step around `compute_loss_and_updates` below
            return super().train_step(*args)
        (data,) = args
        if T.BACKEND == "torch":
            loss, batch, carried = self._loss_and_state(data, training=True)
            self.zero_grad()
            self.optimizer.scale_loss(loss).backward()
            weights = self.trainable_weights[:]
            import torch

            with torch.no_grad():
                self.optimizer.apply([weight.value.grad for weight in weights], weights)
            return self._results(loss, batch, carried)
        with tf.GradientTape() as tape:
            loss, batch, carried = self._loss_and_state(data, training=True)
            scaled = self.optimizer.scale_loss(loss)
        gradients = tape.gradient(scaled, self.trainable_weights)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_weights, strict=True))
        return self._results(loss, batch, carried)

    def test_step(self, *args):
        if T.BACKEND == "jax":
            return super().test_step(*args)
        loss, batch, carried = self._loss_and_state(args[0], training=False)
        return self._results(loss, batch, carried)

    def compute_loss_and_updates(self, trainable_variables, non_trainable_variables, metrics_variables, x, y,
                                 sample_weight, training=False, optimizer_variables=None):
        """JAX's stateless loss (Keras's JAX trainer differentiates it): `_loss_and_state` with the given values
        of the variables; returns (the scaled loss, (the loss, the log-probabilities or None, the new
        non-trainable values, the metrics' values))."""
        mapping = [*zip(self.trainable_variables, trainable_variables, strict=True),
                   *zip(self.non_trainable_variables, non_trainable_variables, strict=True)]
        with keras.StatelessScope(state_mapping=mapping) as scope:
            loss, (_, _, y_pred, _), _ = self._loss_and_state((x, y, sample_weight), training)
        updated = [scope.get_current_value(variable) for variable in self.non_trainable_variables]
        non_trainable_variables = [value if new is None else new
                                   for new, value in zip(updated, non_trainable_variables, strict=True)]
        unscaled = loss
        if training and self.optimizer is not None:
            with keras.StatelessScope(state_mapping=list(zip(self.optimizer.variables, optimizer_variables,
                                                             strict=True))):
                loss = self.optimizer.scale_loss(loss)
        return loss, (unscaled, y_pred, non_trainable_variables, metrics_variables)

    def score(self, token_ids, padding_mask=None, scoring_mode="logits", layer_intercept_fn=None, target_ids=None):
        """keras-hub's `score`: per-token log-probabilities [B, T, V] ("logits": a softmax of them is the model's
        distribution) or per-token losses [B, T] ("loss": the negative log-likelihood of `target_ids`, nats).

        Each row is a text of its own, read in segments of `backbone.segment_len` with the memory carried (the
        protocol of generation, `backbone.protocol`), as `fit` reads texts. `layer_intercept_fn` is not offered:
        the layers run inside `txl_tf.TransformerXL`.
        """
        if scoring_mode not in ("logits", "loss"):
            raise ConfigError(f"score: scoring_mode={scoring_mode!r}; use 'logits' or 'loss'")
        if scoring_mode == "loss" and target_ids is None:
            raise ConfigError("score: scoring_mode='loss' needs target_ids (the token that follows each position)")
        if layer_intercept_fn is not None:
            raise ConfigError("score: layer_intercept_fn is not offered (the layers run inside txl_tf's "
                              "TransformerXL); call score without it")
        token_ids = tf.convert_to_tensor(token_ids, tf.int32)
        padding_mask = tf.ones_like(token_ids) if padding_mask is None else tf.cast(padding_mask, tf.int32)
        model = self.backbone.transformer_xl
        hidden = self._text_hidden(token_ids, padding_mask, self.backbone.protocol, training=False)
        if scoring_mode == "logits":
            return model.log_probs(hidden)
        return model.nll(hidden, tf.convert_to_tensor(target_ids, tf.int32))


    # ---- text with the evaluation protocol, settings, the parts ---------------------------------------------
    @property
    def transformer_xl(self) -> TransformerXL:
        """The `txl_tf.TransformerXL` layer the backbone runs (the weights)."""
        return self.backbone.transformer_xl

    @property
    def model_config(self) -> ModelConfig:
        """The architecture (`txl_tf.configs.ModelConfig`), as a preset's config.json holds it."""
        return self.backbone.model_config

    @property
    def eval_config(self) -> EvalConfig:
        """The evaluation protocol that travels with the model (`EvalConfig`: segment, memory and clamp lengths,
        same_length, the state form, the vanilla window)."""
        return self.backbone.eval_config

    @property
    def eval_protocol(self) -> Protocol:
        """The attention lengths of `score_text` and `stream_text` (`EvalConfig.attention_protocol()`, same_length
        as evaluation has it); generation and keras-hub's `score` use `backbone.protocol` (no same_length)."""
        return self.eval_config.attention_protocol()

    @property
    def vocab(self) -> Vocab:
        """The vocabulary (`txl_tf.data.vocab.Vocab`) of the preprocessor's tokenizer."""
        tokenizer = getattr(self.preprocessor, "tokenizer", None)
        if not isinstance(tokenizer, TransformerXLTokenizer) or tokenizer._graph is None:
            raise ConfigError("this model has no vocabulary (no preprocessor with a TransformerXLTokenizer); load it "
                              "with from_preset, or build it with a TransformerXLCausalLMPreprocessor")
        return tokenizer.vocab

    def encode(self, text: str, what: str = "text") -> np.ndarray:
        """Text (a str) -> int32 token ids [T] of the vocabulary; a symbol outside it is a one-line ConfigError,
        anything but a str (bytes too) a one-line TypeError."""
        check_text(text, f"the {what}")
        vocab = self.vocab
        try:
            return vocab.encode_array(text)
        except (KeyError, ValueError) as error:
            raise ConfigError(f"the {what} {short_text(text)} has a symbol outside the {vocab.level}-level "
                              f"vocabulary ({one_line(error).strip(chr(34))}); change the {what}") from None

    def scorer(self) -> Recurrent:
        """The model bound to the evaluation protocol and state form (EvalConfig.kv_cache), kept outside Keras's
        tracking (it holds no weights of its own)."""
        made = self.__dict__.get("_txl_tf_scorer")
        if made is None:
            made = Recurrent(self.transformer_xl, self.eval_protocol, max_len=self.eval_config.tgt_len,
                             use_cache=self.eval_config.kv_cache)
            object.__setattr__(self, "_txl_tf_scorer", made)
        return made

    def score_text(self, texts: str | Sequence[str]) -> ScoreResult | list[ScoreResult]:
        """Scores each text as one stream with the model's evaluation protocol (`eval_protocol`, the figures of
        `python -m txl_tf.evaluate`); a `ScoreResult` for a str, a list of them for a list.

        Every token after the first is scored in segments of EvalConfig.tgt_len from a zero memory, the state
        carried across segments (same_length and the state form as evaluation has them); the texts of a list are
        the rows of one batch. With EvalConfig.protocol "vanilla" each prediction sees a window of tgt_len tokens
        instead (txl_tf.evaluation.loops.evaluate_vanilla). keras-hub's `score` takes token ids and the generation
        protocol instead.
        """
        single, texts = as_texts(texts, "texts")
        if not texts:
            raise ConfigError("score_text() needs at least one text; got an empty list")
        rows = [self.encode(text) for text in texts]
        for text, row in zip(texts, rows, strict=True):
            if row.size < 2:
                raise ConfigError(f"the text {short_text(text)} encodes to {row.size} token(s); scoring needs at "
                                  "least 2 (the first is context only)")
        if self.eval_config.protocol == "vanilla":
            log_probs = [-self._vanilla_nll(row) for row in rows]
        else:
            check_inference_size(self.transformer_xl, batch_size=len(rows), tgt_len=self.eval_config.tgt_len,
                                 mem_len=self.eval_config.mem_len)
            log_probs = [-nll for nll in self._stream_nll(rows)]
        results = [ScoreResult(values, self.vocab.level) for values in log_probs]
        return results[0] if single else results

    def stream_text(self) -> ScoreStream:
        """A `ScoreStream`: `stream.score(piece)` scores text piece by piece with the evaluation protocol, keeping
        the state in between (the pieces' log-probabilities are those of `score_text` of their concatenation)."""
        return ScoreStream(self)

    def _stream_nll(self, rows: list[np.ndarray]) -> list[np.ndarray]:
        """[T_b - 1] NLL of each row, the rows right-padded into one batch (a row's padding comes after all its
        tokens, so causal attention keeps it out of their scores)."""
        lengths = [row.size for row in rows]
        tokens = np.zeros([len(rows), max(lengths)], np.int32)
        for index, row in enumerate(rows):
            tokens[index, :row.size] = row
        scorer = self.scorer()
        outputs, _ = run_segments(scorer.score, scorer.initial_state(len(rows)), tokens[:, :-1],
                                  self.eval_config.tgt_len, targets=tokens[:, 1:])
        nll = keras.ops.convert_to_numpy(keras.ops.concatenate(outputs, axis=1))
        return [nll[index, :length - 1] for index, length in enumerate(lengths)]

    def _vanilla_nll(self, row: np.ndarray) -> np.ndarray:
        window = self.eval_config.tgt_len
        if row.size <= window:
            raise ConfigError(f"a text of {row.size} tokens is too short for the vanilla window of {window} "
                              "(EvalConfig.tgt_len); give a longer text")
        result = evaluate_vanilla(self.transformer_xl, row, window=window, batch_size=self.eval_config.batch_size,
                                  clamp_len=self.eval_config.clamp_len, return_token_losses=True)
        return result.token_losses

    def _sampling_generator(self) -> Generator:
        """The `txl_tf.lm.sampling.Generator` of this task (what the command line and the SavedModel run), made once
        and kept outside Keras's tracking: its settings and random state are no weights of the model."""
        made = self.__dict__.get("_txl_tf_generator")
        if made is None:
            made = Generator(self)
            object.__setattr__(self, "_txl_tf_generator", made)
        return made

    def _sampling_request(self, what, inputs, max_length, *, temperature, top_k, top_p, seed):
        """The checked request of `generate` with settings or of `stream_generate` (`what`): (one text?, the texts,
        their ids, their lengths, max_length, the new tokens of the longest continuation); one-line ConfigErrors."""
        if not T.TENSORFLOW:  # txl_tf.lm.sampling's engine: TensorFlow's graph and random ops (the CLI's tokens)
            raise ConfigError(f"{what}(temperature=..., top_k=..., top_p=..., seed=...) runs on TensorFlow only, not "
                              f"{T.BACKEND}; compile(sampler=keras_hub.samplers.TopPSampler(p=..., temperature=...)) "
                              "(or TopKSampler) and call generate without them")
        if self.preprocessor is None:
            raise ConfigError(f"{what}(temperature=..., top_k=..., top_p=..., seed=...) takes text: this model has no "
                              "preprocessor; compile(sampler=...) and generate token ids, or load it with from_preset")
        rows, _ = _prompt_rows(inputs, self.preprocessor)  # keras-hub's path's checks of the text, its messages
        if rows is None:
            raise ConfigError(f"{what}(temperature=..., top_k=..., top_p=..., seed=...) takes a str or a list of str, "
                              "not a dataset; compile(sampler=...) and generate the dataset without them")
        if tf.is_tensor(inputs) or isinstance(inputs, np.ndarray):
            inputs = [text.decode("utf-8") if isinstance(text, bytes) else str(text)
                      for text in np.asarray(inputs).reshape([-1]).tolist()]
        single, texts = as_texts(inputs, f"{what}'s inputs")
        for name, value, kind in (("temperature", temperature, numbers.Real), ("top_k", top_k, numbers.Integral),
                                  ("top_p", top_p, numbers.Real)):
            if isinstance(value, bool) or not isinstance(value, kind):
                raise ConfigError(f"{what}'s {name}={str(value)[:40]!r} must be a "
                                  f"{'whole number' if kind is numbers.Integral else 'number'}")
        vocab = self.vocab
        ids = check_settings(vocab, texts, max_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p)
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2**31:
            raise ConfigError(f"{what}'s seed={str(seed)[:40]!r} must be a whole number in [0, 2**31) (None: a "
                              "random one)")
        lengths = [len(row) for row in ids]
        name = f"{what}'s max_length"
        if max_length is None:
            max_length, name = self.preprocessor.sequence_length, "the preprocessor's sequence_length"
        if max_length <= max(lengths):
            raise ConfigError(f"{name}={max_length} must be above the longest prompt's {max(lengths)} tokens (it "
                              "counts the prompt and the new tokens); raise it")
        new = max_length - min(lengths)  # every row runs to the longest continuation, then is cut to max_length
        check_generation_size(self.transformer_xl, batch_size=len(ids), length=max(lengths) + new, given=max_length,
                              name=name, batch_name="the number of prompts", segment_len=self.backbone.segment_len,
                              mem_len=self.backbone.protocol.mem_len)
        return single, texts, ids, lengths, max_length, new

    def _generate_with_settings(self, inputs, max_length, strip_prompt, *, temperature, top_k, top_p, seed):
        """`generate` with txl_tf's settings: the sampling `Generator` (see `generate`)."""
        single, texts, ids, lengths, max_length, new = self._sampling_request(
            "generate", inputs, max_length, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        vocab = self.vocab
        result = generate_with(self._sampling_generator().generate, ids, max_tokens=new, temperature=temperature,
                               top_k=top_k, top_p=top_p, seed=int(seed))
        outputs = []
        for text, row, length in zip(texts, result.tokens, lengths, strict=True):
            continuation = vocab.decode(row[:max_length - length].tolist())
            outputs.append(continuation if strip_prompt else with_prompt(vocab, text, continuation))
        return outputs[0] if single else outputs

    def stream_generate(self, prompt, max_length=None, *, temperature=1.0, top_k=0, top_p=1.0, seed=None,
                        chunk=None):
        """Yields the text `generate(prompt, max_length, temperature=..., top_k=..., top_p=..., seed=...)` returns,
        piece by piece as it is made: first the prompt, then the new tokens a piece at a time. Joined, the pieces
        are `generate`'s text for the same settings and seed.

        Each piece is one call of a compiled loop that keeps the decoding state between calls
        (`txl_tf.lm.sampling.Generator.stream`): the prompt is read once, and a piece costs its tokens' steps and
        one call, where a call per token would pay the call's fixed cost for every token. `python -m
        txl_tf.generate --stream` prints this way. `chunk`: new tokens per piece, 1 to 4,096 (the last piece may
        be shorter); None (the default): pieces sized by time, the first of one token, then about 25 ms each."""
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, numbers.Integral)
                                  or not 1 <= chunk <= 4096):
            raise ConfigError(f"stream_generate's chunk={str(chunk)[:40]} must be None (pieces sized by time) or a "
                              "whole number from 1 to 4096 (new tokens per piece)")
        if not isinstance(prompt, str):
            raise ConfigError(f"stream_generate takes one prompt, a str; got {type(prompt).__name__} (generate "
                              "takes lists)")
        seed = random.SystemRandom().randrange(2**31) if seed is None else seed
        _, texts, ids, lengths, max_length, new = self._sampling_request(
            "stream_generate", prompt, max_length, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        tokens = self._sampling_generator().stream(ids[0], max_tokens=new, chunk=None if chunk is None else int(chunk),
                                                   temperature=temperature, top_k=top_k, top_p=top_p, seed=int(seed))
        return text_pieces(self.vocab, prompt, tokens)  # checked now, made as the caller reads

    # ---- presets -------------------------------------------------------------------------------------------
    @classmethod
    def from_preset(cls, preset, load_weights=True, **kwargs):
        """A keras-hub preset of this model, or anything `txl_tf.lm.presets.load` loads (run folders, best/,
        averaged/, converted authors' checkpoints, presets of txl_tf's earlier format; its keyword arguments
        `which`, `gin_file`, `gin_param`, `dtype` pass on). A local path that holds no keras-hub preset goes to
        `presets.load`, which says in one line what it found there; a kaggle:// or hf:// handle to keras-hub."""
        sequence_length = kwargs.pop("sequence_length", None)
        if isinstance(preset, os.PathLike):
            preset = os.fspath(preset)
        if isinstance(preset, str) and "://" not in preset and not _is_hub_preset(preset):  # not keras-hub's
            return cls.from_txl(preset, **({} if sequence_length is None else {"sequence_length": sequence_length}),
                                **kwargs)
        given = [name for name in ("which", "gin_file", "gin_param") if kwargs.get(name)]
        if given:
            raise ConfigError(f"{preset} is a keras-hub preset: it takes no {', '.join(given)} (arguments of a run "
                              "or converted folder; a preset holds its configs); drop them")
        for name in ("which", "gin_file", "gin_param"):
            kwargs.pop(name, None)
        _check_local(preset, load_weights=load_weights)
        lm = super().from_preset(preset, load_weights=load_weights, **kwargs)
        if sequence_length is not None:  # as for a run folder: the preprocessor's, checked as its constructor does
            if lm.preprocessor is None:
                raise ConfigError(f"from_preset's sequence_length={sequence_length!r}: {preset} has no "
                                  "preprocessor to take it; drop it and give generate a max_length")
            length = _length(sequence_length, "from_preset's sequence_length")
            check_generation_size(lm.backbone.transformer_xl, batch_size=1, length=length,
                                  segment_len=lm.backbone.segment_len, mem_len=lm.backbone.protocol.mem_len,
                                  name="from_preset's sequence_length")
            lm.preprocessor.sequence_length = length
        return lm

    @classmethod
    def from_txl(cls, path, *, sequence_length=256, **kwargs):
        """The keras-hub model of what `txl_tf.lm.presets.load(path, **kwargs)` loads."""
        from txl_tf.lm import presets

        loaded = presets.load(path, **kwargs)
        return cls.from_parts(loaded.model, loaded.model_config, loaded.eval_config, loaded.vocab,
                              sequence_length=sequence_length)

    @classmethod
    def from_parts(cls, model, model_config, eval_config, vocab, *, sequence_length=256):
        """The keras-hub model of a built `TransformerXL` (its weights copied), its configs and its vocabulary."""
        model_config = dataclasses.replace(model_config, n_token=model.n_token)
        backbone = TransformerXLBackbone(model_config, eval_config, dtype=model.dtype_policy.name)
        backbone.transformer_xl.set_weights(model.get_weights())
        tokenizer = TransformerXLTokenizer(vocab)
        preprocessor = TransformerXLCausalLMPreprocessor(tokenizer, sequence_length=sequence_length)
        return cls(backbone, preprocessor)

    @classmethod
    def around(cls, model, eval_config, vocab=None, *, sequence_length=256):
        """The task around a built `TransformerXL` (its weights, not a copy: the engine of the trainer's samples,
        the command line and the SavedModel), with `vocab`'s preprocessor when given. To save a preset, load or
        build with `from_parts`, whose weights are its own."""
        preprocessor = None
        if vocab is not None:
            preprocessor = TransformerXLCausalLMPreprocessor(TransformerXLTokenizer(vocab),
                                                             sequence_length=sequence_length)
        return cls(TransformerXLBackbone(None, eval_config, transformer_xl=model), preprocessor)

    def save_to_preset(self, preset_dir, max_shard_size=10, *, overwrite=False):
        """Writes a keras-hub preset (config.json, task.json, preprocessor.json, tokenizer.json, the weights and
        assets/tokenizer/vocab.json) into `preset_dir`: a new or empty folder, or, with `overwrite=True`, a preset
        txl_tf wrote (its manifest lists every file); a folder holding anything else is never replaced. Written
        whole beside the target, then renamed into place (`txl_tf.base.staging`)."""
        def save(tmp):
            self.backbone.__dict__["_txl_tf_in_task_save"] = True  # the backbone writes into `tmp` as it is
            try:
                super(TransformerXLCausalLM, self).save_to_preset(tmp, max_shard_size=max_shard_size)
            finally:
                del self.backbone.__dict__["_txl_tf_in_task_save"]
            tokenizer = getattr(self.preprocessor, "tokenizer", None)
            if isinstance(tokenizer, TransformerXLTokenizer) and tokenizer._graph is not None:
                hub_files.record_vocabulary(tmp, tokenizer.vocab)  # checked against the model on every load

        return _staged_save(preset_dir, overwrite, save)


class _Recurrence:
    """The memories `fit` (train) and `evaluate` (test) carry between batches: tf.Variables outside the model's
    weights, made for the dataset's number of rows."""

    def __init__(self):
        self.variables = {}

    def reset(self, phase, rows, model):
        shape = [model.n_layer, rows, model.mem_len, model.d_model]
        variable = self.variables.get(phase)
        if variable is None or variable.shape.as_list() != shape or variable.dtype != model.compute_dtype:
            self.variables[phase] = tf.Variable(tf.zeros(shape, model.compute_dtype), trainable=False,
                                                name=f"{phase}_memory")
            return True  # a new variable: the traced step that read the old one must be traced again
        variable.assign(tf.zeros_like(variable))
        return False

    def memory(self, phase):
        if phase not in self.variables:
            raise ConfigError(f"no {phase} memory: call fit() or evaluate() with a stream-ordered tf.data.Dataset")
        return self.variables[phase]


class _ResetMemory(keras.callbacks.Callback):
    """Zeros the training memory at each epoch's start (and the validation memory before each validation)."""

    def __init__(self, recurrence):
        super().__init__()
        self.recurrence = recurrence

    def on_epoch_begin(self, epoch, logs=None):
        for phase in ("train", "test"):
            if phase in self.recurrence.variables:
                variable = self.recurrence.variables[phase]
                variable.assign(tf.zeros_like(variable))

    def on_test_begin(self, logs=None):
        if "test" in self.recurrence.variables:
            variable = self.recurrence.variables["test"]
            variable.assign(tf.zeros_like(variable))


def _is_text(x) -> bool:
    """Whether `x` is text (a str, a list of str, a string tensor) rather than token ids."""
    if isinstance(x, str):
        return True
    if isinstance(x, (list, tuple)):
        return bool(x) and all(isinstance(item, str) for item in x)
    dtype = getattr(x, "dtype", None)
    return dtype is not None and (dtype == tf.string or getattr(dtype, "kind", "") in ("U", "S", "O"))


def _is_stream(x) -> bool:
    """Whether `x` is a stream-ordered corpus: a tf.data.Dataset of token batches without a padding mask."""
    if not isinstance(x, tf.data.Dataset):
        return False
    spec = x.element_spec[0] if isinstance(x.element_spec, tuple) else x.element_spec
    if isinstance(spec, dict):
        return "padding_mask" not in spec
    return isinstance(spec, tf.TensorSpec) and spec.dtype.is_integer


def _stream_rows(dataset, what: str) -> int:
    """The fixed number of rows of a stream-ordered dataset's batches (one-line ConfigError otherwise)."""
    if not isinstance(dataset, tf.data.Dataset):
        raise ConfigError(f"{what} with recurrence takes a tf.data.Dataset of stream-ordered batches, got "
                          f"{type(dataset).__name__}; make one with txl_tf.data.pipeline.make_dataset(DATA_DIR, "
                          "'train', batch_size, tgt_len, repeat=False)")
    spec = dataset.element_spec[0] if isinstance(dataset.element_spec, tuple) else dataset.element_spec
    spec = spec["token_ids"] if isinstance(spec, dict) else spec
    rows = spec.shape[0] if spec.shape.rank == 2 else None
    if rows is None:
        raise ConfigError(f"{what}: the dataset's batches have no fixed number of rows ({spec.shape}); the memory "
                          "carries row i to row i of the next batch: batch with drop_remainder=True")
    return int(rows)


def _prompt_rows(inputs, preprocessor) -> tuple[int | None, int]:
    """(the number of prompts, the width of given token ids or 0) of generate's `inputs`; None for a
    tf.data.Dataset. With a preprocessor the prompts are text: a str, or a non-empty list, tuple or array of str,
    each of symbols of the vocabulary (bytes are a TypeError naming the fix, an empty list or a symbol outside the
    vocabulary a ConfigError)."""
    if isinstance(inputs, tf.data.Dataset):
        return None, 0
    if preprocessor is None:  # token ids: {"token_ids": [B, T], "padding_mask": [B, T]}, made by the caller
        ids = inputs.get("token_ids") if isinstance(inputs, dict) else inputs
        shape = tuple(getattr(ids, "shape", ()))
        return (shape[0] if len(shape) == 2 else 1), (shape[-1] if shape else 0)
    if isinstance(inputs, (bytes, bytearray, memoryview)):
        raise TypeError(f"generate's prompt is text: got {type(inputs).__name__}; decode it first, e.g. "
                        "prompt.decode('utf-8')")
    if tf.is_tensor(inputs) or isinstance(inputs, np.ndarray):
        inputs = np.asarray(inputs).reshape([-1]).tolist()
        inputs = [text.decode("utf-8", "replace") if isinstance(text, bytes) else text for text in inputs]
    texts = [inputs] if isinstance(inputs, str) else inputs
    if not isinstance(texts, (list, tuple)):
        raise TypeError(f"generate's inputs must be a str or a list of str; got {type(inputs).__name__}")
    if not texts:
        raise ConfigError("generate got no prompt (an empty list); give a str or a non-empty list of str")
    vocab = getattr(preprocessor.tokenizer, "vocab", None)
    for index, text in enumerate(texts):
        what, not_text = f"the prompt {str(text)[:40]!r}", f"generate's prompt [{index}] must be a str"
        if vocab is not None:
            vocab.encode_prompt(text, what, not_text)
        elif not isinstance(text, str):
            raise TypeError(f"{not_text}; got {type(text).__name__}")
    return len(texts), 0


def _check_learning_rate(optimizer) -> None:
    """The optimizer's current learning rate must be a finite number >= 0: a NaN or infinite one turns every
    weight into NaN at the first step, and a negative one climbs the loss (one-line ConfigError)."""
    if optimizer is None or isinstance(optimizer, str):
        return
    try:
        rate = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
    except (AttributeError, TypeError, ValueError):  # not a Keras optimizer: Keras says so
        return
    if not (math.isfinite(rate) and rate >= 0):
        raise ConfigError(f"the optimizer's learning_rate is {rate}: it must be a finite number >= 0 (a NaN rate "
                          "turns every weight into NaN); compile with e.g. keras.optimizers.Adam(1e-3)")


_RANGE_MARK = "txl_tf ids out of range:"


def _checked_ids(dataset, n_token: int):
    """`dataset` (of fit's or evaluate's (tokens, targets[, sample_weight]) batches) with each batch's ids checked
    on the host before it reaches the step: token ids and targets in [0, n_token) (tf.data runs the check, so it
    holds under XLA and on every device, where a gather would not refuse an id)."""

    def checked(*element):
        x = element[0]
        parts = [("token ids", x["token_ids"] if isinstance(x, dict) else x)]
        if len(element) > 1 and element[1] is not None:
            parts.append(("targets", element[1]))
        checks = []
        for what, ids in parts:
            ids = tf.convert_to_tensor(ids)
            if not ids.dtype.is_integer:
                continue  # the step says what it cannot take
            low, high = tf.reduce_min(ids), tf.reduce_max(ids)
            checks.append(tf.debugging.Assert((low >= 0) & (high < n_token), [f"{_RANGE_MARK} {what}", low, high]))
        with tf.control_dependencies(checks):
            element = tf.nest.map_structure(tf.identity, element)
        return element if len(element) > 1 else element[0]

    return dataset.map(checked)


class _ids_in_range:  # noqa: N801  (used as a context manager, like a function)
    """Turns the error of `_checked_ids`' check, raised from inside Keras' loop, into one ConfigError line naming
    the ids and the fix."""

    def __init__(self, what: str, n_token: int):
        self.what, self.n_token = what, n_token

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if not isinstance(error, tf.errors.InvalidArgumentError) or _RANGE_MARK not in str(error):
            return False
        found = re.search(re.escape(_RANGE_MARK) + r" (token ids|targets)\]? ?\[?(-?\d+)\]? ?\[?(-?\d+)",
                          str(error))
        part, low, high = found.groups() if found else ("ids", "?", "?")
        fix = ("give token ids of this model's tokenizer" if part == "token ids" else
               "targets are the next token ids; leave a position out of the loss with sample_weight 0 (and any id in "
               "range), not with -1")
        raise ConfigError(f"{self.what}: a batch's {part} range from {low} to {high}, outside [0, {self.n_token}) "
                          f"(the model's vocabulary); {fix}") from None


def _is_hub_preset(path: str) -> bool:
    """Whether the folder `path` holds a keras-hub preset (a config.json naming its registered class)."""
    if not path or not os.path.isdir(path):
        return False
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return False
    data = untrusted.load_json(config, max_bytes=untrusted.JSON_LIMIT, what="the preset's config.json")
    return isinstance(data, dict) and "registered_name" in data


def _check_local(preset, **kwargs) -> None:
    """Every file of a local keras-hub preset (`hub_files.check(preset, **kwargs)`) before keras-hub reads any;
    a kaggle:// or hf:// handle is keras-hub's to download and read (docs/python.md)."""
    if hub_files.is_local(preset):
        hub_files.check(preset, **kwargs)


def _staged_save(preset_dir, overwrite: bool, save) -> str:
    """The one path check (`paths.replaceable_dir`: not empty, not the working directory or above it, no link;
    an existing folder only when it is empty or, with `overwrite`, a preset txl_tf wrote), then `save(tmp)`
    into a staged folder that replaces the target whole, with its manifest."""
    directory = paths.replaceable_dir(preset_dir, "the preset directory", kind=PRESET_KIND, overwrite=overwrite,
                                      overwrite_hint="overwrite=True")
    staging.remove_stale(directory)
    with staging.staged_dir(directory, kind=PRESET_KIND, name="the preset directory", overwrite=overwrite,
                            overwrite_hint="overwrite=True") as tmp:  # checks again under its claim
        save(tmp)
    return directory


__all__ = ["TransformerXLBackbone", "TransformerXLCausalLM", "TransformerXLCausalLMPreprocessor",
           "TransformerXLTokenizer"]
