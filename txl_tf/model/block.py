"""One Transformer-XL layer: relative attention over [memory, segment], then the position-wise feed-forward.

Shape glossary: B batch, L segment length, M memory length, K = M + L, d = d_model, F = d_inner.
"""

from __future__ import annotations

import keras

from txl_tf.model import projection
from txl_tf.model import tensor_ops as T
from txl_tf.model.attention import RelativeMultiHeadAttention
from txl_tf.model.dropout import Dropout
from txl_tf.model.policy import DEFAULT
from txl_tf.model.state import LayerMemory

if T.TENSORFLOW:
    from txl_tf.model import fused
else:
    fused = T.NoFusedKernels


def _in_graph() -> bool:
    """Whether the call is traced into a TensorFlow graph (where `tf.recompute_grad` applies); never off TensorFlow,
    whose layers recompute nothing yet."""
    if not T.TENSORFLOW:
        return False
    import tensorflow as tf

    return not tf.executing_eagerly()


@keras.saving.register_keras_serializable(package="txl_tf")
class PositionwiseFeedForward(keras.layers.Layer):
    """Dense(F, bias) -> ReLU -> dropout -> Dense(d, bias) -> dropout -> LayerNorm(x + out).

    With `pre_lnorm`: x + ffn(LayerNorm(x)) instead. With `kernels` (the training policy's), training calls run the
    bias, ReLU and dropout after the first matmul, and the residual LayerNorm, as fused CPU kernels
    (`txl_tf.model.fused`).

    Call args:
      inputs: [B, L, d]; training: dropout on/off.
      dropout_seeds: optional [2, 2] int32 from `draw_seeds()`: the seeds of the inner and the output dropout
        (the same seeds drop the same elements: a recomputed forward pass).

    Returns:
      [B, L, d].
    """

    def __init__(self, d_model, d_inner, dropout=0.0, pre_lnorm=False, layer_norm_epsilon=1e-12,
                 init_std=0.02, **kwargs):
        super().__init__(**kwargs)
        self.d_model = d_model
        self.d_inner = d_inner
        self.dropout = dropout
        self.pre_lnorm = pre_lnorm
        self.layer_norm_epsilon = layer_norm_epsilon
        self.init_std = init_std
        init = keras.initializers.RandomNormal(stddev=init_std)
        self.inner = keras.layers.Dense(d_inner, activation="relu", kernel_initializer=init, name="inner")
        self.outer = keras.layers.Dense(d_model, kernel_initializer=init, name="outer")
        self.inner_dropout = Dropout(dropout)
        self.output_dropout = Dropout(dropout)
        self.layer_norm = keras.layers.LayerNormalization(epsilon=layer_norm_epsilon, name="layer_norm")

    def build(self, input_shape=None):
        self.inner.build((None, None, self.d_model))
        self.outer.build((None, None, self.d_inner))
        self.layer_norm.build((None, None, self.d_model))
        super().build(input_shape)

    def draw_seeds(self):
        """[2, 2] int32: the seeds one training call's dropouts (inner, output) draw, each generator advanced as a
        call advances it; pass them as `dropout_seeds` to repeat that call's masks."""
        return T.stack([self.inner_dropout.draw()[0], self.output_dropout.draw()[0]])

    def call(self, inputs, training=None, dropout_seeds=None, kernels=False):
        seeds = (None, None) if dropout_seeds is None else (dropout_seeds[0], dropout_seeds[1])
        x = self.layer_norm(inputs) if self.pre_lnorm else inputs  # [B, L, d]
        # On [B*L, d] rows the dense layers are plain 2-D matmuls, which TensorFlow's grappler fuses with the
        # bias and ReLU into one oneDNN kernel (a rank-3 input goes through Tensordot's reshapes, which it cannot).
        rows = T.reshape(x, [-1, self.d_model])  # [B*L, d]
        kernels = fused.applies(kernels, rows.dtype, training)
        if kernels:  # bias, ReLU and dropout in one kernel each way
            seed, threshold, scale = self.inner_dropout.draw(seeds[0])
            hidden = fused.bias_relu_dropout(T.matmul(rows, T.cast(self.inner.kernel, rows.dtype)),
                                             self.inner.bias, seed, threshold, scale)  # [B*L, F]
        else:
            hidden = self.inner_dropout(self.inner(rows), training=training, seed=seeds[0])  # [B*L, F]
        out = self.output_dropout(self.outer(hidden), training=training, seed=seeds[1])  # [B*L, d]
        out = T.reshape(out, T.shape(inputs))  # [B, L, d]
        return inputs + out if self.pre_lnorm else fused.add_layer_norm(self.layer_norm, inputs, out, kernels)

    def row_kernels(self):
        """(inner, outer) as `projection.halves` for `decode_row` (computed once before a decoding loop), or None
        where a layer is quantized or of an odd width."""
        kernels = (projection.halves(self.inner, dtype=self.compute_dtype),
                   projection.halves(self.outer, dtype=self.compute_dtype))
        return None if any(k is None for k in kernels) else kernels

    def decode_row(self, inputs, row_kernels):
        """The inference call on one row [1, 1, d] (the decoding step at batch 1) with `row_kernels()`: both
        products as `projection.dense_row`."""
        dtype = self.compute_dtype
        inputs = T.cast(inputs, dtype)
        x = self.layer_norm(inputs) if self.pre_lnorm else inputs
        hidden = T.relu(projection.dense_row(x, row_kernels[0]) + T.cast(self.inner.bias, dtype))
        out = projection.dense_row(hidden, row_kernels[1]) + T.cast(self.outer.bias, dtype)
        return inputs + out if self.pre_lnorm else self.layer_norm(inputs + out)

    def get_config(self):
        return {
            **super().get_config(),
            "d_model": self.d_model,
            "d_inner": self.d_inner,
            "dropout": self.dropout,
            "pre_lnorm": self.pre_lnorm,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "init_std": self.init_std,
        }


@keras.saving.register_keras_serializable(package="txl_tf")
class TransformerXLBlock(keras.layers.Layer):
    """Relative multi-head attention + position-wise feed-forward (one layer of the stack).

    The position encoding (`txl_tf.model.encodings`, chosen by `attn_type`) may give the block weights and positions of
    its own: al_rfou's learned absolute positions [max_position, d], added to the block's memory and inputs (key
    position p gets row p, positions past the table its last row) before attention, as in Al-Rfou et al. (2018).

    Args: as `RelativeMultiHeadAttention` plus `d_inner` (feed-forward width).

    Call args: as `RelativeMultiHeadAttention` (the recurrent state is the attention's: `state`, a
      `txl_tf.model.state.LayerMemory` or `LayerCache` or None, with `mem_len` and `lengths`), without `input_positions`
      (al_rfou's come from this block), with `policy` (a `txl_tf.model.policy.TrainingPolicy`) instead of `kernels`:
      policy.recompute: training calls in a `tf.function` with the hidden-state memory (or none) keep for the
        backward pass only the block's inputs and recompute its activations there (`tf.recompute_grad`): less
        memory for one more forward pass of the block (`TrainConfig.recompute="block"`). The dropout seeds are
        drawn before and passed in, so the recomputation drops what the first pass dropped: outputs, new memory,
        gradients and the dropout generators' states are those of a plain call. Eager calls (where
        `tf.recompute_grad` does not see the variables the block reads) and inference run the plain call.
      policy.kernels: the fused CPU kernels in both sublayers' training calls.

    Returns:
      (outputs [B, L, d], new state) plus the attention probabilities [B, N, L, K] float32 when `return_probs`.
    """

    def __init__(self, d_model, n_head, d_head, d_inner, dropout=0.0, dropatt=0.0, attn_type="xl",
                 pre_lnorm=False, layer_norm_epsilon=1e-12, max_position=1024, init_std=0.02, **kwargs):
        super().__init__(**kwargs)
        self.d_model = d_model
        self.n_head = n_head
        self.d_head = d_head
        self.d_inner = d_inner
        self.dropout = dropout
        self.dropatt = dropatt
        self.attn_type = attn_type
        self.pre_lnorm = pre_lnorm
        self.layer_norm_epsilon = layer_norm_epsilon
        self.max_position = max_position
        self.init_std = init_std
        self.attention = RelativeMultiHeadAttention(
            d_model, n_head, d_head, dropout=dropout, dropatt=dropatt, attn_type=attn_type,
            pre_lnorm=pre_lnorm, layer_norm_epsilon=layer_norm_epsilon, max_position=max_position,
            init_std=init_std, name="attention",
        )
        self.feed_forward = PositionwiseFeedForward(
            d_model, d_inner, dropout=dropout, pre_lnorm=pre_lnorm, layer_norm_epsilon=layer_norm_epsilon,
            init_std=init_std, name="feed_forward",
        )

    def build(self, input_shape=None):
        self.attention.encoding.build_block(self)
        self.attention.build(input_shape)
        self.feed_forward.build(input_shape)
        super().build(input_shape)

    def initial_cache(self, batch_size, mem_len, max_len, position_encoding=None):
        """The attention's `LayerCache` of a zero memory (`RelativeMultiHeadAttention.initial_cache`)."""
        return self.attention.initial_cache(batch_size, mem_len, max_len, position_encoding)

    def call(self, inputs, state=None, *, mem_len=0, lengths=None, position_encoding=None, memory_positions=None,
             attention_bias=None, content_bias=None, position_bias=None, return_probs=False, training=None,
             policy=None):
        policy = policy or DEFAULT
        operands = dict(inputs=inputs, memory=state.hidden if isinstance(state, LayerMemory) else None,
                        position_encoding=position_encoding, memory_positions=memory_positions,
                        attention_bias=attention_bias, content_bias=content_bias, position_bias=position_bias)
        if (policy.recompute and training is True and not return_probs and _in_graph()
                and (state is None or isinstance(state, LayerMemory))):
            return self._recomputed(operands, mem_len, lengths, policy.kernels)
        return self._forward(operands, state, mem_len, lengths, return_probs, training, kernels=policy.kernels)

    def _forward(self, operands, state, mem_len, lengths, return_probs, training, seeds=None, kernels=False):
        """The block's call on `operands` (the call's tensors by name); `seeds`: [4, 2] int32, the dropout seeds
        of the attention (2) and the feed-forward (2), or None (each dropout draws its own); `kernels`: the
        policy's fused kernels."""
        inputs, memory_positions = operands["inputs"], operands["memory_positions"]
        mlen = 0 if state is None else state.mem_len
        own_memory, input_positions = self.attention.encoding.block_positions(self, T.shape(inputs)[1], mlen)
        if own_memory is not None or input_positions is not None:  # the block's own (al_rfou) replace the model's
            memory_positions = own_memory
        out = self.attention(
            inputs, state, mem_len=mem_len, lengths=lengths,
            position_encoding=operands["position_encoding"], memory_positions=memory_positions,
            input_positions=input_positions, attention_bias=operands["attention_bias"],
            content_bias=operands["content_bias"], position_bias=operands["position_bias"],
            return_probs=return_probs, training=training, dropout_seeds=None if seeds is None else seeds[:2],
            kernels=kernels,
        )
        hidden = self.feed_forward(out[0], training=training, dropout_seeds=None if seeds is None else seeds[2:],
                                   kernels=kernels)  # [B, L, d]
        return (hidden, *out[1:])

    def _recomputed(self, operands, mem_len, lengths, kernels):
        """A training call whose activations the backward pass recomputes: (outputs [B, L, d], new LayerMemory).

        Every tensor operand goes in as an argument of the recomputed function (tf.custom_gradient in a graph
        takes positional tensors only): the gradient reaches each of them, and the recomputation depends on the
        incoming gradient, so the graph optimisers cannot merge it with the first pass. The seeds go in as float64
        (exact for int32; a gradient tape watches floating tensors only).
        """
        import tensorflow as tf

        seeds = tf.concat([self.attention.draw_seeds(), self.feed_forward.draw_seeds()], axis=0)  # [4, 2]
        names = [name for name, value in operands.items() if value is not None]

        def forward(float_seeds, *values):
            given = dict.fromkeys(operands)
            given.update(zip(names, values, strict=True))
            state = None if given["memory"] is None else LayerMemory(given["memory"])
            hidden, new_state = self._forward(given, state, mem_len, lengths, False, True,
                                              tf.cast(float_seeds, tf.int32), kernels)
            return hidden, new_state.hidden

        values = [tf.convert_to_tensor(operands[name]) for name in names]
        hidden, new_memory = tf.recompute_grad(forward)(tf.cast(seeds, tf.float64), *values)
        return hidden, LayerMemory(new_memory)

    def get_config(self):
        return {
            **super().get_config(),
            "d_model": self.d_model,
            "n_head": self.n_head,
            "d_head": self.d_head,
            "d_inner": self.d_inner,
            "dropout": self.dropout,
            "dropatt": self.dropatt,
            "attn_type": self.attn_type,
            "pre_lnorm": self.pre_lnorm,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "max_position": self.max_position,
            "init_std": self.init_std,
        }
