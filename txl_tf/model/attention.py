"""Relative multi-head attention of Transformer-XL (section 3.3, Appendix B) and the ablation variants.

Shape glossary:
  B batch, L query (segment) length, M memory length, K = M + L key length,
  N heads, D head width, d = d_model.
Query i (0 <= i < L) sits at key position M + i; key j (0 <= j < K) is at distance M + i - j from it.
The relative position matrix R has one row per key in DESCENDING distance: row k encodes distance K-1-k.

The scores are (q_i + u).k_j + (q_i + v).r_{i-j} + bias_{i,j}, each part given by the position encoding the layer
holds (`txl_tf.model.encodings`: one module per encoding): u and v (xl's), the position rows r (xl's W_R R, shaw's
learned table), a rotation of q and k (rope), an additive bias (alibi's penalty, with the causal mask), or
nothing (vaswani and al_rfou add absolute positions to the inputs instead). The relative term is computed for all
queries against all K rows of r with one matmul and aligned with `rel_shift` (Appendix B), never by
materialising r_{i-j} per (i, j) pair.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, NamedTuple

import keras

from txl_tf.model import encodings
from txl_tf.model import tensor_ops as T
from txl_tf.model.dropout import Dropout
from txl_tf.model.projection import (
    dense,
    dense_row,
    halves,
    kernel_of,
    project,
    projection,
    quantized,
)
from txl_tf.model.state import LayerCache, LayerMemory, check_type

if T.TENSORFLOW:
    import tensorflow as tf

    from txl_tf.model import fused
else:
    fused = T.NoFusedKernels

# Whether calls traced now add TensorFlow's runtime asserts (tf.debugging.assert_*): not in a function XLA
# compiles, which drops every Assert op with a warning line each time it compiles (`without_runtime_asserts`).
_RUNTIME_ASSERTS = contextvars.ContextVar("txl_tf_runtime_asserts", default=True)


@contextlib.contextmanager
def without_runtime_asserts():
    """Traces without runtime asserts, for a function XLA compiles: what it would check is checked where the
    shapes are known when traced, and the rest the caller has checked before (generate's lengths)."""
    token = _RUNTIME_ASSERTS.set(False)
    try:
        yield
    finally:
        _RUNTIME_ASSERTS.reset(token)

ATTN_TYPES = encodings.NAMES
MASK_VALUE = -1e30  # the TF original's value for blocked scores


def rel_shift(x):
    """Aligns scores against R rows (descending distance) with the keys (Appendix B).

    Args:
      x: [..., L, K] where x[..., i, k] scores query i against R row k (distance K-1-k).

    Returns:
      [..., L, K] where out[..., i, j] = x[..., i, j + L - 1 - i]: the score of query i against the row whose
      distance is M + i - j, i.e. the distance to key j. Entries with j > M + i (right of the causal diagonal)
      are garbage and must be masked.
    """
    rank = len(x.shape)
    return shift_padded(T.pad(x, [[0, 0]] * (rank - 1) + [[1, 0]]))  # a zero column in front


def shift_padded(x):
    """`rel_shift` of scores that already carry the zero column in front: [..., L, K+1] -> [..., L, K].

    The attention gets that column for free from its matmul by padding R with a zero row, saving a copy of
    the [..., L, K] scores (and its gradient).
    """
    shape = T.shape(x)
    qlen, klen = shape[-2], shape[-1] - 1
    batch = shape[:-2]
    rank = len(x.shape)
    x = T.reshape(x, T.joined_shape(batch, [klen + 1, qlen]))  # [..., K+1, L]
    # Drop the first row. tf.slice, not x[..., 1:, :]: the gradient of Slice is a fast Pad, while the strided
    # slice's gradient (StridedSliceGrad) is ~50x slower on CPU at these sizes.
    x = T.slice(x, [0] * (rank - 2) + [1, 0], [-1] * rank)  # [..., K, L]
    return T.reshape(x, T.joined_shape(batch, [qlen, klen]))  # [..., L, K]


def attention_bias(qlen, mlen, same_length=False, same_length_keys="tf", mem_len=None, dtype=T.float32):
    """Additive mask [L, K]: 0 where query i may attend key j, MASK_VALUE where it may not.

    Blocked: keys in the future (j > M + i). With `same_length`, also keys too far in the past so every query
    sees the same number of keys: "tf" (the TF original) keeps keys M+i-M .. M+i (M + 1 keys); "pytorch" (the
    PyTorch original) keeps the last `mem_len` keys up to M + i.
    """
    klen = mlen + qlen
    query_pos = T.arange(qlen)[:, None] + mlen  # [L, 1]: absolute key position of query i
    key_pos = T.arange(klen)[None, :]  # [1, K]
    blocked = key_pos > query_pos  # [L, K]
    if same_length:
        if same_length_keys == "tf":
            window = mlen + 1
        elif same_length_keys == "pytorch":
            if mem_len is None:
                raise ValueError("same_length_keys='pytorch' needs mem_len")
            window = mem_len
        else:
            raise ValueError(f"same_length_keys must be 'tf' or 'pytorch', got {same_length_keys!r}")
        blocked |= key_pos <= query_pos - window
    return T.where(blocked, T.constant(MASK_VALUE, dtype), T.constant(0.0, dtype))  # [L, K]


def memory_mask(memory_lengths, mlen, qlen, dtype=T.float32):
    """Additive mask [1, B, 1, K] of a memory whose row b holds memory_lengths[b] real positions, its last ones:
    MASK_VALUE on the other memory keys (a memory that starts empty, as the authors' PyTorch code starts it, rather
    than as zeros that every query attends to, as their TF code does), 0 on the rest and on the segment's keys.
    Added to `attention_bias`'s [L, K] (or an encoding's [N, 1, L, K]) it broadcasts over the scores [N, B, L, K].
    """
    keys = T.arange(mlen + qlen)[None, :]  # [1, K]
    first = mlen - T.clip_by_value(T.cast(memory_lengths, "int32"), 0, mlen)[:, None]  # [B, 1]: first real key
    mask = T.where(keys >= first, T.constant(0.0, dtype), T.constant(MASK_VALUE, dtype))  # [B, K]
    return mask[None, :, None, :]


def keep_last(memory, new, mem_len, lengths=None, axis=1):
    """The recurrent state's update: the last `mem_len` positions of concat([memory, new]) along `axis`, gradient
    stopped (the authors' `_cache_mem`).

    Args:
      memory: [..., M, ...] or None (M = 0); new: [..., L, ...]; time on `axis`, the batch on `axis - 1` (hidden
        memory [B, T, d]: axis 1; cached keys [N, B, T, D]: axis 2).
      lengths: optional [B] int32: row b's new positions from lengths[b] on are padding (prompts of different
        lengths in one batch) and are not kept, so row b's window ends after its own last token. Needs a memory
        of mem_len positions already (`TransformerXL.initial_memory` / `initial_cache`).

    Returns:
      [..., min(mem_len, M + L), ...].
    """
    cat = new if memory is None else T.concat([T.cast(memory, new.dtype), new], axis=axis)  # [..., M + L, ...]
    return keep_window(cat, T.shape(new)[axis], mem_len, lengths, axis)


def keep_window(cat, new_len, mem_len, lengths=None, axis=1):
    """`keep_last` of an already concatenated [memory, new] `cat` whose last `new_len` positions are new."""

    def last():
        start = T.maximum(T.shape(cat)[axis] - mem_len, 0)
        return cat[(slice(None),) * axis + (slice(start, None),)]

    if lengths is None:
        return T.stop_gradient(last())
    if axis < 1:
        raise ValueError("keep_last with lengths needs a batch axis before the time axis")
    lengths = T.cast(lengths, T.int32)
    keep = T.minimum(T.shape(cat)[axis], mem_len)

    def per_row():
        first = lengths + (T.shape(cat)[axis] - new_len) - keep  # [B]
        index = T.maximum(first[:, None] + T.arange(keep)[None, :], 0)  # [B, keep]
        if axis == 1:
            return T.batch_gather(cat, index, axis=axis)
        # tf.gather's batch_dims counts leading axes: move the batch to the front and back.
        perm = [axis - 1] + [a for a in range(len(cat.shape)) if a != axis - 1]
        kept = T.batch_gather(T.transpose(cat, perm), index, axis=axis)
        return T.transpose(kept, T.invert_permutation(perm))

    full = T.reduce_all(T.equal(lengths, new_len))  # no padding: the plain slice
    return T.stop_gradient(T.cond(full, last, per_row))


def _split_heads(x, n_head, d_head):
    """[B, T, N*D] -> [N, B, T, D]."""
    shape = T.shape(x)
    x = T.reshape(x, [shape[0], shape[1], n_head, d_head])  # [B, T, N, D]
    return T.transpose(x, [2, 0, 1, 3])  # [N, B, T, D]


def _to_heads(x, n_head, d_head, num_splits=1, kernels=False):
    """[B, T, S*N*D] -> S tensors [N, B, T, D]: with `kernels` (a training call, `fused.applies`) one copy
    (`fused.split_heads`), else split, reshape and transpose."""
    if kernels:
        return fused.split_heads(x, n_head, num_splits)
    parts = T.split(x, num_splits, axis=-1) if num_splits > 1 else [x]
    return [_split_heads(part, n_head, d_head) for part in parts]


def _dense_after_memory(memory, x, kernel):
    """`dense(concat([memory, x], 1), kernel)` -> [B, M+L, O] for a constant `memory` [B, M, I] (the paper's
    stop-gradient SG(h^{n-1}_{tau-1})): its gradient gives the kernel's and x's only. TensorFlow's own gradient
    would also compute the memory's input gradient (M of the M+L rows of d_out @ kernel^T) and discard it."""

    @tf.custom_gradient
    def project(x, kernel):
        cat = tf.concat([memory, x], axis=1)  # [B, K, I]
        out = dense(cat, kernel)  # [B, K, O]

        def grad(d_out):
            d_in, d_width = kernel.shape
            d_kernel = tf.matmul(tf.reshape(cat, [-1, d_in]), tf.reshape(d_out, [-1, d_width]),
                                 transpose_a=True)  # [I, O]
            d_segment = tf.slice(d_out, [0, tf.shape(memory)[1], 0], [-1, -1, -1])  # [B, L, O]
            d_x = tf.matmul(tf.reshape(d_segment, [-1, d_width]), kernel, transpose_b=True)  # [B*L, I]
            return tf.reshape(d_x, tf.shape(x)), d_kernel

        return out, grad

    return project(x, kernel)


class _Positions(NamedTuple):
    """The absolute positions of a call (see `RelativeMultiHeadAttention.call`)."""

    memory: Any = None  # [M, d] absolute positions added to the memory (vaswani's first layer, al_rfou)
    inputs: Any = None  # [L, d] absolute positions added to the inputs (al_rfou)


class _ScoreTerms(NamedTuple):
    """What the scores add to q.k (see `RelativeMultiHeadAttention.call`)."""

    mask: Any = None  # [L, K] additive, 0 or MASK_VALUE
    content_bias: Any = None  # u [N, D] (xl)
    position_bias: Any = None  # v [N, D] (xl)


class _Operands(NamedTuple):
    """Queries, keys, values and position keys of one call, whichever state form gave them."""

    q: Any  # [B, L, N*D]
    k: Any  # [N, B, K, D]
    v: Any  # [N, B, K, D]
    r: Any  # position keys [N, K, D], descending distance (xl, shaw), else None


@keras.saving.register_keras_serializable(package="txl_tf")
class RelativeMultiHeadAttention(keras.layers.Layer):
    """Multi-head attention over [memory, segment] with a position encoding, residual and LayerNorm.

    Projections (bias-free `keras.layers.Dense` sublayers, so that keras-hub's LoRA and Keras' int8 quantization
    reach them): `query`, `key`, `value` [d, N*D] (head-major: head n is columns n*D .. n*D+D-1; the TF
    original's `qkv` kernel is their concatenation), `attention_output` [N*D, d]; and the encoding's own
    (`txl_tf.model.encodings`): `position` [d, N*D] (xl's W_R), `relative_table` [max_position, N, D] (shaw). The u / v vectors (`content_bias`, `position_bias`) belong to
    the stack, which shares them across layers or not (`untie_r`), and are passed in.

    Args:
      d_model, n_head, d_head: sizes d, N, D.
      dropout: on the attention output (before the residual).
      dropatt: on the attention probabilities.
      attn_type: the position encoding, a name of `txl_tf.model.encodings.REGISTRY` ("xl", "shaw", "vaswani",
        "al_rfou", "rope", "alibi"); resolved once into `self.encoding`.
      pre_lnorm: LayerNorm before the projections (of memory and segment) and no LayerNorm after the residual.
      layer_norm_epsilon: LayerNorm epsilon (the TF original uses 1e-12).
      max_position: rows of the learned relative table (shaw); longer distances use the last row.
      init_std: standard deviation of the kernels' normal initialiser.

    The recurrent state goes in and comes out of the call as one value of `txl_tf.model.state`, in one of two forms:
      `LayerMemory` (training, and the authors' semantics): the hidden states [B, M, d] that entered this layer in
        earlier segments; keys and values are projected from concat([memory, inputs]) at every call.
      `LayerCache` (inference): `initial_cache`'s value, the memory's keys / values [N, B, M, D] and the position
        keys; only the segment's positions are projected. Same outputs as the memory (tested).

    Call args:
      inputs: segment h [B, L, d].
      state: a `LayerMemory`, a `LayerCache` (inference only), or None (no memory, M = 0).
      mem_len: positions of memory the returned state keeps (memory form; the cache keeps its own length).
      lengths: optional [B] int32 tokens per row; the rest of a row is padding and does not enter the state.
      position_encoding: what the encoding prepared once for all layers (`Prepared.encoding`): R [K, d] in
        descending distance (xl, memory form), the rotation table [2, K, D/2] (rope), else None.
      memory_positions, input_positions: absolute positions [M, d] and [L, d] added to memory and inputs before
        the attention (vaswani's first layer: the memory's; al_rfou: both); the state keeps the inputs without.
      attention_bias: additive mask [L, K] (0 or MASK_VALUE), float32, or [N, 1, L, K] with the encoding's bias
        (alibi).
      content_bias, position_bias: u, v [N, D] (xl only).
      return_probs: also return the attention probabilities [B, N, L, K] float32.
      training: dropout on/off.
      dropout_seeds: optional [2, 2] int32 from `draw_seeds()`: the seeds of the probabilities' and the output's
        dropout (memory form, training): the same seeds drop the same elements (a recomputed forward pass).
      kernels: a training call runs the score chain, head layout, dropout and residual LayerNorm as fused CPU
        kernels (`txl_tf.model.fused`; the training policy's `kernels`); inference always runs TensorFlow's ops.

    Returns:
      (outputs [B, L, d], new state) and the probabilities as a third element when `return_probs`. The new state
      has the type of the state given: a `LayerMemory` of [B, min(mem_len, M + L), d] (gradient stopped; also
      for None), or the updated `LayerCache`.
    """

    def __init__(
        self,
        d_model,
        n_head,
        d_head,
        dropout=0.0,
        dropatt=0.0,
        attn_type="xl",
        pre_lnorm=False,
        layer_norm_epsilon=1e-12,
        max_position=1024,
        init_std=0.02,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.encoding = encodings.get(attn_type)
        self.d_model = d_model
        self.n_head = n_head
        self.d_head = d_head
        self.dropout = dropout
        self.dropatt = dropatt
        self.attn_type = attn_type
        self.pre_lnorm = pre_lnorm
        self.layer_norm_epsilon = layer_norm_epsilon
        self.max_position = max_position
        self.init_std = init_std
        self.scale = d_head**-0.5
        self.output_dropout = Dropout(dropout)
        self.attention_dropout = Dropout(dropatt)
        self.layer_norm = keras.layers.LayerNormalization(epsilon=layer_norm_epsilon, name="layer_norm")
        width = n_head * d_head
        self.query = projection("query", width, init_std)
        self.key = projection("key", width, init_std)
        self.value = projection("value", width, init_std)
        self.attention_output = projection("attention_output", d_model, init_std)

    def build(self, input_shape=None):
        width = self.n_head * self.d_head
        for layer in (self.query, self.key, self.value):
            layer.build((None, None, self.d_model))
        self.attention_output.build((None, None, width))
        self.encoding.build_attention(self)
        self.layer_norm.build((None, None, self.d_model))
        super().build(input_shape)

    def draw_seeds(self):
        """[2, 2] int32: the seeds one training call's dropouts (probabilities, output) draw, each generator
        advanced as a call advances it; pass them as `dropout_seeds` to repeat that call's masks."""
        return T.stack([self.attention_dropout.draw()[0], self.output_dropout.draw()[0]])

    def _relative_keys(self, klen, position_encoding, kernels=False):
        """The encoding's position rows as keys [N, K, D] in descending distance, or None; `kernels`: as
        `_to_heads`'s."""
        rows = self.encoding.position_rows(self, klen, position_encoding)  # [K, N*D]
        if rows is None:
            return None
        r = _to_heads(T.expand_dims(rows, 0), self.n_head, self.d_head, kernels=kernels)[0]  # [N, 1, K, D]
        return T.reshape(r, [self.n_head, klen, self.d_head])  # [N, K, D]

    def _queries(self, x):
        """[B, T, d] -> [B, T, N*D]."""
        return project(x, self.query, dtype=self.compute_dtype)

    def _keys_values(self, x):
        """[B, T, d] -> [B, T, 2*N*D]: keys | values."""
        return project(x, self.key, self.value, dtype=self.compute_dtype)

    def initial_cache(self, batch_size, mem_len, max_len, position_encoding=None) -> LayerCache:
        """The keys/values cache of a zero memory (the TF original's first segment), for calls of up to `max_len`.

        Args:
          batch_size, mem_len: B and M.
          max_len: the longest segment a call with this cache may pass; the position keys cover
            P = mem_len + max_len distances.
          position_encoding: the encoding's `cache_encoding` for P = mem_len + max_len distances (xl: R [P, d] in
            descending distance, without dropout).

        Returns:
          A `LayerCache` in the compute dtype: keys, values [N, B, M, D] and, for the encodings whose scores have
          position rows (`position_keys_cached`: xl, shaw), position_keys [N, P, D] (W_R R or the learned table
          for distances P-1 .. 0, computed once here instead of at every call; () for the others).
        """
        zeros = T.zeros([batch_size, mem_len, self.d_model], self.compute_dtype)  # [B, M, d]
        x = self.layer_norm(zeros) if self.pre_lnorm else zeros
        keys, values = T.split(self._keys_values(x), 2, axis=-1)  # [B, M, N*D] each
        position_keys = ()
        if self.encoding.position_keys_cached:
            position_keys = self._relative_keys(mem_len + max_len, position_encoding)  # [N, P, D]
        return LayerCache(_split_heads(keys, self.n_head, self.d_head), _split_heads(values, self.n_head, self.d_head),
                          position_keys)  # [N, B, M, D] each

    def call(
        self,
        inputs,
        state=None,
        *,
        mem_len=0,
        lengths=None,
        position_encoding=None,
        memory_positions=None,
        input_positions=None,
        attention_bias=None,
        content_bias=None,
        position_bias=None,
        return_probs=False,
        training=None,
        dropout_seeds=None,
        kernels=False,
    ):
        check_type(state, (LayerMemory, LayerCache), "RelativeMultiHeadAttention")
        positions = _Positions(memory_positions, input_positions)
        terms = _ScoreTerms(attention_bias, content_bias, position_bias)
        dtype = self.compute_dtype
        raw = T.cast(inputs, dtype)  # [B, L, d]: what the recurrent state keeps
        h = raw if input_positions is None else raw + T.cast(input_positions, dtype)  # queries and residual
        if isinstance(state, LayerCache):
            if training:
                raise ValueError("the keys/values cache serves inference; train with the hidden-state memory")
            return self._call_cached(raw, h, state, lengths, positions, terms, return_probs, position_encoding)
        memory = None if state is None else state.hidden  # [B, M, d]
        new_memory = LayerMemory(keep_last(memory, raw, mem_len, lengths,
                                           axis=LayerMemory.TIME_AXIS))  # [B, min(mem_len, M + L), d]
        if memory is not None:
            memory = T.cast(memory, dtype)  # [B, M, d]
            if memory_positions is not None:
                memory = memory + T.cast(memory_positions, dtype)
        if self.pre_lnorm:  # LayerNorm is per position: normalising memory and segment apart is the same
            h_in = self.layer_norm(h)
            memory = None if memory is None else self.layer_norm(memory)
        else:
            h_in = h
        q = self._queries(h_in)  # [B, L, N*D]: queries only for the segment
        if memory is None:
            kv = self._keys_values(h_in)  # [B, L, 2*N*D]
        elif (T.TENSORFLOW and training is True and not self.pre_lnorm and memory_positions is None
              and not quantized(self.key, self.value)):  # the memory is a constant (TensorFlow: see there)
            kv = _dense_after_memory(memory, h_in, kernel_of(self.key, self.value, dtype=dtype))  # [B, K, 2*N*D]
        else:
            kv = self._keys_values(T.concat([memory, h_in], axis=1))  # [B, K, 2*N*D]
        klen = T.shape(kv)[1]
        kernels = fused.applies(kernels, dtype, training)
        # Head-major layout [N, B, T, D]: the position term then needs no broadcast over the batch.
        k, v = _to_heads(kv, self.n_head, self.d_head, 2, kernels)  # [N, B, K, D] each
        r = self._relative_keys(klen, position_encoding, kernels)  # [N, K, D] or None
        out = self._attend(h, _Operands(q, k, v, r), terms, return_probs, training, dropout_seeds,
                           position_encoding, kernels)
        return (out[0], new_memory, *out[1:])

    def _call_cached(self, raw, h, cache, lengths, positions, terms, return_probs, position_encoding):
        """Inference with the keys/values of the memory carried in `cache` (a `LayerCache`, see `initial_cache`).

        raw: the inputs [B, L, d] (what the cache keeps); h: with the absolute positions (queries and residual).
        Only the segment's L positions are projected; the memory's keys/values come from the cache and the
        position keys from its table. Absolute positions (vaswani's first layer, al_rfou) depend on where a
        memory position sits in the current window, so the cache keeps keys/values without them and their
        projection is added per call.
        """
        memory_positions, input_positions = positions.memory, positions.inputs
        if self.pre_lnorm and (memory_positions is not None or input_positions is not None):
            raise ValueError("a keys/values cache cannot hold LayerNorm(memory + absolute positions) "
                             "(pre_lnorm with attn_type 'vaswani' or 'al_rfou'); use the hidden-state memory")
        dtype = self.compute_dtype
        heads = lambda x: _split_heads(x, self.n_head, self.d_head)  # noqa: E731  [B, T, N*D] -> [N, B, T, D]
        keys, values = T.cast(cache.keys, dtype), T.cast(cache.values, dtype)  # [N, B, M, D]
        mem_len, time = cache.mem_len, LayerCache.TIME_AXIS
        h_in = self.layer_norm(h) if self.pre_lnorm else h
        if input_positions is None:
            q = self._queries(h_in)  # [B, L, N*D]
            k_new, v_new = T.split(self._keys_values(h_in), 2, axis=-1)  # [B, L, N*D]: what the cache keeps
            k_seg, v_seg = k_new, v_new
        else:  # al_rfou: the cache keeps the keys/values of the inputs without this window's positions
            q = self._queries(h)
            k_new, v_new = T.split(self._keys_values(raw), 2, axis=-1)
            k_pos, v_pos = T.split(self._keys_values(T.cast(input_positions, dtype)[None]), 2, axis=-1)
            k_seg, v_seg = k_new + k_pos, v_new + v_pos
        k_new, v_new = heads(k_new), heads(v_new)  # [N, B, L, D]
        k_cat, v_cat = T.concat([keys, k_new], axis=time), T.concat([values, v_new], axis=time)  # [N, B, K, D]
        qlen = T.shape(h)[1]
        new_cache = cache._replace(  # [N, B, M, D]: the cache keeps its shape
            keys=T.ensure_shape(keep_window(k_cat, qlen, mem_len, lengths, axis=time), keys.shape),
            values=T.ensure_shape(keep_window(v_cat, qlen, mem_len, lengths, axis=time), values.shape))
        k, v = k_cat, v_cat  # the keys/values attended: the cache's own, unless positions are added
        if memory_positions is not None:  # the window's positions of the memory: [1, M, N*D] -> [N, 1, M, D]
            k_pos, v_pos = T.split(self._keys_values(T.cast(memory_positions, dtype)[None]), 2, axis=-1)
            keys, values = keys + heads(k_pos), values + heads(v_pos)
        if memory_positions is not None or input_positions is not None:
            k = T.concat([keys, heads(k_seg)], axis=time)  # [N, B, K, D]
            v = T.concat([values, heads(v_seg)], axis=time)
        r = None
        if self.encoding.position_keys_cached:
            table = cache.position_keys  # [N, P, D], descending distance
            klen, rows = T.shape(k)[time], T.shape(table)[1]
            too_long = ("a call with a cache passes at most the max_len tokens the cache was made for (its position "
                        "keys cover mem_len + max_len distances)")
            if k.shape[time] is not None and table.shape[1] is not None:  # known when traced: checked now
                if k.shape[time] > table.shape[1]:
                    raise ValueError(f"{too_long}: {k.shape[time]} keys, {table.shape[1]} distances")
            elif _RUNTIME_ASSERTS.get():
                tf.debugging.assert_less_equal(klen, rows, message=too_long)
            r = T.cast(table[:, rows - klen:], dtype)  # [N, K, D]: distances K-1 .. 0
        out = self._attend(h, _Operands(q, k, v, r), terms, return_probs, False, position_encoding=position_encoding)
        return (out[0], new_cache, *out[1:])

    def row_kernels(self):
        """(queries, keys | values, output) as `projection.halves` for `decode_ring` at batch 1 (computed once
        before the decoding loop), or None where a projection is quantized or of an odd width."""
        dtype = self.compute_dtype
        kernels = (halves(self.query, dtype=dtype), halves(self.key, self.value, dtype=dtype),
                   halves(self.attention_output, dtype=dtype))
        return None if any(k is None for k in kernels) else kernels

    def decode_ring(self, h, keys, values, slot, write, position_rows, content_bias=None, position_bias=None,
                    row_kernels=None, filled=None):
        """One token per row against a ring of keys/values: the decoding step of `txl_tf.lm.hub`'s generation loop.

        The ring holds the keys/values of the last R <= M + 1 positions of each row, batch first (keras-hub's
        samplers repeat and gather the rows of their cache on axis 0), position p in slot p mod R: every row's
        token of this step writes the same slot, over the position R back, so that a step updates one slot in
        place instead of moving the M kept ones as `keep_window` does, and slot j holds the position at distance
        (slot - j) mod R in every row. One more slot, R, is scratch: the rows that do not write this step write
        there, so that no row reads the slot it keeps (a strided read of B*N*D numbers), and its score is -inf.
        Slots are the last axis ([B, N, D, R + 1]): both products of a step then run along the ring's slots rather
        than along a head's features, which XLA's CPU kernels do faster (a decoding step at batch 32 with memory
        2,000 took ~10% less time than with [B, N, R, D], 2-core Xeon, 2026-11-27). The scores are the cached
        call's (`_call_cached` with one query: M memory positions and the token itself).
        Encodings whose scores have position rows only (`position_keys_cached`: xl, shaw).

        Args:
          h: the token's input [B, 1, d].
          keys, values: [B, N, D, R + 1] in the compute dtype (slot R the scratch slot).
          slot: int32 scalar, the slot of this step's position (the position mod R).
          write: [B] bool, the rows whose token enters the ring; the others (still reading a prompt the ring
            already holds) write the scratch slot instead, and their output is not used.
          position_rows: [N, R, D], the position keys of distances R - 1 .. 0 (the last R of the cache's
            `position_keys`, sliced once before the loop: a slice in the step is a copy at every token).
          content_bias, position_bias: u, v [N, D] (xl) or None.
          row_kernels: `row_kernels()` at batch 1 (each projection as `projection.dense_row`), or None.
          filled: int32 scalar or None: slots 0 .. filled - 1 hold positions (this step's token included), the
            others none yet (a memory that starts empty: masked); None: every slot holds one.

        Returns:
          (outputs [B, 1, d], keys, values): the ring with the written rows' token in `slot`.
        """
        import tensorflow as tf  # the ring's scatter: TensorFlow only (its generation loop is TensorFlow's)

        dtype = self.compute_dtype
        batch = tf.shape(h)[0]
        h = tf.cast(h, dtype)
        h_in = self.layer_norm(h) if self.pre_lnorm else h
        heads = lambda x: tf.reshape(x, [batch, self.n_head, 1, self.d_head])  # noqa: E731  [B, 1, N*D] -> [B, N, 1, D]
        if row_kernels is None:
            queries, keys_values = self._queries(h_in), self._keys_values(h_in)
        else:
            queries, keys_values = dense_row(h_in, row_kernels[0]), dense_row(h_in, row_kernels[1])
        q = heads(queries) * tf.cast(self.scale, dtype)  # [B, N, 1, D]
        k_new, v_new = (heads(x) for x in tf.split(keys_values, 2, axis=-1))  # [B, N, 1, D] each
        # (row, head, feature, slot) of the B*N*D numbers to write: a scatter XLA runs in place (its
        # dynamic_update_slice measured far slower here: it copied the ring); the rows that do not write put their
        # numbers in the scratch slot.
        rows_heads = batch * self.n_head
        scratch = T.dim(keys, 3) - 1
        slots = tf.repeat(tf.where(write, slot, scratch), self.n_head * self.d_head)  # [B*N*D]
        at = tf.stack([tf.repeat(tf.range(batch), self.n_head * self.d_head),
                       tf.tile(tf.repeat(tf.range(self.n_head), self.d_head), [batch]),
                       tf.tile(tf.range(self.d_head), [rows_heads]),
                       slots], axis=1)  # [B*N*D, 4]
        keys = tf.tensor_scatter_nd_update(keys, at, tf.reshape(k_new, [-1]))
        values = tf.tensor_scatter_nd_update(values, at, tf.reshape(v_new, [-1]))
        q_k = q if content_bias is None else q + tf.cast(content_bias, dtype)[:, None] * tf.cast(self.scale, dtype)
        score = tf.matmul(q_k, keys)  # [B, N, 1, R + 1]: (a) + (c)
        q_r = q if position_bias is None else q + tf.cast(position_bias, dtype)[:, None] * tf.cast(self.scale, dtype)
        # [B, N, 1, R]: (b) + (d), row i at distance R-1-i
        by_distance = tf.einsum("bnqd,nrd->bnqr", q_r, tf.cast(position_rows, dtype))
        # Slot j holds distance (slot - j) mod R, row R-1 - that = (j - slot - 1) mod R: a roll by slot + 1.
        # The scratch slot's score: -inf (its probability 0).
        score += tf.pad(tf.roll(by_distance, shift=slot + 1, axis=3), [[0, 0], [0, 0], [0, 0], [0, 1]],
                        constant_values=float("-inf"))
        if filled is not None:  # the slots no position has written yet: probability 0
            score += tf.where(tf.range(tf.shape(score)[3]) < filled, tf.constant(0.0, score.dtype),
                              tf.constant(float("-inf"), score.dtype))
        probs = tf.cast(tf.nn.softmax(tf.cast(score, tf.float32), axis=-1), dtype)  # [B, N, 1, R + 1]
        attn = tf.matmul(probs, values, transpose_b=True)  # [B, N, 1, D]
        return self._decoded(h, attn, row_kernels), keys, values

    def _decoded(self, h, attn, row_kernels):
        """A decoding step's output [B, 1, d]: the heads' values `attn` [B, N, 1, D] projected, and the residual."""
        attn = keras.ops.reshape(attn, [-1, 1, self.n_head * self.d_head])
        if row_kernels is None:
            out = project(attn, self.attention_output, dtype=self.compute_dtype)  # [B, 1, d]
        else:
            out = dense_row(attn, row_kernels[2])
        return h + out if self.pre_lnorm else self.layer_norm(h + out)

    def decode_block(self, h, ring, side, step, position, ring_bias, side_bias, ring_rows, side_rows,
                     content_bias=None, position_bias=None):
        """One token per row against a ring of keys/values that a block of W steps only reads, and the block's
        own W slots: the decoding step of `txl_tf.lm.hub`'s block loop (`TransformerXLCausalLM._block_decode`).

        `decode_ring` writes one slot of the ring at every token, and those writes (B*N*D numbers a slot apart)
        cost a step at batch 32 and memory 2,000 about a third of its time (issue 55). Here the ring is written
        once per block: the block's positions cW .. cW + W - 1 go into a small side buffer, slot k position cW + k,
        which the loop flushes into the ring's W contiguous slots after the block's last step. A step attends to
        both, each slot masked by its row's bias (`ring_bias`, `side_bias`: 0 where the slot holds a position the
        token attends to, -inf elsewhere), so the scores are the cached call's (`_call_cached` with one query).
        Encodings whose scores have position rows only (`position_keys_cached`: xl, shaw).

        Args:
          h: the token's input [B, 1, d].
          ring: (keys, values) [B, N, D, S] in the compute dtype, position p in slot p mod S (S a multiple of W).
          side: (keys, values) [B, N, D, W], the block's slots.
          step: int32 scalar j = position - cW: the side slot this step writes.
          position: int32 scalar p, the token's position (the same in every row).
          ring_bias, side_bias: [B, S] and [B, W] float32.
          ring_rows, side_rows: the position keys [N, S, D] of distances S - 1 .. 0 and [N, W, D] of W - 1 .. 0
            (rows beyond the memory's distances may be anything: their slots are masked).
          content_bias, position_bias: u, v [N, D] (xl) or None.

        Returns:
          (outputs [B, 1, d], side keys, side values): the side buffer with this step's keys/values in slot j.
        """
        import tensorflow as tf  # the block loop is TensorFlow's, like the ring's

        dtype = self.compute_dtype
        batch = tf.shape(h)[0]
        scale = tf.cast(self.scale, dtype)
        h = tf.cast(h, dtype)
        h_in = self.layer_norm(h) if self.pre_lnorm else h
        queries, keys_values = self._queries(h_in), self._keys_values(h_in)
        q = tf.reshape(queries, [batch, self.n_head, 1, self.d_head]) * scale  # [B, N, 1, D]
        k_new, v_new = (tf.reshape(x, [batch, self.n_head, self.d_head, 1]) for x in tf.split(keys_values, 2, -1))
        side_keys = keras.ops.slice_update(side[0], [0, 0, 0, step], k_new)  # the side buffer: small, in cache
        side_values = keras.ops.slice_update(side[1], [0, 0, 0, step], v_new)
        q_k = q if content_bias is None else q + tf.cast(content_bias, dtype)[:, None] * scale
        q_r = q if position_bias is None else q + tf.cast(position_bias, dtype)[:, None] * scale

        def scores(keys, rows, shift, bias):
            """(a) + (c) and (b) + (d) against slots whose distance is (shift - 1 - slot) mod slots, masked."""
            content = tf.matmul(q_k, keys)  # [B, N, 1, S]
            by_distance = tf.einsum("bnqd,nrd->bnqr", q_r, tf.cast(rows, dtype))  # column i: distance S - 1 - i
            return tf.cast(content + tf.roll(by_distance, shift=shift, axis=3), tf.float32) + bias[:, None, None, :]

        slots = ring[0].shape[3] if ring[0].shape[3] is not None else tf.shape(ring[0])[3]
        ring_score = scores(ring[0], ring_rows, tf.math.floormod(position + 1, slots), ring_bias)  # [B, N, 1, S]
        side_score = scores(side_keys, side_rows, step + 1, side_bias)  # [B, N, 1, W]
        score = tf.concat([ring_score, side_score], axis=3)  # [B, N, 1, S + W]
        probs = tf.cast(tf.nn.softmax(score, axis=-1), dtype)
        ring_probs, side_probs = probs[..., :slots], probs[..., slots:]
        attn = tf.matmul(ring_probs, ring[1], transpose_b=True) + tf.matmul(side_probs, side_values, transpose_b=True)
        return self._decoded(h, attn, None), side_keys, side_values

    def _attend(self, h, operands, terms, return_probs, training, seeds=None, position_encoding=None,
                kernels=False):
        """Scores, softmax, values, output projection and residual: the part both states share.

        h: residual [B, L, d]; operands: `_Operands` (q, k, v, r); terms: `_ScoreTerms` (mask, u, v); seeds: the
        call's `dropout_seeds`; position_encoding: the call's, for the encoding's `rotate`; kernels: the fused
        kernels apply (`fused.applies` of the call's policy).
        """
        q, k, v, r = operands
        attention_bias, content_bias, position_bias = terms
        dtype = self.compute_dtype
        batch, qlen, klen = T.shape(h)[0], T.shape(h)[1], T.shape(k)[2]
        q = _to_heads(q, self.n_head, self.d_head, kernels=kernels)[0] * T.cast(self.scale, dtype)  # [N, B, L, D]
        plain_q, plain_k = q, k
        q, k = self.encoding.rotate(q, k, position_encoding)  # rope: each at its window position
        if content_bias is not None:
            u = T.cast(content_bias, dtype)[:, None, None, :] * T.cast(self.scale, dtype)  # [N, 1, 1, D]
            score = T.matmul(q + u, k, transpose_b=True)  # [N, B, L, K]: (a) + (c)
        else:
            score = T.matmul(q, k, transpose_b=True)  # [N, B, L, K]: (a)
        score = self.encoding.clamp_scores(score, plain_q, plain_k, position_encoding)  # rope: beyond clamp_len
        if r is not None:
            q_r = q
            if position_bias is not None:
                q_r = q + T.cast(position_bias, dtype)[:, None, None, :] * T.cast(self.scale, dtype)
            q_r = T.reshape(q_r, [self.n_head, batch * qlen, self.d_head])  # [N, B*L, D]
            if h.shape[1] == 1:  # one query (decoding): rel_shift is the identity, no padding needed
                position_score = T.matmul(q_r, r, transpose_b=True)  # [N, B, K]
                score += T.reshape(position_score, [self.n_head, batch, 1, klen])
            else:
                r = T.pad(r, [[0, 0], [1, 0], [0, 0]])  # [N, K+1, D]: a zero row gives shift_padded its column
                position_score = T.matmul(q_r, r, transpose_b=True)  # [N, B*L, K+1]: one matmul per head
                position_score = T.reshape(position_score, [self.n_head, batch, qlen, klen + 1])
                if not return_probs and (attention_bias is None or len(attention_bias.shape) == 2) and kernels:
                    # Training on CPU: shift, add, mask and softmax (and their gradient) in one kernel each way.
                    probs = fused.rel_softmax(score, position_score, attention_bias)  # [N, B, L, K]
                    return self._output(h, probs, v, batch, qlen, training, kernels, seeds)
                score += shift_padded(position_score)  # [N, B, L, K]: (b) + (d)

        score = T.cast(score, T.float32)
        if attention_bias is not None:
            score += T.cast(attention_bias, T.float32)  # [L, K] or [N, 1, L, K] broadcast
        probs = T.softmax(score, axis=-1)  # [N, B, L, K] float32
        out = self._output(h, T.cast(probs, dtype), v, batch, qlen, training, kernels, seeds)
        if return_probs:
            return out[0], T.transpose(probs, [1, 0, 2, 3])  # [B, N, L, K]
        return out

    def _output(self, h, probs, v, batch, qlen, training, kernels, seeds=None):
        """Attention dropout, values, output projection, output dropout and the residual (with LayerNorm);
        `kernels`: as `_to_heads`'s; `seeds`: the call's `dropout_seeds` (None: each dropout draws its own)."""
        dtype = self.compute_dtype
        width = self.n_head * self.d_head
        seeds = (None, None) if seeds is None else (seeds[0], seeds[1])
        dropped = self.attention_dropout(probs, training=training, seed=seeds[0], kernels=kernels)
        attn = T.matmul(dropped, v)  # [N, B, L, D]
        if kernels:
            attn = fused.merge_heads([attn], self.n_head)  # [B, L, N*D]
        else:
            attn = T.reshape(T.transpose(attn, [1, 2, 0, 3]), [batch, qlen, width])  # [B, L, N*D]
        out = project(attn, self.attention_output, dtype=dtype)  # [B, L, d]
        out = self.output_dropout(out, training=training, seed=seeds[1], kernels=kernels)
        out = h + out if self.pre_lnorm else fused.add_layer_norm(self.layer_norm, h, out, kernels)  # [B, L, d]
        return (out,)

    def get_config(self):
        return {
            **super().get_config(),
            "d_model": self.d_model,
            "n_head": self.n_head,
            "d_head": self.d_head,
            "dropout": self.dropout,
            "dropatt": self.dropatt,
            "attn_type": self.attn_type,
            "pre_lnorm": self.pre_lnorm,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "max_position": self.max_position,
            "init_std": self.init_std,
        }
