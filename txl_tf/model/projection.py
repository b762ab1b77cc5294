"""The attention's projections as Keras layers, and the matmuls that apply them.

    projection(name, units, init_std)   a bias-free Dense (keras-hub's `enable_lora` and Keras' `quantize` reach it)
    project(x, *layers, dtype)          x through projections side by side: one matmul, or their own int8 calls
    kernel_of(*layers, dtype)           their float kernels side by side (LoRA's update included)
    quantized(*layers)                  whether any holds quantized weights
    dense(x, kernel)                    [B, T, I] @ [I, O] as one 2-D matmul
    halves(*layers, dtype)              their kernels in two half-width halves, for `dense_row` (decoding at batch 1)
    dense_row(x, halves)                one row [1, 1, I] through such halves: one batched matmul of two products

The attention (`txl_tf.model.attention`) and the encodings that own a projection (xl's W_R) use these.
"""

from __future__ import annotations

import keras

from txl_tf.model import tensor_ops as T


def dense(x, kernel):
    """[B, T, I] @ [I, O] -> [B, T, O] as one 2-D matmul (a rank-3 tf.matmul broadcasts the kernel over the
    batch, and its kernel gradient becomes a batched product plus a sum: much slower on CPU)."""
    shape = T.shape(x)
    out = T.matmul(T.reshape(x, [-1, x.shape[-1]]), kernel)  # [B*T, O]
    return T.reshape(out, T.joined_shape(shape[:-1], [kernel.shape[-1]]))


def projection(name, units, init_std):
    """One of the attention's projections: a bias-free `keras.layers.Dense` (so that keras-hub's `enable_lora`
    and Keras' `quantize` reach it), its kernel drawn from N(0, init_std)."""
    return keras.layers.Dense(units, use_bias=False, name=name,
                              kernel_initializer=keras.initializers.RandomNormal(stddev=init_std))


def quantized(*layers) -> bool:
    """Whether any of `layers` (Dense projections) holds quantized weights (`Model.quantize`)."""
    return any(getattr(layer, "quantization_mode", None) for layer in layers)


def project(x, *layers, dtype=None):
    """`x` [..., I] through the projections `layers` side by side -> [..., sum of their units] in `dtype`.

    Float projections are one 2-D matmul against their kernels (each kernel read through `Dense.kernel`, which
    adds LoRA's low-rank update when `enable_lora` is on); quantized ones run their own call (Keras' int8 path)
    on the rows.
    """
    dtype = dtype or x.dtype
    if quantized(*layers):
        rows = T.reshape(x, [-1, x.shape[-1]])  # [R, I]
        out = T.concat([T.cast(layer(rows), dtype) for layer in layers], axis=-1)  # [R, O]
        return T.reshape(out, T.joined_shape(T.shape(x)[:-1], [out.shape[-1]]))
    return dense(x, kernel_of(*layers, dtype=dtype))


def kernel_of(*layers, dtype):
    """The kernels of float projections `layers` side by side [I, sum of units] in `dtype` (LoRA included)."""
    kernels = [T.cast(layer.kernel, dtype) for layer in layers]
    return kernels[0] if len(kernels) == 1 else T.concat(kernels, axis=1)


def halves(*layers, dtype):
    """`kernel_of(layers)` [I, O] as [2, I, O/2] (columns 0 .. O/2 - 1, then the rest), for `dense_row`; None
    where a layer is quantized (its own call runs) or O is odd.

    Computed once before a decoding loop, not in it: XLA did not hoist the transpose out of the loop (every
    kernel was copied at every token).
    """
    if quantized(*layers):
        return None
    kernel = kernel_of(*layers, dtype=dtype)
    inputs, outputs = kernel.shape
    if outputs % 2:
        return None
    return T.transpose(T.reshape(kernel, [inputs, 2, outputs // 2]), [1, 0, 2])


def dense_row(x, split):
    """One row `x` [1, 1, I] @ the kernel `split` [2, I, O/2] was made from (`halves`) -> [1, 1, O].

    The two half-width products run as one batched matmul, which XLA's CPU backend spreads over its thread pool,
    where it runs a single matrix-vector product as one thread's loop: at batch 1 a decoding step's projections
    and feed-forward read their weights at about twice the rate (`scripts/benchmark_inference.py`'s batch-1
    decoding; docs/evaluation.md#serving-speed).
    """
    inputs = split.shape[1]
    out = T.matmul(T.broadcast_to(T.reshape(x, [1, 1, inputs]), [2, 1, inputs]), split)  # [2, 1, O/2]
    return T.reshape(out, [1, 1, 2 * split.shape[2]])  # the halves side by side
