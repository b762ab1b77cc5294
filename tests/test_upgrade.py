"""Checkpoints and presets written before the attention's projections became Keras layers (`txl_tf.model.upgrade`):
they load into today's model and give the log-probabilities the old code gave (fixtures written by it, see
tests/data/legacy_attention/README.md); training cannot resume from one, in one line."""

import json
import os
import shutil

import numpy as np
import pytest

from txl_tf.model import upgrade
from txl_tf.runs import loading

LEGACY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "legacy_attention")
ENCODINGS = ("xl", "shaw", "rope")


def _model(attn_type):
    from txl_tf.model.transformer_xl import TransformerXL

    model = TransformerXL(n_layer=2, d_model=16, n_head=2, d_head=8, d_inner=32, n_token=14, mem_len=4,
                          dropout=0.0, dropatt=0.0, attn_type=attn_type, max_position=16)
    model(np.zeros([1, 2], np.int32), training=False)
    return model


def _log_probs(model, tokens):
    hidden, memory = model(tokens[:, :4], None, training=False)
    hidden, _ = model(tokens[:, 4:], memory, training=False)
    return model.log_probs(hidden).numpy()


@pytest.fixture(scope="module")
def expected():
    return np.load(os.path.join(LEGACY, "expected.npz"))


@pytest.mark.parametrize("attn_type", ENCODINGS)
def test_an_old_checkpoint_restores_into_todays_model(attn_type, expected):
    prefix = os.path.join(LEGACY, f"{attn_type}-1")
    assert upgrade.legacy_checkpoint(prefix)
    model = _model(attn_type)
    loading.restore_weights(model, prefix)
    np.testing.assert_allclose(_log_probs(model, expected["tokens"]), expected[f"{attn_type}_log_probs"],
                               rtol=0, atol=1e-6)


@pytest.mark.parametrize("attn_type", ENCODINGS)
def test_an_old_weights_file_loads_into_todays_model(attn_type, expected, tmp_path):
    path = os.path.join(LEGACY, f"{attn_type}.weights.h5")
    assert upgrade.legacy_weights_file(path)
    model = _model(attn_type)
    model.load_weights(upgrade.upgraded_weights_file(path, str(tmp_path)))
    np.testing.assert_allclose(_log_probs(model, expected["tokens"]), expected[f"{attn_type}_log_probs"],
                               rtol=0, atol=1e-6)
    model.save_weights(str(tmp_path / "today.weights.h5"))  # today's files are not taken for old ones
    assert not upgrade.legacy_weights_file(str(tmp_path / "today.weights.h5"))


def test_todays_checkpoint_is_not_upgraded(tmp_path):
    import tensorflow as tf

    prefix = tf.train.Checkpoint(model=_model("xl")).save(str(tmp_path / "ckpt"))
    assert not upgrade.legacy_checkpoint(prefix)


def test_a_preset_of_the_earlier_format_loads(expected, tmp_path):
    """A preset saved before (config.json, model.weights.h5 of the old layout, vocab.json) loads with from_preset."""
    from legacy_presets import write_legacy_preset

    from txl_tf import TransformerXLCausalLM
    from txl_tf.configs import EvalConfig, ModelConfig
    from txl_tf.data.vocab import Vocab

    model_config = ModelConfig(n_layer=2, d_model=16, n_head=2, d_head=8, d_inner=32, n_token=14, mem_len=4,
                               dropout=0.0, dropatt=0.0, max_position=16)
    preset = write_legacy_preset(tmp_path / "preset", _model("xl"), Vocab(list(range(97, 111)), "char"),
                                 model_config, EvalConfig(tgt_len=4, mem_len=4))
    shutil.copyfile(os.path.join(LEGACY, "xl.weights.h5"), os.path.join(preset, "model.weights.h5"))
    with open(os.path.join(preset, "config.json")) as f:
        assert json.load(f)["model"]["attn_type"] == "xl"
    loaded = TransformerXLCausalLM.from_preset(preset)
    np.testing.assert_allclose(_log_probs(loaded.transformer_xl, expected["tokens"]), expected["xl_log_probs"],
                               rtol=0, atol=1e-6)


def test_training_cannot_resume_from_an_old_checkpoint_in_one_line():
    from train_utils import in_memory_trainer

    from txl_tf.runs.run_dir import RunDirError

    trainer = in_memory_trainer()
    with pytest.raises(RunDirError, match=r"^[^\n]*TrainConfig.init_checkpoint='[^']*xl-1'[^\n]*$"):
        trainer.restore_checkpoint(os.path.join(LEGACY, "xl-1"))
