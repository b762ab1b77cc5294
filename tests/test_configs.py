"""txl_tf.configs: ModelConfig.model_kwargs (n_token filling, its errors) and gin binding of the dataclasses."""

import dataclasses

import gin
import pytest

from txl_tf.configs import DataConfig, EvalConfig, ModelConfig, TrainConfig


@pytest.fixture
def clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


def test_model_kwargs_fills_unset_n_token_from_the_data():
    kwargs = ModelConfig(n_layer=3, d_model=24).model_kwargs(n_token=205)
    assert kwargs["n_token"] == 205
    assert (kwargs["n_layer"], kwargs["d_model"]) == (3, 24)
    # Every field reaches the model, nothing else does.
    assert set(kwargs) == {f.name for f in dataclasses.fields(ModelConfig)}


def test_model_kwargs_keeps_a_bound_n_token_that_matches():
    assert ModelConfig(n_token=267).model_kwargs(n_token=267)["n_token"] == 267
    assert ModelConfig(n_token=267).model_kwargs()["n_token"] == 267


def test_model_kwargs_mismatch_names_both_sizes_and_the_fix():
    with pytest.raises(ValueError) as err:
        ModelConfig(n_token=204).model_kwargs(n_token=27)
    message = str(err.value)
    assert "n_token=204" in message and "27" in message
    assert "DataConfig.data_dir" in message


def test_model_kwargs_without_any_vocabulary_size_fails():
    with pytest.raises(ValueError, match="n_token is unset"):
        ModelConfig().model_kwargs()


def test_model_kwargs_turns_gin_lists_into_tuples():
    kwargs = ModelConfig(n_token=31, cutoffs=[7, 19], tie_projs=[False, True, True]).model_kwargs()
    assert kwargs["cutoffs"] == (7, 19)
    assert kwargs["tie_projs"] == (False, True, True)
    assert ModelConfig(n_token=31).model_kwargs()["tie_projs"] is None


def test_gin_bindings_reach_every_config(clean_gin):
    gin.parse_config(
        """
        ModelConfig.n_layer = 2
        ModelConfig.cutoffs = [11, 23]
        DataConfig.dataset = 'wt103'
        TrainConfig.batch_size = 6
        TrainConfig.mixed_precision = True
        EvalConfig.mem_len = 37
        """
    )
    model = ModelConfig()
    assert (model.n_layer, model.cutoffs, model.d_model) == (2, [11, 23], 512)
    assert DataConfig().dataset == "wt103"
    train = TrainConfig()
    assert (train.batch_size, train.mixed_precision, train.tgt_len) == (6, True, 512)
    assert EvalConfig().mem_len == 37
    # An explicit argument still wins over the binding.
    assert ModelConfig(n_layer=5).n_layer == 5


def test_gin_rejects_a_field_that_does_not_exist(clean_gin):
    with pytest.raises(ValueError, match="n_layers"):
        gin.parse_config("ModelConfig.n_layers = 2")
