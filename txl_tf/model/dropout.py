"""Dropout that draws 16 random bits per element instead of one float32 uniform.

`keras.layers.Dropout` draws a float uniform per element, then compares, selects and scales in separate
passes; on CPU that costs about 3x more than the matmuls it follows in the feed-forward layer under bf16.
Here one 32-bit Philox draw serves two elements (bitcast to two uint16), an element is dropped when its 16
bits fall below round(rate * 65536) (drop probability within 1e-5 of `rate`), and kept elements are scaled by
1 / (1 - rate), so the expectation is unchanged.

A training call with `kernels=True` (the training policy's, `TrainConfig.kernels="fused"`) runs the same rule as
one kernel (`txl_tf.model.fused`: `TxlDropout`, which draws the mask again in the backward pass instead of keeping it);
its bits come from another Philox stream, so the masks differ from the TensorFlow ops' ones, with the same drop
probability.

On JAX and PyTorch the same rule draws its 16 bits per element as an integer in [0, 65536) from `keras.random`
(`randint` with the layer's `SeedGenerator`; the rule, the rate and the scaling are the same, the stream another one,
and the same seed gives the same mask).
"""

from __future__ import annotations

import keras

from txl_tf.model import tensor_ops as T

if T.TENSORFLOW:
    import tensorflow as tf

    from txl_tf.model import fused

_LEVELS = 1 << 16


@keras.saving.register_keras_serializable(package="txl_tf")
class Dropout(keras.layers.Layer):
    """Inverted dropout with a Keras `SeedGenerator` (reproducible with `keras.utils.set_random_seed`).

    Args:
      rate: fraction of elements to drop, in [0, 1).
      seed: optional int seed of this layer's generator.

    Call args:
      inputs: any shape; training: drop only when true.
      seed: optional [2] int32 from `draw()`: drop with it instead of drawing a new one (the same seed drops the
        same elements: a recomputed forward pass of `TransformerXLBlock` repeats the first one's).
      kernels: a training call uses the fused CPU kernel (`txl_tf.model.fused`), whose masks differ from TensorFlow's
        ops' ones (see the module docstring): `txl_tf.model.policy.TrainingPolicy.kernels`.

    Returns:
      `inputs` with dropped elements zeroed and the rest scaled by 1 / (1 - rate).
    """

    def __init__(self, rate, seed=None, **kwargs):
        super().__init__(**kwargs)
        if not 0.0 <= rate < 1.0:
            raise ValueError(f"dropout rate must be in [0, 1), got {rate}")
        self.rate = rate
        self.seed = seed
        self.threshold = round(rate * _LEVELS)
        self.seed_generator = keras.random.SeedGenerator(seed) if self.threshold > 0 else None
        self.built = True  # no weights (Keras' quantize() walks every layer and asks each to be built)

    def draw(self, seed=None):
        """(seed [2] int32, threshold, scale) of one training call, for kernels that drop as this layer does
        (`txl_tf.model.fused`); with rate 0, threshold 0 and scale 1 (nothing dropped). A `seed` given (one this
        method returned before) is returned as it is and the generator does not advance."""
        if self.seed_generator is None:
            return T.zeros([2], T.int32), 0, 1.0
        if not T.TENSORFLOW:  # the backend's own seed (JAX: uint32), as keras.random takes it
            return self.seed_generator.next() if seed is None else seed, self.threshold, 1.0 / (1.0 - self.rate)
        seed = T.cast(self.seed_generator.next(), T.int32) if seed is None else T.cast(seed, T.int32)
        return seed, self.threshold, 1.0 / (1.0 - self.rate)

    def call(self, inputs, training=False, seed=None, kernels=False):
        if not training or self.seed_generator is None:
            return inputs
        seed, threshold, scale = self.draw(seed)
        if not T.TENSORFLOW:  # keras.random's stream: 16 bits per element as an integer in [0, 65536)
            if T.BACKEND == "torch":  # keras.random takes an int or a SeedGenerator there: the seed's two words
                first, second = (int(word) for word in keras.ops.convert_to_numpy(seed))
                seed = (first * 1_000_003 + second) & 0x7FFFFFFF
            bits = keras.random.randint(T.shape(inputs), 0, _LEVELS, dtype="int32", seed=seed)
            return T.where(bits >= threshold, inputs * T.cast(scale, inputs.dtype), T.zeros((), inputs.dtype))
        if fused.applies(kernels, inputs.dtype, training):  # draw, compare and scale in one pass
            return fused.dropout(inputs, seed, threshold, scale)
        shape = tf.shape(inputs)
        size = tf.size(inputs)
        bits = tf.random.stateless_uniform([(size + 1) // 2], seed, dtype=tf.int32, minval=None, maxval=None)
        bits = tf.slice(tf.reshape(tf.bitcast(bits, tf.uint16), [-1]), [0], [size])  # [size] uint16
        keep = tf.reshape(bits >= threshold, shape)
        return tf.where(keep, inputs * tf.cast(scale, inputs.dtype), tf.zeros((), inputs.dtype))

    def get_config(self):
        return {**super().get_config(), "rate": self.rate, "seed": self.seed}
