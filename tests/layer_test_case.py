"""Shared checks every txl_tf layer must pass: config round trip, registered serialization, same outputs after
copying weights, one training step that moves every trainable weight, and a mixed_bfloat16 call.

`make_layer(**overrides)` builds the layer; `call(layer, training)` calls it on fixed inputs and returns the
tensor that the checks compare and differentiate.
"""

import os
import tempfile

import keras
import numpy as np
import tensorflow as tf


@keras.saving.register_keras_serializable(package="txl_tf_tests")
class LayerHolder(keras.Model):
    """A model around one layer, so the layer goes through a real `.keras` file (config + weights)."""

    def __init__(self, layer, **kwargs):
        super().__init__(**kwargs)
        if isinstance(layer, dict):
            layer = keras.saving.deserialize_keras_object(layer)
        self.layer = layer
        self.built = layer.built

    def call(self, *args, **kwargs):
        return self.layer(*args, **kwargs)

    def get_config(self):
        return {**super().get_config(), "layer": keras.saving.serialize_keras_object(self.layer)}


def check_config_round_trip(layer):
    config = layer.get_config()
    clone = layer.__class__.from_config(config)
    assert clone.get_config() == config
    # The registered name ("txl_tf>ClassName") lets Keras files find the class again.
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer))
    assert type(restored) is type(layer)
    assert restored.get_config() == config
    return clone


def check_same_outputs_after_weight_copy(layer, clone, call):
    expected = call(layer, False)
    call(clone, False)  # builds the clone
    clone.set_weights(layer.get_weights())
    np.testing.assert_allclose(call(clone, False), expected, rtol=1e-6, atol=1e-6)


def check_keras_file_round_trip(layer, call):
    """`model.save` / `keras.models.load_model` of a model holding the layer keeps config and outputs."""
    expected = call(layer, False)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "layer.keras")
        LayerHolder(layer).save(path)
        restored = keras.models.load_model(path).layer
    assert type(restored) is type(layer) and restored.get_config() == layer.get_config()
    np.testing.assert_allclose(call(restored, False), expected, rtol=1e-6, atol=1e-6)


def check_training_step(layer, call, lr=1e-2):
    """One SGD step on a fixed random projection of the output (sum(out**2) is flat behind a LayerNorm):
    every trainable weight gets a finite, non-zero gradient and moves."""
    with tf.GradientTape() as tape:
        out = tf.cast(call(layer, True), tf.float32)
        loss = tf.reduce_sum(out * tf.random.stateless_normal(tf.shape(out), seed=[1, 2]))
    weights = layer.trainable_weights
    grads = tape.gradient(loss, weights)
    for weight, grad in zip(weights, grads, strict=True):
        assert grad is not None, f"no gradient for {weight.path}"
        grad = tf.convert_to_tensor(grad)
        assert np.all(np.isfinite(grad)), weight.path
        assert np.any(grad.numpy() != 0), f"zero gradient for {weight.path}"
    before = [w.numpy().copy() for w in weights]
    for weight, grad in zip(weights, grads, strict=True):
        weight.assign_sub(lr * tf.convert_to_tensor(grad))
    assert all(np.any(w.numpy() != b) for w, b in zip(weights, before, strict=True))


def check_mixed_precision(make_layer, call):
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        layer = make_layer()
        out = call(layer, False)
    finally:
        keras.config.set_dtype_policy(previous)
    assert all(w.dtype == "float32" for w in layer.weights), "variables must stay float32"
    assert np.all(np.isfinite(tf.cast(out, tf.float32).numpy()))
    return out


def run_layer_checks(make_layer, call, mixed_dtype=tf.bfloat16):
    """All shared checks; returns the float32 layer for further layer-specific assertions."""
    layer = make_layer()
    call(layer, False)
    clone = check_config_round_trip(layer)
    check_same_outputs_after_weight_copy(layer, clone, call)
    check_keras_file_round_trip(layer, call)
    check_training_step(layer, call)
    out = check_mixed_precision(make_layer, call)
    if mixed_dtype is not None:
        assert out.dtype == mixed_dtype, out.dtype
    return layer
