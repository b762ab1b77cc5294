"""txl_tf.schedules: the learning rate against the formula of the original scripts, and the Adam settings."""

import math

import keras
import numpy as np
import pytest

from txl_tf.configs import TrainConfig
from txl_tf.schedules import learning_rate_schedule, make_optimizer


def original_lr(step, lr, warmup, total, floor_ratio):
    """Linear warm-up then cosine decay to floor_ratio * lr (the authors' train.py), written out by hand."""
    if step < warmup:
        return lr * step / warmup
    progress = min(step - warmup, total - warmup) / (total - warmup)
    return lr * (floor_ratio + (1 - floor_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@pytest.mark.parametrize("warmup", [0, 7])
def test_schedule_matches_warmup_then_cosine_to_the_floor(warmup):
    config = TrainConfig(learning_rate=3e-4, warmup_steps=warmup, train_steps=53, min_lr_ratio=0.004)
    schedule = learning_rate_schedule(config)
    for step in [0, 1, 3, 6, 7, 8, 20, 30, 52, 53, 80]:
        expected = original_lr(step, 3e-4, warmup, 53, 0.004)
        np.testing.assert_allclose(float(schedule(step)), expected, rtol=1e-5, atol=1e-12, err_msg=f"step {step}")


def test_schedule_ends_at_the_floor_and_stays_there():
    schedule = learning_rate_schedule(TrainConfig(learning_rate=2e-3, warmup_steps=4, train_steps=40,
                                                  min_lr_ratio=0.05))
    np.testing.assert_allclose(float(schedule(4)), 2e-3, rtol=1e-6)  # peak right after warm-up
    np.testing.assert_allclose([float(schedule(s)) for s in (40, 41, 1000)], [1e-4] * 3, rtol=1e-5)


def test_optimizer_is_adam_with_the_configured_moments():
    config = TrainConfig(adam_beta1=0.8, adam_beta2=0.99, adam_epsilon=1e-6)
    optimizer = make_optimizer(config)
    assert isinstance(optimizer, keras.optimizers.Adam)
    assert (optimizer.beta_1, optimizer.beta_2, optimizer.epsilon) == (0.8, 0.99, 1e-6)
    assert optimizer.global_clipnorm is None and optimizer.clipnorm is None  # the trainer clips the global gradient


@pytest.mark.parametrize("field, value, message", [
    ("learning_rate", 0.0, "learning_rate"), ("min_lr_ratio", 1.5, "min_lr_ratio"), ("train_steps", 0, "train_steps"),
])
def test_bad_schedule_settings_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        learning_rate_schedule(TrainConfig(**{field: value}))
