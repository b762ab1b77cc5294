"""The keras-hub face (`txl_tf.lm.hub`) answers bad input in one line naming the value or file and the fix, never
with a raw library error (issue 52, items 8 and 12): prompts that are no text of the vocabulary, lengths that are no
whole number, ids out of the vocabulary in fit, a learning rate that is not a finite number >= 0, a dtype that is
none, a config without model_config, a tokenizer whose vocabulary is a path, and weights that are a device, garbage,
of another shape or missing.

Everything runs through the real keras-hub loaders and Keras' fit on a small model and its saved preset."""

import json
import math
import os
import shutil

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

from txl_tf.base.errors import ConfigError, UserError
from txl_tf.configs import EvalConfig, ModelConfig, TrainConfig
from txl_tf.data.vocab import Vocab
from txl_tf.lm.hub import (
    TransformerXLBackbone,
    TransformerXLCausalLM,
    TransformerXLCausalLMPreprocessor,
    TransformerXLTokenizer,
)

VOCAB = Vocab([10] + list(range(32, 127)), "char")  # newline and printable ASCII: 96 symbols


def make_lm():
    keras.utils.set_random_seed(5)
    model_config = ModelConfig(n_layer=1, d_model=16, n_head=2, d_head=8, d_inner=24, dropout=0.0, mem_len=6,
                               n_token=len(VOCAB))
    backbone = TransformerXLBackbone(model_config, EvalConfig(tgt_len=4, mem_len=6, clamp_len=-1, same_length=False))
    preprocessor = TransformerXLCausalLMPreprocessor(TransformerXLTokenizer(VOCAB), sequence_length=12)
    return TransformerXLCausalLM(backbone, preprocessor)


@pytest.fixture(scope="module")
def lm():
    lm = make_lm()
    lm.compile(sampler="greedy")
    return lm


@pytest.fixture(scope="module")
def preset(lm, tmp_path_factory):
    return lm.save_to_preset(str(tmp_path_factory.mktemp("hub") / "preset"))


def _copy(preset, tmp_path, edit=None):
    """A copy of the preset; `edit(directory)` changes it."""
    directory = str(tmp_path / "copy")
    shutil.copytree(preset, directory)
    if edit:
        edit(directory)
    return directory


def _edit_json(directory, name, change):
    path = os.path.join(directory, name)
    with open(path) as f:
        data = json.load(f)
    change(data)
    with open(path, "w") as f:
        json.dump(data, f)


def _one_line(error) -> str:
    text = str(error)
    assert "\n" not in text.strip(), text
    assert len(text) < 600, text
    return text


def _stream(tokens, targets):
    """fit's dataset: one batch of 2 rows."""
    return tf.data.Dataset.from_tensors((tf.constant(tokens, tf.int32), tf.constant(targets, tf.int32)))


# ---- generate's inputs and lengths -----------------------------------------------------------------------
@pytest.mark.parametrize(("inputs", "max_length", "kind", "says"), [
    ([], 10, ConfigError, "no prompt"),
    ("na\u00efve caf\u00e9", 20, ConfigError, "outside the char-level vocabulary"),
    (b"abc", 10, TypeError, "decode it first"),
    (["abc", b"abc"], 10, TypeError, "prompt [1]"),
    ("abc", -3, ConfigError, "max_length must be a whole number"),
    ("abc", 5.5, ConfigError, "'5.5'"),
], ids=["empty list", "outside the vocabulary", "bytes", "bytes in a list", "negative max_length",
        "float max_length"])
def test_generate_refuses_bad_prompts_and_lengths_in_one_line(lm, inputs, max_length, kind, says):
    with pytest.raises(kind) as raised:
        lm.generate(inputs, max_length=max_length)
    assert says in _one_line(raised.value)


def test_the_prompt_check_leaves_good_prompts_alone(lm):
    assert len(lm.generate(["abc", "de"], max_length=8)) == 2


# ---- fit ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("tokens", "targets", "says"), [
    ([[1, 2, 3], [4, 5, 500]], [[2, 3, 4], [5, 6, 7]], "token ids range from 1 to 500, outside [0, 96)"),
    ([[1, 2, 3], [4, 5, 6]], [[2, 3, -1], [5, 6, 7]], "targets range from -1 to 7"),
], ids=["token id past the vocabulary", "target -1"])
def test_fit_and_evaluate_refuse_ids_outside_the_vocabulary_in_one_line(tokens, targets, says):
    lm = make_lm()
    lm.compile(optimizer=keras.optimizers.Adam(1e-3))
    before = [w.numpy() for w in lm.backbone.weights]
    with pytest.raises(ConfigError) as raised:
        lm.fit(_stream(tokens, targets), verbose=0)
    assert says in _one_line(raised.value) and raised.value.args[0].startswith("fit: ")
    for old, new in zip(before, lm.backbone.weights, strict=True):  # refused before any step
        np.testing.assert_array_equal(old, new.numpy())
    with pytest.raises(ConfigError) as raised:
        lm.evaluate(_stream(tokens, targets), verbose=0)
    assert says in _one_line(raised.value)


@pytest.mark.parametrize("rate", [float("nan"), float("inf"), -1e-3])
def test_fit_refuses_a_learning_rate_that_is_not_a_finite_number_at_least_zero(rate):
    """A NaN rate used to turn every weight into NaN without a word: refused at compile, and at fit when it was
    set on the optimizer afterwards."""
    lm = make_lm()
    with pytest.raises(ConfigError) as raised:
        lm.compile(optimizer=keras.optimizers.Adam(rate))
    assert f"learning_rate is {rate}" in _one_line(raised.value)
    lm.compile(optimizer=keras.optimizers.Adam(1e-3))
    lm.optimizer.learning_rate = rate
    before = [w.numpy() for w in lm.backbone.weights]
    with pytest.raises(ConfigError, match="learning_rate"):
        lm.fit(_stream([[1, 2, 3], [4, 5, 6]], [[2, 3, 4], [5, 6, 7]]), verbose=0)
    assert all(np.array_equal(old, new.numpy()) for old, new in zip(before, lm.backbone.weights, strict=True))
    assert not any(np.isnan(w.numpy()).any() for w in lm.backbone.weights)


def test_fit_still_trains_with_a_finite_rate():
    lm = make_lm()
    lm.compile(optimizer=keras.optimizers.Adam(1e-2))
    history = lm.fit(_stream([[1, 2, 3], [4, 5, 6]], [[2, 3, 4], [5, 6, 7]]).repeat(3), verbose=0)
    assert math.isfinite(history.history["loss"][0])


@pytest.mark.parametrize("rate", [float("nan"), float("inf"), -2.5e-4, 0.0])
def test_the_training_path_refuses_a_learning_rate_that_is_not_positive_and_finite(rate):
    """`python -m txl_tf.train`'s TrainConfig.learning_rate is checked when the config is made (validate)."""
    with pytest.raises(ConfigError, match="TrainConfig.learning_rate"):
        TrainConfig(learning_rate=rate)


# ---- loading -----------------------------------------------------------------------------------------------
def _without_model_config(directory):
    _edit_json(directory, "config.json", lambda data: data["config"].pop("model_config"))
    _edit_json(directory, "task.json", lambda data: data["config"]["backbone"]["config"].pop("model_config"))


def _vocabulary_path(directory):
    _edit_json(directory, "tokenizer.json", lambda data: data["config"].update(vocabulary="/etc/hostname"))


def _weights(content):
    def edit(directory):
        path = os.path.join(directory, "model.weights.h5")
        os.remove(path)
        if content == "/dev/zero":
            os.symlink("/dev/zero", path)
        elif content is not None:
            with open(path, "wb") as f:
                f.write(content)
    return edit


def _another_shape(directory):
    """d_inner 24 -> 32 in the configs (the architecture record dropped: a preset written before it existed), so
    the weights of the feed-forward no longer fit."""
    def change(config):
        config["model_config"]["d_inner"] = 32
        config.pop("architecture", None)
    _edit_json(directory, "config.json", lambda data: change(data["config"]))
    _edit_json(directory, "task.json", lambda data: change(data["config"]["backbone"]["config"]))


LOADERS = {"CausalLM": keras_hub.models.CausalLM.from_preset, "Backbone": keras_hub.models.Backbone.from_preset,
           "Tokenizer": keras_hub.tokenizers.Tokenizer.from_preset,
           "TransformerXLCausalLM": TransformerXLCausalLM.from_preset,
           "TransformerXLBackbone": TransformerXLBackbone.from_preset}


@pytest.mark.parametrize(("loader", "edit", "kwargs", "says"), [
    ("CausalLM", None, {"dtype": "notadtype"}, "dtype='notadtype' is not a Keras dtype policy"),
    ("Backbone", None, {"dtype": "float33"}, "dtype='float33'"),
    ("CausalLM", _without_model_config, {}, "no model_config"),
    ("Backbone", _without_model_config, {}, "no model_config"),
    ("Tokenizer", _vocabulary_path, {}, "/etc/hostname"),
    ("CausalLM", _weights("/dev/zero"), {}, "model.weights.h5"),
    ("CausalLM", _weights(b"garbage" * 100), {}, "model.weights.h5"),
    ("Backbone", _weights(b""), {}, "model.weights.h5"),
    ("CausalLM", _another_shape, {}, "model.weights.h5"),
    ("TransformerXLBackbone", _weights(None), {}, "model.weights.h5"),
    ("TransformerXLCausalLM", _weights(None), {}, "model.weights.h5"),
], ids=["CausalLM dtype", "Backbone dtype", "CausalLM without model_config", "Backbone without model_config",
        "tokenizer vocabulary path", "weights /dev/zero", "weights garbage", "weights empty",
        "weights of another shape", "Backbone weights missing", "CausalLM weights missing"])
def test_keras_hub_loaders_say_what_is_wrong_in_one_line(preset, tmp_path, loader, edit, kwargs, says):
    """keras-hub's own loaders (CausalLM, Backbone, Tokenizer) and txl_tf's classes. A missing weights file is
    seen by txl_tf's classes' from_preset only: keras-hub's base loaders ask for the sharded index before any of
    txl_tf's code runs (docs/python.md)."""
    directory = _copy(preset, tmp_path, edit) if edit else preset
    with pytest.raises((UserError, TypeError)) as raised:
        LOADERS[loader](directory, **kwargs)
    assert isinstance(raised.value, UserError), f"{type(raised.value).__name__}: {raised.value}"
    text = _one_line(raised.value)
    assert says in text
    assert "doesn't exist in preset directory" not in text  # keras-hub's words for a missing .h5: the sharded index


def test_a_backbone_made_without_model_config_is_one_line():
    with pytest.raises(ConfigError, match="no model_config"):
        TransformerXLBackbone.from_config({"eval_config": {"tgt_len": 4, "mem_len": 6}})
