"""txl_tf.runs.run_dir: rebuild + restore from a model_dir (config.gin, ckpt-N, best/) or a converted checkpoint
directory, and the config files it writes. Damaged checkpoints, fallback and resume: tests/test_faults.py."""

import gin
import numpy as np
import pytest
import tensorflow as tf

from txl_tf.configs import ModelConfig
from txl_tf.runs import loading, run_dir

CONFIG = """
DATA_DIR = '{data_dir}'
ModelConfig.n_layer = 2
ModelConfig.d_model = 8
ModelConfig.n_head = 2
ModelConfig.d_head = 4
ModelConfig.d_inner = 12
ModelConfig.n_token = 13
ModelConfig.mem_len = 5
DataConfig.data_dir = %DATA_DIR
EvalConfig.tgt_len = 3
EvalConfig.mem_len = 11
Trainer.unknown_to_this_module = 1
"""


@pytest.fixture(autouse=True)
def _clean_gin():
    """read_configs binds the global gin config: leave none behind for other tests."""
    yield
    gin.clear_config()


def _model_dir(tmp_path):
    model_dir = tmp_path / "run"
    model_dir.mkdir()
    (model_dir / "config.gin").write_text(CONFIG.format(data_dir=tmp_path / "data"))
    configs = run_dir.read_configs(str(model_dir))
    tf.keras.utils.set_random_seed(0)
    model = loading.build_model(configs.model)
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=model), str(model_dir), max_to_keep=2)
    manager.save(checkpoint_number=7)
    best = tf.train.CheckpointManager(tf.train.Checkpoint(model=model), str(model_dir / "best"), max_to_keep=1)
    best.save(checkpoint_number=3)
    return model_dir, model


def test_parse_order_and_overrides(tmp_path):
    model_dir, _ = _model_dir(tmp_path)
    extra = tmp_path / "extra.gin"
    extra.write_text("EvalConfig.tgt_len = 4\nEvalConfig.batch_size = 2\n")
    configs = run_dir.read_configs(str(model_dir), [str(extra)], ["EvalConfig.batch_size = 6"])
    assert (configs.model.n_layer, configs.eval.mem_len, configs.eval.tgt_len, configs.eval.batch_size) == (
        2, 11, 4, 6)
    assert configs.data.data_dir == str(tmp_path / "data")
    with pytest.raises(FileNotFoundError, match="no gin config"):
        run_dir.read_configs(str(tmp_path / "nowhere"))


def test_find_checkpoint_latest_best_prefix(tmp_path):
    model_dir, _ = _model_dir(tmp_path)
    assert run_dir.find_checkpoint(str(model_dir)).endswith("run/ckpt-7")
    assert run_dir.find_checkpoint(str(model_dir), "best").endswith("best/ckpt-3")
    prefix = str(model_dir / "ckpt-7")
    assert run_dir.find_checkpoint(prefix) == prefix
    with pytest.raises(FileNotFoundError, match="neither"):
        run_dir.find_checkpoint(str(model_dir / "ckpt-9"))


def test_load_model_restores_every_weight(tmp_path):
    model_dir, saved = _model_dir(tmp_path)
    tf.keras.utils.set_random_seed(1)  # a different initialisation, overwritten by the restore
    model, configs, prefix = loading.load_model(str(model_dir))
    assert prefix.endswith("ckpt-7") and len(model.weights) == len(saved.weights)
    for a, b in zip(model.weights, saved.weights, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert model.mem_len == 5 and configs.eval.mem_len == 11


def test_mismatched_architecture_is_reported(tmp_path):
    model_dir, _ = _model_dir(tmp_path)
    with pytest.raises(ValueError, match=r"does not fit the configured model: .*ModelConfig.n_layer: 2 in the "
                       r"checkpoint, 3 configured"):
        loading.load_model(str(model_dir), gin_params=["ModelConfig.n_layer = 3"])


def test_converted_checkpoint_directory(tmp_path, fixture_dir):
    from txl_tf import convert

    converted = convert.from_original_tf(str(fixture_dir / "model.ckpt"), mem_len=7)
    out = tmp_path / "converted"
    tf.train.Checkpoint(model=converted).save(str(out / "ckpt"))
    fields = ("n_token", "n_layer", "d_model", "n_head", "d_head", "d_inner")
    text = "".join(f"ModelConfig.{k} = {getattr(converted, k)}\n" for k in fields)
    run_dir.write_config(str(out), text, name=run_dir.CONVERTED_CONFIG_FILE)  # as convert writes it
    model, configs, prefix = loading.load_model(checkpoint=str(out), gin_params=["ModelConfig.dropout = 0.0"])
    assert prefix.endswith("ckpt-1") and configs.model.n_token == 50
    tokens = np.arange(12, dtype=np.int32).reshape(2, 6)
    np.testing.assert_allclose(model(tokens)[0].numpy(), converted(tokens)[0].numpy(), atol=1e-6)
    assert isinstance(configs.model, ModelConfig)


def test_build_model_in_mixed_precision_reaches_every_layer():
    import keras

    model = loading.build_model(ModelConfig(n_layer=2, d_model=8, n_head=2, d_head=4, d_inner=12, mem_len=3), 7,
                                dtype="mixed_bfloat16")
    assert {block.attention.compute_dtype for block in model.blocks} == {"bfloat16"}
    assert model.blocks[1].feed_forward.inner.compute_dtype == "bfloat16"
    assert model.embedding.compute_dtype == "bfloat16" and model.weights[0].dtype == "float32"
    assert keras.config.dtype_policy().name == "float32"  # the global policy is put back


def test_written_config_is_the_base_of_read_configs(tmp_path):
    model_dir = tmp_path / "new" / "run"
    path = run_dir.write_config(str(model_dir), CONFIG.format(data_dir=tmp_path), "written by a test")
    with open(path) as f:
        assert f.readline() == "# written by a test\n" and path == str(model_dir / run_dir.CONFIG_FILE)
    configs = run_dir.read_configs(str(model_dir), gin_params=["EvalConfig.batch_size = 5"])
    assert (configs.model.n_layer, configs.model.n_token, configs.eval.batch_size) == (2, 13, 5)
    unchecked = loading.build_model(configs.model, check=False)  # built (every weight made), not called
    assert [w.shape for w in unchecked.weights] == [w.shape for w in loading.build_model(configs.model).weights]
