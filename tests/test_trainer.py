"""txl_tf.trainer: the distributed loop against independent oracles (NumPy Adam step, the model's own NLL),
strategy equivalence (MirroredStrategy on 2 logical CPUs vs the default strategy), gradient accumulation,
non-finite handling, and what a run leaves in model_dir (config.gin, checkpoints, best/, TensorBoard)."""

import glob
import os

import numpy as np
import pytest
import tensorflow as tf
from train_utils import prepare_tiny_corpus

from txl_tf import distribute, restore
from txl_tf.configs import DataConfig, EvalConfig, ModelConfig, TrainConfig
from txl_tf.data import pipeline
from txl_tf.trainer import NonFiniteLossError, Trainer

B, L, M = 4, 5, 6  # global batch, tgt_len, mem_len (pairwise distinct)


@pytest.fixture(scope="module")
def char_data(tmp_path_factory):
    return prepare_tiny_corpus(str(tmp_path_factory.mktemp("data")), "char")


def make_trainer(data_dir, model_dir, strategy="default", model=None, evaluation=None, **train):
    model_config = ModelConfig(n_layer=1, d_model=16, n_head=2, d_head=8, d_inner=24, mem_len=M, dropout=0.0,
                               dropatt=0.0, **(model or {}))
    settings = dict(batch_size=B, tgt_len=L, train_steps=3, warmup_steps=0, learning_rate=1e-3, steps_per_loop=2,
                    log_every=1, eval_every=0, checkpoint_every=0, sample_tokens=0, measure_mfu=False)
    settings.update(train)
    eval_config = EvalConfig(tgt_len=4, mem_len=7, clamp_len=-1, same_length=True, batch_size=3, max_steps=3,
                             **(evaluation or {}))
    return Trainer(model_config, DataConfig(dataset="text", data_dir=data_dir), TrainConfig(**settings),
                   eval_config, strategy=distribute.make_strategy(strategy), model_dir=str(model_dir),
                   log=lambda line: None)


def weights(trainer):
    return [v.numpy() for v in trainer.model.trainable_variables]


def first_batch(data_dir):
    inputs, targets = next(iter(pipeline.make_dataset(data_dir, "train", B, L)))
    return inputs, targets


def test_first_step_matches_numpy_adam_with_global_norm_clipping(char_data, tmp_path):
    """Loss over the recent half of each segment (the ablation option) also checks the token weighting."""
    recent_half = True
    trainer = make_trainer(char_data, tmp_path, train_steps=1, clip_norm=0.05, loss_recent_half=recent_half)
    model = trainer.model
    inputs, targets = first_batch(char_data)
    start = weights(trainer)
    with tf.GradientTape() as tape:
        hidden, _ = model(inputs, mems=model.initial_mems(B), training=False)
        nll = model.nll(hidden, targets)  # [B, L]
        loss = tf.reduce_mean(nll[:, L // 2:] if recent_half else nll)
    grads = [tf.convert_to_tensor(g).numpy() for g in tape.gradient(loss, model.trainable_variables)]
    norm = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in grads))
    assert norm > 0.05  # the clipping is active
    metrics = trainer.train()
    np.testing.assert_allclose(metrics["loss"], float(loss), rtol=1e-5)
    np.testing.assert_allclose(metrics["grad_norm"], norm, rtol=1e-4)
    lr, b2, eps = 1e-3, 0.999, 1e-8
    for w0, g, w1 in zip(start, grads, weights(trainer), strict=True):
        g = g * 0.05 / norm
        expected = w0 - lr * np.sqrt(1 - b2) * g / (np.sqrt(1 - b2) * np.abs(g) + eps)  # Adam's first step
        np.testing.assert_allclose(w1, expected, atol=2e-6)


def test_mirrored_on_two_cpus_matches_default(char_data, tmp_path):
    runs = {}
    for name in ("default", "mirrored"):
        # Evaluation and a text sample run too (the model's variables are mirrored outside strategy.run).
        trainer = make_trainer(char_data, tmp_path / name, strategy=name, train_steps=4, eval_every=4,
                               sample_tokens=3)
        assert trainer.replicas == (2 if name == "mirrored" else 1)
        metrics = trainer.train()
        assert np.isfinite(metrics["valid_loss"])
        runs[name] = (metrics["loss"], weights(trainer), trainer.saved_mems.numpy())
    (loss_d, weights_d, mems_d), (loss_m, weights_m, mems_m) = runs["default"], runs["mirrored"]
    np.testing.assert_allclose(loss_m, loss_d, rtol=1e-5)
    for a, b in zip(weights_m, weights_d, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    np.testing.assert_allclose(mems_m, mems_d, atol=1e-5)  # memory gathered in stream order
    assert np.abs(mems_d).max() > 0


def test_gradient_accumulation_matches_one_chunk(char_data, tmp_path):
    results = []
    for chunks in (1, 2):
        trainer = make_trainer(char_data, tmp_path / str(chunks), grad_accum_steps=chunks, train_steps=3)
        metrics = trainer.train()
        results.append((metrics["loss"], weights(trainer), trainer.saved_mems.numpy()))
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-5)
    for a, b in zip(results[1][1], results[0][1], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    np.testing.assert_allclose(results[1][2], results[0][2], atol=1e-5)


def test_mixed_precision_auto_follows_the_hardware(char_data, tmp_path):
    trainer = make_trainer(char_data, tmp_path, mixed_precision="auto", train_steps=1)
    native = distribute.has_fast_bfloat16(trainer.strategy)
    assert trainer.model.dtype_policy.name == ("mixed_bfloat16" if native else "float32")
    assert trainer.train()["loss"] > 0
    with pytest.raises(ValueError, match="mixed_precision='bf16' must be True, False or 'auto'"):
        make_trainer(char_data, tmp_path, mixed_precision="bf16")


def test_grad_accum_must_divide_the_replica_batch(char_data, tmp_path):
    with pytest.raises(ValueError, match="grad_accum_steps=3"):
        make_trainer(char_data, tmp_path, grad_accum_steps=3)


def test_nonfinite_skip_leaves_weights_and_keeps_counting(char_data, tmp_path):
    huge = dict(init_std=1e30, proj_init_std=1e30)
    trainer = make_trainer(char_data, tmp_path, model=huge, nonfinite="skip", train_steps=2, log_every=2)
    start = weights(trainer)
    metrics = trainer.train()
    assert metrics["nonfinite_steps"] == 2
    assert int(trainer.optimizer.iterations.numpy()) == 2  # the schedule still advances
    for a, b in zip(start, weights(trainer), strict=True):
        np.testing.assert_array_equal(a, b)


def test_nonfinite_stop_raises_and_writes_no_checkpoint(char_data, tmp_path):
    trainer = make_trainer(char_data, tmp_path, model=dict(init_std=1e30, proj_init_std=1e30), checkpoint_every=1)
    with pytest.raises(NonFiniteLossError, match="nonfinite='skip'"):
        trainer.train()
    assert tf.train.latest_checkpoint(str(tmp_path)) is None


def _event_tags(directory):
    tags = set()
    for path in glob.glob(os.path.join(directory, "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            tags.update(value.tag for value in event.summary.value)
    return tags


def test_run_leaves_config_checkpoints_best_and_summaries(char_data, tmp_path):
    config_str = "ModelConfig.n_layer = 2\n"
    trainer = make_trainer(char_data, tmp_path, train_steps=4, eval_every=2, checkpoint_every=2,
                           sample_tokens=5)
    trainer.config_str = config_str
    metrics = trainer.train()
    assert metrics["step"] == 4 and np.isfinite(metrics["valid_bpc"])
    with open(tmp_path / "config.gin") as f:
        assert config_str in f.read()
    assert tf.train.latest_checkpoint(str(tmp_path)).endswith("ckpt-4")
    best = restore.find_checkpoint(str(tmp_path), "best")
    assert os.path.dirname(best) == str(tmp_path / "best")
    # The pinned key `model`: EVAL's restore rebuilds the model and gets the trained weights.
    model = restore.build_model(trainer.model_config, trainer.n_token)
    restore.restore_weights(model, tf.train.latest_checkpoint(str(tmp_path)))
    for a, b in zip(model.trainable_variables, trainer.model.trainable_variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert {"loss", "bpc", "learning_rate", "grad_norm", "tokens_per_second", "step_time", "config"} <= \
        _event_tags(str(tmp_path / "train"))
    assert {"loss", "bpc", "sample"} <= _event_tags(str(tmp_path / "valid"))


def test_resume_restores_step_memory_and_optimizer(char_data, tmp_path):
    first = make_trainer(char_data, tmp_path, train_steps=2, checkpoint_every=2)
    first.train()
    saved = (first.saved_mems.numpy(), weights(first), int(first.optimizer.iterations.numpy()))
    second = make_trainer(char_data, tmp_path, train_steps=2)
    assert second.restore() == 2
    np.testing.assert_array_equal(second.saved_mems.numpy(), saved[0])
    for a, b in zip(weights(second), saved[1], strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(second.optimizer.iterations.numpy()) == saved[2] == 2
