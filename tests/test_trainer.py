"""txl_tf.training.trainer (the step): host loops against independent oracles (NumPy Adam step, the model's own NLL),
strategy equivalence (MirroredStrategy on 2 logical CPUs vs the default strategy), gradient accumulation,
non-finite handling, and training on an in-memory dataset (no corpus on disk). What the loop around it writes is
tests/test_controller.py's."""

import numpy as np
import pytest
import tensorflow as tf
from train_utils import B, L, in_memory_trainer, prepare_tiny_corpus, tiny_controller, tiny_trainer

from txl_tf.data import pipeline

HUGE = dict(init_std=1e30, proj_init_std=1e30)  # a model whose first loss is not finite


@pytest.fixture(scope="module")
def char_data(tmp_path_factory):
    return prepare_tiny_corpus(str(tmp_path_factory.mktemp("data")), "char")


def weights(trainer):
    return [v.numpy() for v in trainer.model.trainable_variables]


def first_batch(data_dir):
    inputs, targets = next(iter(pipeline.make_dataset(data_dir, "train", B, L)))
    return inputs, targets


def test_first_step_matches_numpy_adam_with_global_norm_clipping(char_data):
    """Loss over the recent half of each segment (the ablation option) also checks the token weighting."""
    recent_half = True
    # adam_epsilon 1e-4: with Adam's 1e-8 a weight whose gradient is ~1e-7 moves by ~lr whatever its sign and size,
    # so a last-bit difference of the gradient between two CPUs' vector paths could move it by ~1e-6.
    trainer = tiny_trainer(char_data, clip_norm=0.05, loss_recent_half=recent_half, adam_epsilon=1e-4)
    model = trainer.model
    inputs, targets = first_batch(char_data)
    start = weights(trainer)
    with tf.GradientTape() as tape:
        hidden, _ = model(inputs, model.initial_memory(B), training=False)
        nll = model.nll(hidden, targets)  # [B, L]
        loss = tf.reduce_mean(nll[:, L // 2:] if recent_half else nll)
    grads = [tf.convert_to_tensor(g).numpy() for g in tape.gradient(loss, model.trainable_variables)]
    norm = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in grads))
    assert norm > 0.05  # the clipping is active
    trainer.start(0)
    stats = trainer.train_loop(1)
    assert stats.steps == 1 and stats.tokens == B * (L - L // 2) and stats.nonfinite == 0
    np.testing.assert_allclose(stats.loss, float(loss), rtol=1e-5)
    np.testing.assert_allclose(stats.grad_norm_sum, norm, rtol=1e-4)
    lr, b2, eps = 1e-3, 0.999, 1e-4
    for w0, g, w1 in zip(start, grads, weights(trainer), strict=True):
        g = g * 0.05 / norm
        expected = w0 - lr * np.sqrt(1 - b2) * g / (np.sqrt(1 - b2) * np.abs(g) + eps)  # Adam's first step
        np.testing.assert_allclose(w1, expected, atol=2e-6)


@pytest.mark.slow  # CI's slow phase: the fast suite stays near 10 minutes on 2 cores
def test_mirrored_on_two_cpus_matches_default(char_data, tmp_path):
    runs = {}
    for name in ("default", "mirrored"):
        # Evaluation and a text sample run too (the model's variables are mirrored outside strategy.run).
        trainer = tiny_trainer(char_data, strategy=name, train_steps=4, eval_every=4, sample_tokens=3,
                               adam_epsilon=1e-4)  # see the first-step test
        assert trainer.replicas == (2 if name == "mirrored" else 1)
        metrics = tiny_controller(trainer, tmp_path / name, char_data).train()
        assert np.isfinite(metrics["valid_loss"])
        runs[name] = (metrics["loss"], weights(trainer), trainer.saved_mems.numpy())
    (loss_d, weights_d, mems_d), (loss_m, weights_m, mems_m) = runs["default"], runs["mirrored"]
    np.testing.assert_allclose(loss_m, loss_d, rtol=1e-5)
    for a, b in zip(weights_m, weights_d, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    np.testing.assert_allclose(mems_m, mems_d, atol=1e-5)  # memory gathered in stream order
    assert np.abs(mems_d).max() > 0


def test_gradient_accumulation_matches_one_chunk(char_data):
    results = []
    for chunks in (1, 2):
        trainer = tiny_trainer(char_data, grad_accum_steps=chunks, adam_epsilon=1e-4)  # see the first-step test
        trainer.start(0)
        stats = trainer.train_loop(3)
        trainer.sync_checkpoint(3)
        assert int(trainer.step_var.numpy()) == 3
        results.append((stats.loss, weights(trainer), trainer.saved_mems.numpy()))
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-5)
    for a, b in zip(results[1][1], results[0][1], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    np.testing.assert_allclose(results[1][2], results[0][2], atol=1e-5)


def test_bad_path_settings_are_one_line_errors(char_data):
    with pytest.raises(ValueError, match="mixed_precision='bf16' must be True, False or 'auto'"):
        tiny_trainer(char_data, mixed_precision="bf16")


def test_grad_accum_must_divide_the_replica_batch(char_data):
    with pytest.raises(ValueError, match="grad_accum_steps=3"):
        tiny_trainer(char_data, grad_accum_steps=3)


def test_nonfinite_skip_leaves_weights_zeroes_memory_and_keeps_counting(char_data):
    trainer = tiny_trainer(char_data, model=HUGE, nonfinite="skip")
    start = weights(trainer)
    trainer.start(0)
    stats = trainer.train_loop(2)
    assert stats.steps == 2 and stats.nonfinite == 2
    assert int(trainer.optimizer.iterations.numpy()) == 2  # the schedule still advances
    for a, b in zip(start, weights(trainer), strict=True):
        np.testing.assert_array_equal(a, b)
    trainer.sync_checkpoint(2)
    assert not np.any(trainer.saved_mems.numpy())


def test_nonfinite_stop_ends_the_host_loop_at_that_step(char_data):
    trainer = tiny_trainer(char_data, model=HUGE, nonfinite="stop")
    trainer.start(0)
    stats = trainer.train_loop(3)
    assert stats.steps == 1 and stats.nonfinite == 1


def test_a_training_loop_on_an_in_memory_dataset_learns_the_batch():
    """No corpus, no data directory: the trainer trains on what its dataset_fn gives (one batch, repeated), from
    the step it is started at; the loss of the repeated batch falls host loop after host loop (from ln 11 = 2.4)."""
    starts = []
    trainer = in_memory_trainer(starts, train_steps=30, learning_rate=1e-2)
    trainer.start(0)
    loops = [trainer.train_loop(1)] + [trainer.train_loop(5) for _ in range(4)] + [trainer.train_loop(1)]
    assert starts == [0]
    assert [s.steps for s in loops] == [1, 5, 5, 5, 5, 1] and int(trainer.optimizer.iterations.numpy()) == 22
    assert [s.tokens for s in loops] == [B * L * s.steps for s in loops] and not any(s.nonfinite for s in loops)
    losses = [s.loss for s in loops]
    assert np.isfinite(losses[0]) and all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
    assert losses[-1] < losses[0] - 0.5, losses
    trainer.start(7)
    assert starts == [0, 7]


def test_the_memory_is_carried_from_host_loop_to_host_loop():
    """One host loop of two steps = two host loops of one step (the memory of step 1 feeds step 2 either way);
    starting again at step 1 with a zero memory (the saved one, never synced here) gives another memory."""
    runs = {}
    for name, loops in {"one loop": [2], "two loops": [1, 1], "restart": [1, "start", 1]}.items():
        trainer = in_memory_trainer()
        trainer.start(0)
        for loop in loops:
            if loop == "start":
                trainer.start(1)
            else:
                trainer.train_loop(loop)
        trainer.sync_checkpoint(2)
        runs[name] = trainer.saved_mems.numpy(), weights(trainer)
    (mems_one, weights_one), (mems_two, weights_two), (mems_restart, _) = runs.values()
    np.testing.assert_allclose(mems_two, mems_one, atol=1e-6)
    for a, b in zip(weights_two, weights_one, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert np.abs(mems_one).max() > 0.1 and np.abs(mems_restart - mems_one).max() > 0.05
