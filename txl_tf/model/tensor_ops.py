"""The tensor operations of the model's layers, on whichever Keras backend the process runs.

On TensorFlow each name here *is* TensorFlow's own function (`tensor_ops.cast is tf.cast`, tested): the layers'
graphs, their speed and their numbers stay those of TensorFlow's ops, flags included (a matmul's transpose flags,
`tf.slice`, whose gradient is a fast Pad where a strided slice's is slow on CPU, dynamic shapes). On JAX and
PyTorch each is the `keras.ops` operation of the same meaning, and shapes are static: `shape(x)` is `x.shape`.

    BACKEND, TENSORFLOW          the process's Keras backend (fixed when Keras is imported)
    int32, float32, ...          dtypes (TensorFlow's objects, or their names)
    cast, constant, reshape, transpose, concat, split, matmul, where, zeros, zeros_like, arange, sin, cos, minimum,
    maximum, gather, clip_by_value, broadcast_to, stack, unstack, pad, slice, stop_gradient, softmax, log_softmax,
    sparse_softmax_cross_entropy_with_logits, convert_to_tensor, expand_dims, einsum, repeat, tile, roll, equal,
    reduce_all, relu, map_structure (tf.nest's, or keras.tree's)
                                 TensorFlow's signatures, keyword names included
    shape(x)                     tf.shape(x) (a tensor), or the static shape (a tuple of ints)
    size(x)                      tf.size(x), or the static element count
    dim(x, axis)                 the size of one axis: a Python int where the shape knows it, else a scalar tensor
    joined_shape(a, b)           two pieces of a shape as one: tf.concat([a, b], 0), or a tuple
    batch_gather, invert_permutation, cond, ensure_shape
                                 tf.gather(batch_dims=1), tf.math.invert_permutation, tf.cond, tf.ensure_shape
    concrete(x)                  whether x holds numbers now (eager), not a value being traced (tf.function, jax.jit)
    NoFusedKernels               what the layers see of the fused CPU kernels off TensorFlow: none applies

Only what the ported layers call is here; TensorFlow-only parts (the fused CPU kernels, `tf.custom_gradient`,
SavedModel signatures) stay behind `TENSORFLOW` in the modules that use them.
"""

from __future__ import annotations

import math

import keras

BACKEND = keras.backend.backend()
TENSORFLOW = BACKEND == "tensorflow"

if TENSORFLOW:
    import tensorflow as tf

    int32, int64, uint16, float32, float64 = tf.int32, tf.int64, tf.uint16, tf.float32, tf.float64
    cast = tf.cast
    constant = tf.constant
    reshape = tf.reshape
    transpose = tf.transpose
    concat = tf.concat
    split = tf.split
    matmul = tf.matmul
    where = tf.where
    zeros = tf.zeros
    zeros_like = tf.zeros_like
    arange = tf.range
    sin = tf.sin
    cos = tf.cos
    minimum = tf.minimum
    maximum = tf.maximum
    gather = tf.gather
    clip_by_value = tf.clip_by_value
    broadcast_to = tf.broadcast_to
    stack = tf.stack
    unstack = tf.unstack
    convert_to_tensor = tf.convert_to_tensor
    expand_dims = tf.expand_dims
    einsum = tf.einsum
    repeat = tf.repeat
    tile = tf.tile
    roll = tf.roll
    equal = tf.equal
    reduce_all = tf.reduce_all
    relu = tf.nn.relu
    map_structure = tf.nest.map_structure
    cond = tf.cond
    ensure_shape = tf.ensure_shape
    invert_permutation = tf.math.invert_permutation

    def batch_gather(params, indices, axis):
        """out[b, ..., k, ...] = params[b, ..., indices[b, k], ...] along `axis` (the batch on axis 0)."""
        return tf.gather(params, indices, axis=axis, batch_dims=1)
    pad = tf.pad
    slice = tf.slice  # noqa: A001 (TensorFlow's name)
    stop_gradient = tf.stop_gradient
    softmax = tf.nn.softmax
    log_softmax = tf.nn.log_softmax
    sparse_softmax_cross_entropy_with_logits = tf.nn.sparse_softmax_cross_entropy_with_logits
    shape = tf.shape
    size = tf.size

    def joined_shape(first, second):
        """Two pieces of a shape (tensors or lists of ints) as one shape tensor."""
        return tf.concat([first, second], 0)

    def concrete(x) -> bool:
        return not tf.is_symbolic_tensor(x)

else:
    from keras import ops

    int32, int64, uint16, float32, float64 = "int32", "int64", "uint16", "float32", "float64"
    cast = ops.cast
    where = ops.where
    sin = ops.sin
    cos = ops.cos

    def minimum(x, y):  # of two static sizes: a Python int, as slicing needs under a compiler
        return min(x, y) if isinstance(x, int) and isinstance(y, int) else ops.minimum(x, y)

    def maximum(x, y):
        return max(x, y) if isinstance(x, int) and isinstance(y, int) else ops.maximum(x, y)

    def cond(pred, true_fn, false_fn):
        return ops.cond(pred, true_fn, false_fn)

    def ensure_shape(x, shape):
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"shape {tuple(x.shape)} is not {tuple(shape)}")
        return x

    def invert_permutation(perm):
        inverse = [0] * len(perm)
        for i, p in enumerate(perm):
            inverse[p] = i
        return inverse

    def batch_gather(params, indices, axis):
        """out[b, ..., k, ...] = params[b, ..., indices[b, k], ...] along `axis` (the batch on axis 0)."""
        index = ops.reshape(indices, (indices.shape[0],) + (1,) * (axis - 1) + (indices.shape[1],)
                            + (1,) * (len(params.shape) - axis - 1))
        target = list(params.shape)
        target[axis] = indices.shape[1]
        return ops.take_along_axis(params, ops.broadcast_to(index, target), axis=axis)
    broadcast_to = ops.broadcast_to
    stop_gradient = ops.stop_gradient

    def constant(value, dtype=None):
        return ops.convert_to_tensor(value, dtype=dtype)

    def shape(x):
        return tuple(x.shape)

    def size(x):
        return math.prod(x.shape)

    def joined_shape(first, second):
        return (*first, *second)

    def concrete(x) -> bool:
        if BACKEND == "jax":
            import jax

            return not isinstance(x, jax.core.Tracer)
        return True  # PyTorch runs eagerly

    def reshape(x, new_shape):
        return ops.reshape(x, tuple(int(s) for s in new_shape))

    def transpose(x, perm=None):
        return ops.transpose(x, axes=perm)

    def concat(values, axis):
        return ops.concatenate(list(values), axis=axis)

    def stack(values, axis=0):
        return ops.stack(list(values), axis=axis)

    def unstack(value, num=None, axis=0):
        return ops.unstack(value, num=num, axis=axis)

    def convert_to_tensor(value, dtype=None):
        return ops.convert_to_tensor(value, dtype=dtype)

    expand_dims = ops.expand_dims
    einsum = ops.einsum
    equal = ops.equal
    relu = ops.relu
    map_structure = keras.tree.map_structure

    def repeat(x, repeats, axis=None):
        return ops.repeat(x, repeats, axis=axis)

    def tile(x, multiples):
        return ops.tile(x, multiples)

    def roll(x, shift, axis):
        return ops.roll(x, shift, axis=axis)

    def reduce_all(x, axis=None):
        return ops.all(x, axis=axis)

    def split(x, num_or_size_splits, axis=0):
        if isinstance(num_or_size_splits, int):
            return ops.split(x, num_or_size_splits, axis=axis)
        points = [sum(num_or_size_splits[:i]) for i in range(1, len(num_or_size_splits))]
        return ops.split(x, points, axis=axis)

    def matmul(a, b, transpose_a=False, transpose_b=False):
        if transpose_a:
            a = ops.swapaxes(a, -1, -2)
        if transpose_b:
            b = ops.swapaxes(b, -1, -2)
        return ops.matmul(a, b)

    def zeros(shape, dtype=float32):
        return ops.zeros(tuple(shape), dtype=dtype)

    def zeros_like(x, dtype=None):
        return ops.zeros_like(x, dtype=dtype)

    def arange(start, limit=None, delta=1, dtype=None):
        if limit is None:
            start, limit = 0, start
        return ops.arange(start, limit, delta, dtype=dtype or ("float32" if isinstance(delta, float) else "int32"))

    def gather(params, indices, axis=0):
        return ops.take(params, indices, axis=axis)

    def clip_by_value(x, clip_value_min, clip_value_max):
        return ops.clip(x, clip_value_min, clip_value_max)

    def pad(x, paddings, constant_values=0):
        return ops.pad(x, [list(p) for p in paddings], constant_values=constant_values)

    def slice(x, begin, size):  # noqa: A001 (TensorFlow's name)
        x = ops.convert_to_tensor(x)  # a keras.Variable too
        size = [x.shape[i] - b if s == -1 else s for i, (b, s) in enumerate(zip(begin, size, strict=True))]
        return ops.slice(x, list(begin), size)

    def softmax(logits, axis=-1):
        return ops.softmax(logits, axis=axis)

    def log_softmax(logits, axis=-1):
        return ops.log_softmax(logits, axis=axis)

    def sparse_softmax_cross_entropy_with_logits(labels, logits):
        picked = ops.take_along_axis(ops.log_softmax(logits, axis=-1), ops.expand_dims(labels, -1), axis=-1)
        return -ops.squeeze(picked, -1)


def dim(x, axis: int):
    """The size of `axis`: a Python int when the static shape knows it, else a scalar tensor (TensorFlow's
    dynamic sizes; off TensorFlow shapes are static)."""
    static = x.shape[axis]
    return static if static is not None else shape(x)[axis]


class NoFusedKernels:
    """`txl_tf.model.fused`'s interface where its kernels cannot exist (a backend other than TensorFlow): no call
    applies them, and the post-norm residual is the LayerNorm layer itself."""

    @staticmethod
    def applies(enabled, dtype, training) -> bool:
        return False

    @staticmethod
    def add_layer_norm(norm, x, residual, kernels):
        return norm(x + residual)
