"""Fast Transformer-XL inference: cached keys/values of the memory and cached position keys.

The model's own call keeps the memory as hidden states and, every segment, projects all K = M + L of them to
keys and values and projects the K relative position encodings (W_R R) again: the authors' code does the same.
During evaluation neither changes between segments: the keys/values of a memory position were already
computed when that position was in the segment, and W_R R depends only on K and clamp_len. This module reuses
both, with the model's own weights and sublayers, so each segment costs the projections of its L new tokens
plus the attention over K keys. The results equal the model's call (tested to 1e-5).

State: `keys`, `values` [n_layer, B, N, M, D] (the memory's keys and values per layer); `initial_state`
projects `model.initial_mems` (zeros, the TF original's convention) once. Supported: attn_type "xl"
(post- or pre-LayerNorm, shared or untied u/v).

Shapes: n_layer layers, B batch, L segment, M memory, K = M + L, N heads, D head width, d = d_model.
"""

from __future__ import annotations

import tensorflow as tf

from txl_tf.attention import attention_bias, rel_shift


def _check(model):
    if model.attn_type != "xl":
        raise ValueError(f"cached-key inference supports attn_type='xl' only; got {model.attn_type!r} "
                         "(use the model's call)")
    if model.mem_len < 1:
        raise ValueError("cached-key inference needs mem_len >= 1")


def _heads(x, model):
    """[B, T, N*D] -> [B, N, T, D]."""
    shape = tf.shape(x)
    return tf.transpose(tf.reshape(x, [shape[0], shape[1], model.n_head, model.d_head]), [0, 2, 1, 3])


def _key_values(block, hidden, model):
    """Keys and values [B, N, T, D] of hidden states [B, T, d] entering `block`."""
    attention = block.attention
    if attention.pre_lnorm:
        hidden = attention.layer_norm(hidden)
    width = model.n_head * model.d_head
    kv = tf.matmul(tf.cast(hidden, attention.compute_dtype),
                   tf.cast(attention.qkv_kernel[:, width:], attention.compute_dtype))  # [B, T, 2*N*D]
    return _heads(kv[..., :width], model), _heads(kv[..., width:], model)


def initial_state(model, batch_size: int):
    """(keys, values) [n_layer, B, N, M, D] of the zero memory (`model.initial_mems`)."""
    _check(model)
    mems = model.initial_mems(batch_size)  # [n_layer, B, M, d]
    pairs = [_key_values(block, mems[i], model) for i, block in enumerate(model.blocks)]
    return tf.stack([k for k, _ in pairs]), tf.stack([v for _, v in pairs])


def position_keys(model, qlen: int):
    """W_R R per layer [n_layer, N, K, D] for segments of `qlen` after a memory of `model.mem_len`."""
    klen = model.mem_len + qlen
    encoding = model.position_encoding(tf.constant(klen), clamp_len=model.clamp_len)  # [K, d], descending
    keys = []
    for block in model.blocks:
        kernel = tf.cast(block.attention.r_kernel, block.attention.compute_dtype)
        r = tf.reshape(tf.matmul(encoding, kernel), [klen, model.n_head, model.d_head])  # [K, N, D]
        keys.append(tf.transpose(r, [1, 0, 2]))  # [N, K, D]
    return tf.stack(keys)


def _biases(model, i):
    if model.untie_r:
        return model.r_w_bias[i], model.r_r_bias[i]
    return model.r_w_bias, model.r_r_bias


def _attend(model, i, h, keys, values, r_keys, bias):
    """Layer i's attention sublayer on h [B, L, d] with full keys/values [B, N, K, D]; returns [B, L, d]."""
    attention = model.blocks[i].attention
    dtype = attention.compute_dtype
    width = model.n_head * model.d_head
    x = attention.layer_norm(h) if attention.pre_lnorm else h
    scale = tf.cast(attention.scale, dtype)
    q = _heads(tf.matmul(x, tf.cast(attention.qkv_kernel[:, :width], dtype)), model) * scale  # [B, N, L, D]
    u, v = _biases(model, i)
    content = tf.matmul(q + tf.cast(u, dtype)[:, None, :] * scale, keys, transpose_b=True)  # [B, N, L, K]
    position = tf.matmul(q + tf.cast(v, dtype)[:, None, :] * scale, r_keys[None], transpose_b=True)
    score = tf.cast(content + rel_shift(position), tf.float32) + bias  # [B, N, L, K]
    probs = tf.cast(tf.nn.softmax(score, axis=-1), dtype)
    attn = tf.matmul(probs, values)  # [B, N, L, D]
    attn = tf.reshape(tf.transpose(attn, [0, 2, 1, 3]), [tf.shape(h)[0], tf.shape(h)[1], width])
    out = tf.matmul(attn, tf.cast(attention.o_kernel, dtype))  # [B, L, d]
    return h + out if attention.pre_lnorm else attention.layer_norm(h + out)


def forward(model, tokens, keys, values, r_keys):
    """One segment: (hidden [B, L, d], new keys, new values), equal to `model(tokens, mems)` in inference.

    Args:
      tokens: [B, L] int32; keys / values: [n_layer, B, N, M, D]; r_keys: `position_keys(model, L)`.
    """
    mlen = model.mem_len
    qlen = tf.shape(tokens)[1]
    bias = attention_bias(qlen, mlen, model.same_length, model.same_length_keys, model.mem_len)  # [L, K]
    h = model.embedding(tokens)  # [B, L, d]
    new_keys, new_values = [], []
    for i, block in enumerate(model.blocks):
        k_new, v_new = _key_values(block, h, model)  # [B, N, L, D]
        k_all = tf.concat([tf.cast(keys[i], k_new.dtype), k_new], axis=2)  # [B, N, K, D]
        v_all = tf.concat([tf.cast(values[i], v_new.dtype), v_new], axis=2)
        new_keys.append(k_all[:, :, -mlen:])
        new_values.append(v_all[:, :, -mlen:])
        h = block.feed_forward(_attend(model, i, h, k_all, v_all, r_keys[i], bias))
    return h, tf.stack(new_keys), tf.stack(new_values)


class CachedScorer:
    """Compiled segment scoring with cached keys/values: `step(inputs, targets, state) -> (nll, state)`.

    Position keys are computed once per segment length with the model's current weights, so make a new
    scorer after the weights or the protocol (mem_len, clamp_len, same_length) change.
    """

    def __init__(self, model, jit_compile: bool = False):
        _check(model)
        self.model = model
        self._r_keys = {}
        self._step = tf.function(self._score, jit_compile=jit_compile)

    def initial_state(self, batch_size: int):
        return initial_state(self.model, batch_size)

    def _score(self, inputs, targets, state, r_keys):
        hidden, keys, values = forward(self.model, inputs, state[0], state[1], r_keys)
        return self.model.nll(hidden, targets), (keys, values)

    def __call__(self, inputs, targets, state):
        qlen = int(inputs.shape[1])
        if qlen not in self._r_keys:
            self._r_keys[qlen] = position_keys(self.model, qlen)
        return self._step(inputs, targets, state, self._r_keys[qlen])


def logits_fn(model):
    """A `generation` logits_fn on the cached state: (tokens [B, L], (keys, values)) -> (log_probs [B, V], state).

    Position keys are computed once per segment length, eagerly (`tf.init_scope`) even when traced inside the
    decode loop, so each generated token costs one position's projections plus attention over the memory.
    """
    _check(model)
    cache = {}

    def fn(tokens, state):
        qlen = int(tokens.shape[1])
        if qlen not in cache:
            with tf.init_scope():
                cache[qlen] = position_keys(model, qlen)
        hidden, keys, values = forward(model, tokens, state[0], state[1], cache[qlen])
        return model.log_probs(hidden[:, -1:])[:, 0], (keys, values)

    return fn
