"""The 16-bit dropout: drop rate, scaling, identity at inference, reproducibility, layer contract."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from layer_test_case import check_config_round_trip

from txl_tf.model.dropout import Dropout


def test_rate_and_scaling():
    keras.utils.set_random_seed(3)
    layer = Dropout(0.1)
    x = tf.ones([7, 1001])  # odd size: the last 32-bit draw is only half used
    out = layer(x, training=True).numpy()
    dropped = (out == 0).mean()
    assert abs(dropped - 0.1) < 0.005, dropped  # 7007 elements: std of the rate ~0.0036
    np.testing.assert_allclose(out[out != 0], 1 / 0.9, rtol=1e-6)
    assert np.array_equal(layer(x, training=False).numpy(), x.numpy())
    # a fresh draw every call
    assert not np.array_equal(out, layer(x, training=True).numpy())


def test_bfloat16_and_reproducible():
    keras.utils.set_random_seed(5)
    first = Dropout(0.5, dtype="mixed_bfloat16")(tf.ones([3, 5, 4], tf.bfloat16), training=True)
    keras.utils.set_random_seed(5)
    second = Dropout(0.5, dtype="mixed_bfloat16")(tf.ones([3, 5, 4], tf.bfloat16), training=True)
    assert first.dtype == tf.bfloat16
    np.testing.assert_array_equal(first.numpy(), second.numpy())
    assert set(np.unique(first.numpy().astype(np.float32))) <= {0.0, 2.0}


def test_zero_rate_config_and_errors():
    x = tf.random.normal([2, 3])
    assert Dropout(0.0)(x, training=True) is x
    check_config_round_trip(Dropout(0.2, seed=4))
    with pytest.raises(ValueError, match="rate"):
        Dropout(1.0)
