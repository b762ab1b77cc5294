"""A checkpoint or preset never loads silently as another encoding (issue 52, item 6).

The architecture a model was saved from (`txl_tf.configs.architecture`) is recorded beside its checkpoints
(architecture.json: a run, averaged/, a converted directory, an export's assets) and in the presets both faces
save, and compared on every load, resume, evaluation and average; a mismatch is one line naming the field and both
values. Where no record exists (older runs and presets), the checkpoint's or weights file's variables must be
exactly the model's: none left unread, none missing.

Real runs trained by `python -m txl_tf.train`, real keras-hub loaders, real presets on disk."""

import json
import os
import shutil

import keras
import keras_hub
import pytest
import tensorflow as tf
from legacy_presets import write_legacy_preset
from train_utils import prepare_tiny_corpus, run_training, tiny_params

import txl_tf
from txl_tf import average, evaluate, train
from txl_tf.base.errors import ConfigError, UserError
from txl_tf.configs import EvalConfig, ModelConfig
from txl_tf.data.vocab import Vocab
from txl_tf.lm.hub import (
    TransformerXLBackbone,
    TransformerXLCausalLM,
    TransformerXLCausalLMPreprocessor,
)
from txl_tf.lm.hub import TransformerXLTokenizer as HubTokenizer
from txl_tf.runs import run_dir

STEPS = {"TrainConfig.train_steps": 2, "TrainConfig.checkpoint_every": 2}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"data": the prepared data_dir, "xl": a run of attn_type xl, "rope": one of rope}, each with one checkpoint."""
    tmp = tmp_path_factory.mktemp("runs")
    data_dir = prepare_tiny_corpus(str(tmp))
    found = {"data": data_dir}
    for attn_type in ("xl", "rope"):
        found[attn_type] = str(tmp / attn_type)
        run_training(found[attn_type], tiny_params(data_dir, **STEPS, **{"ModelConfig.attn_type": repr(attn_type)}))
    return found


def _copy_run(runs, name, tmp_path, record=True):
    """A copy of a run (the tests may change it); `record=False`: without architecture.json, as a run of before."""
    directory = str(tmp_path / name)
    shutil.copytree(runs[name], directory)
    if not record:
        os.remove(os.path.join(directory, run_dir.ARCHITECTURE_FILE))
    return directory


def _one_line(error) -> str:
    text = str(error)
    assert "\n" not in text, text
    return text


def test_training_records_the_architecture(runs):
    with open(os.path.join(runs["rope"], run_dir.ARCHITECTURE_FILE)) as f:
        record = json.load(f)
    assert record["attn_type"] == "rope" and record["d_model"] == 16 and record["n_token"] == 33


# ---- evaluate, from_preset of a run --------------------------------------------------------------------------
@pytest.mark.parametrize(("run", "other"), [("rope", "alibi"), ("xl", "vaswani"), ("rope", "xl")])
def test_evaluate_refuses_another_encoding_than_the_run_recorded(runs, run, other):
    with pytest.raises(run_dir.ArchitectureMismatchError) as raised:
        evaluate.run(runs[run], gin_params=[f"ModelConfig.attn_type = '{other}'"], progress=False)
    text = _one_line(raised.value)
    assert f"ModelConfig.attn_type is '{run}' there but '{other}' here" in text
    assert "--gin_param" in text


def test_evaluate_refuses_another_size_than_the_run_recorded(runs):
    with pytest.raises(run_dir.ArchitectureMismatchError, match="ModelConfig.pre_lnorm is False there but True"):
        evaluate.run(runs["xl"], gin_params=["ModelConfig.pre_lnorm = True"], progress=False)


def test_a_run_without_the_record_still_refuses_checkpoint_variables_the_model_leaves_unread(runs, tmp_path):
    """An XL checkpoint holds position projections and biases a 'vaswani' model has no place for: before, they were
    left unread and the model evaluated as another function."""
    old = _copy_run(runs, "xl", tmp_path, record=False)
    with pytest.raises(run_dir.CheckpointMismatchError) as raised:
        evaluate.run(old, gin_params=["ModelConfig.attn_type = 'vaswani'"], progress=False)
    assert "is intact but does not fit the configured model" in _one_line(raised.value)


def test_from_preset_of_a_run_refuses_a_gin_param_of_another_encoding(runs):
    load = txl_tf.TransformerXLCausalLM.from_preset
    with pytest.raises(run_dir.ArchitectureMismatchError, match="'rope' there but 'alibi' here"):
        load(runs["rope"], gin_param="ModelConfig.attn_type = 'alibi'")
    assert load(runs["rope"]) is not None  # the recorded architecture itself loads


# ---- resume -----------------------------------------------------------------------------------------------
def test_resume_refuses_another_architecture_than_the_checkpoints_hold(runs, tmp_path):
    """config.gin edited to rope and the command giving rope agree with each other (compare_configs), but not with
    the checkpoints: the record refuses before anything in the run changes."""
    run = _copy_run(runs, "xl", tmp_path)
    config = os.path.join(run, run_dir.CONFIG_FILE)
    with open(config) as f:
        text = f.read()
    with open(config, "w") as f:
        f.write(text.replace("ModelConfig.attn_type = 'xl'", "ModelConfig.attn_type = 'rope'"))
    before = sorted(os.listdir(run))
    with pytest.raises(run_dir.ArchitectureMismatchError, match="'xl' there but 'rope' here"):
        train.run(["gin/sample.gin"], tiny_params(runs["data"], **STEPS, **{"ModelConfig.attn_type": "'rope'"}),
                  model_dir=run)
    assert sorted(os.listdir(run)) == before


# ---- average ----------------------------------------------------------------------------------------------
def test_average_refuses_an_xl_checkpoint_with_a_rope_one(runs, tmp_path):
    prefixes = [run_dir.find_checkpoint(runs["xl"]), run_dir.find_checkpoint(runs["rope"])]
    with pytest.raises(ConfigError) as raised:
        average.average(prefixes, str(tmp_path / "averaged"))
    assert "rope" in _one_line(raised.value) and "xl" in str(raised.value)
    assert not os.path.exists(tmp_path / "averaged")


@pytest.mark.parametrize("record", [True, False], ids=["recorded", "before the record"])
def test_average_refuses_an_xl_checkpoint_in_a_rope_run(runs, tmp_path, record):
    """An XL checkpoint copied into a RoPE run's folder: the RoPE model would read 26 of its variables and leave
    the position projections and biases unread ("averaged 2 checkpoints" before)."""
    run = _copy_run(runs, "rope", tmp_path, record=record)
    xl = run_dir.find_checkpoint(runs["xl"])
    for name in os.listdir(runs["xl"]):
        if name.startswith(os.path.basename(xl) + "."):
            shutil.copy(os.path.join(runs["xl"], name), os.path.join(run, name.replace("ckpt-", "ckpt-9")))
    prefixes = [run_dir.find_checkpoint(run), os.path.join(run, os.path.basename(xl).replace("ckpt-", "ckpt-9"))]
    with pytest.raises(run_dir.CheckpointMismatchError) as raised:
        average.average(prefixes, str(tmp_path / "averaged"), model_dir=run)
    assert "does not fit the configured model" in _one_line(raised.value)


def test_an_average_records_the_architecture(runs, tmp_path):
    run = _copy_run(runs, "rope", tmp_path)
    average.average([run_dir.find_checkpoint(run)], str(tmp_path / "averaged"), model_dir=run)
    assert run_dir.recorded_architecture(str(tmp_path / "averaged"))["attn_type"] == "rope"
    with pytest.raises(run_dir.ArchitectureMismatchError, match="'rope' there but 'alibi' here"):
        evaluate.run(str(tmp_path / "averaged"), gin_params=["ModelConfig.attn_type = 'alibi'"], progress=False)


# ---- presets of both faces ----------------------------------------------------------------------------------
VOCAB = Vocab([10] + list(range(32, 127)), "char")
MODEL = dict(n_layer=1, d_model=16, n_head=2, d_head=8, d_inner=24, dropout=0.0, mem_len=6, n_token=len(VOCAB))
EVAL = EvalConfig(tgt_len=4, mem_len=6, clamp_len=-1, same_length=False)


@pytest.fixture(scope="module")
def hub_preset(tmp_path_factory):
    keras.utils.set_random_seed(4)
    lm = TransformerXLCausalLM(TransformerXLBackbone(ModelConfig(**MODEL), EVAL),
                               TransformerXLCausalLMPreprocessor(HubTokenizer(VOCAB), sequence_length=12))
    return lm.save_to_preset(str(tmp_path_factory.mktemp("hub") / "xl"))


def _edit(path, change):
    with open(path) as f:
        data = json.load(f)
    change(data)
    with open(path, "w") as f:
        json.dump(data, f)


@pytest.mark.parametrize("record", [True, False], ids=["recorded", "before the record"])
@pytest.mark.parametrize("other", ["rope", "alibi", "vaswani"])
def test_a_keras_hub_preset_of_an_xl_model_whose_config_says_another_encoding_is_refused(hub_preset, tmp_path,
                                                                                           other, record):
    directory = str(tmp_path / "preset")
    shutil.copytree(hub_preset, directory)

    def change(config):
        config["model_config"]["attn_type"] = other
        if not record:
            config.pop("architecture")

    _edit(os.path.join(directory, "config.json"), lambda data: change(data["config"]))
    _edit(os.path.join(directory, "task.json"), lambda data: change(data["config"]["backbone"]["config"]))
    for load in (keras_hub.models.CausalLM.from_preset, keras_hub.models.Backbone.from_preset):
        with pytest.raises(UserError) as raised:
            load(directory)
        text = _one_line(raised.value)
        if record:
            assert f"ModelConfig.attn_type is 'xl' there but '{other}' here" in text
        else:
            assert "model.weights.h5 holds 17 weights and the model 14: 3 of the file's weights" in text


@pytest.fixture(scope="module")
def txl_preset(tmp_path_factory):
    keras.utils.set_random_seed(4)
    config = ModelConfig(**MODEL)
    model = config.build()
    model(tf.zeros([1, 2], tf.int32))
    return write_legacy_preset(tmp_path_factory.mktemp("txl") / "xl", model, VOCAB, config, EVAL)


@pytest.mark.parametrize("record", [True, False], ids=["recorded", "before the record"])
def test_a_txl_tf_preset_of_an_xl_model_whose_config_says_rope_is_refused(txl_preset, tmp_path, record):
    directory = str(tmp_path / "preset")
    shutil.copytree(txl_preset, directory)

    def change(config):
        config["model"]["attn_type"] = "rope"
        if not record:
            config.pop("architecture")

    _edit(os.path.join(directory, "config.json"), change)
    with pytest.raises(UserError) as raised:
        txl_tf.TransformerXLCausalLM.from_preset(directory)
    text = _one_line(raised.value)
    assert ("'xl' there but 'rope' here" if record else "holds 17 weights and the model 14") in text
    assert txl_tf.TransformerXLCausalLM.from_preset(txl_preset) is not None
