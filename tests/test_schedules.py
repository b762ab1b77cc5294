"""txl_tf.training.schedules: the learning rate against the formula of the original scripts, and the Adam settings."""

import math

import keras
import numpy as np
import pytest

from txl_tf.base.errors import ConfigError
from txl_tf.configs import TrainConfig
from txl_tf.training.schedules import learning_rate_schedule, make_optimizer


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
    ("learning_rate", 0.0, "learning_rate=0.0 must be > 0"),
    ("min_lr_ratio", 1.5, r"min_lr_ratio=1.5 must be in \[0, 1\]"),
    ("train_steps", 0, r"train_steps=0 must be in \[1, \d+\]"),
    ("warmup_steps", -1, r"warmup_steps=-1 must be in \[0, \d+\]"),
])
def test_bad_schedule_settings_name_the_field(field, value, message):
    """The schedule's settings are checked once, when the TrainConfig is made: no schedule is built from them."""
    with pytest.raises(ConfigError, match=f"^TrainConfig.{message}; fix the binding"):
        TrainConfig(**{field: value})


def _adam_run(optimizer_class, strategy, indices, steps=4):
    """`steps` Adam updates of a dense weight and of an embedding read with tf.gather (IndexedSlices gradient)."""
    import tensorflow as tf

    with strategy.scope():
        weight = keras.Variable(np.arange(6, dtype=np.float32).reshape(2, 3) / 7, name="weight")
        table = keras.Variable(np.linspace(-1, 1, 15, dtype=np.float32).reshape(5, 3), name="table")
        optimizer = optimizer_class(learning_rate=0.01, beta_1=0.8, beta_2=0.95, epsilon=1e-6)
        optimizer.build([weight, table])

    @tf.function
    def step(i):
        def replica():
            with tf.GradientTape() as tape:
                scale = tf.cast(i + 1, tf.float32)
                loss = tf.reduce_sum(tf.sin(weight.value * scale)) + tf.reduce_sum(
                    tf.gather(table.value, indices) ** 2 * scale)
            grads = tape.gradient(loss, [weight.value, table.value])
            optimizer.apply_gradients(zip(grads, [weight, table], strict=True))
        strategy.run(replica)

    for i in range(steps):
        step(i)
    return weight.numpy(), table.numpy(), int(optimizer.iterations.numpy())


def _numpy_adam(indices, replicas=1, steps=4, lr=0.01, b1=0.8, b2=0.95, eps=1e-6):
    """The same updates written out with dense gradients (repeated rows summed, as tf.compat.v1 Adam does),
    summed over `replicas` that each compute the same loss."""
    weight = np.arange(6, dtype=np.float64).reshape(2, 3) / 7
    table = np.linspace(-1, 1, 15).reshape(5, 3)
    state = {name: [0.0, 0.0] for name in ("weight", "table")}
    for i in range(steps):
        scale = i + 1
        grads = {"weight": replicas * np.cos(weight * scale) * scale, "table": np.zeros_like(table)}
        for row in indices:
            grads["table"][row] += replicas * 2 * table[row] * scale
        for name, value in (("weight", weight), ("table", table)):
            m, v = state[name]
            m = m + (grads[name] - m) * (1 - b1)
            v = v + (grads[name] ** 2 - v) * (1 - b2)
            state[name] = [m, v]
            t = i + 1
            value -= lr * np.sqrt(1 - b2**t) / (1 - b1**t) * m / (np.sqrt(v) + eps)
    return weight, table


def test_fused_adam_is_keras_adam_in_one_kernel():
    import tensorflow as tf

    from txl_tf.training.schedules import FusedAdam

    strategy = tf.distribute.get_strategy()
    keras_weight, keras_table, keras_steps = _adam_run(keras.optimizers.Adam, strategy, [0, 2, 3])
    fused_weight, fused_table, fused_steps = _adam_run(FusedAdam, strategy, [0, 2, 3])
    np.testing.assert_allclose(fused_weight, keras_weight, rtol=0, atol=1e-6)
    np.testing.assert_allclose(fused_table, keras_table, rtol=0, atol=1e-6)
    assert fused_steps == keras_steps == 4
    assert isinstance(make_optimizer(TrainConfig()), FusedAdam)


def test_fused_adam_sums_repeated_rows_before_squaring_on_one_or_two_replicas():
    """A gathered row used twice (or by two replicas) gets the update of its summed gradient, as tf.compat.v1's
    Adam and a dense gradient give; Keras's own Adam squares each occurrence of an IndexedSlices row apart."""
    import tensorflow as tf

    from txl_tf.training.schedules import FusedAdam

    expected_weight, expected_table = _numpy_adam([0, 2, 2])
    weight, table, _ = _adam_run(FusedAdam, tf.distribute.get_strategy(), [0, 2, 2])
    np.testing.assert_allclose(weight, expected_weight, rtol=0, atol=2e-6)
    np.testing.assert_allclose(table, expected_table, rtol=0, atol=2e-6)
    from txl_tf.training import distribute

    # tests/conftest.py splits the CPU into 2 logical devices; make_strategy keeps one MirroredStrategy per device
    # set (separate instances number their collectives alike and break each other's all-reduces).
    mirrored = distribute.make_strategy("mirrored")
    if mirrored.num_replicas_in_sync == 2:
        two_weight, two_table, _ = _adam_run(FusedAdam, mirrored, [0, 2, 3])
        # Each replica adds its gradient (the all-reduce concatenates the IndexedSlices of both).
        expected_weight, expected_table = _numpy_adam([0, 2, 3], replicas=2)
        np.testing.assert_allclose(two_weight, expected_weight, rtol=0, atol=2e-6)
        np.testing.assert_allclose(two_table, expected_table, rtol=0, atol=2e-6)
