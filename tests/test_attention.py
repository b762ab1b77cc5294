"""Relative attention: hand-checked rel_shift / mask / uniform attention, a slow oracle written from the paper's
equation (section 3.3) looping over (i, j), and the shared layer checks for every attention type."""

import numpy as np
import pytest
import tensorflow as tf
from layer_test_case import run_layer_checks

from txl_tf.model.attention import MASK_VALUE, RelativeMultiHeadAttention, attention_bias, rel_shift
from txl_tf.model.state import LayerMemory

B, L, M, N, D, DM = 2, 3, 5, 2, 7, 12  # pairwise distinct; K = 8


def test_rel_shift_by_hand():
    x = tf.constant([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])  # L=2, K=3 (M=1); row k = distance 2-k
    out = rel_shift(x).numpy()
    # query 0 (key position 1): key 0 at distance 1 -> x[0, 1]; key 1 at distance 0 -> x[0, 2]; key 2 future
    # query 1 (key position 2): keys 0, 1, 2 at distances 2, 1, 0 -> x[1, 0], x[1, 1], x[1, 2]
    np.testing.assert_array_equal(out[0, :2], [2.0, 3.0])
    np.testing.assert_array_equal(out[1], [4.0, 5.0, 6.0])


def test_rel_shift_leading_dims():
    x = tf.reshape(tf.range(B * N * L * (M + L), dtype=tf.float32), [B, N, L, M + L])
    out = rel_shift(x).numpy()
    for i in range(L):
        for j in range(M + i + 1):
            np.testing.assert_array_equal(out[:, :, i, j], x.numpy()[:, :, i, j + L - 1 - i])


def test_attention_bias_by_hand():
    blocked = attention_bias(2, 1).numpy() != 0
    np.testing.assert_array_equal(blocked, [[False, False, True], [False, False, False]])
    # same_length, TF semantics: each query sees M + 1 = 2 keys
    blocked = attention_bias(2, 1, same_length=True).numpy() != 0
    np.testing.assert_array_equal(blocked, [[False, False, True], [True, False, False]])
    # PyTorch semantics with mem_len = 2: each query sees the last 2 keys
    blocked = attention_bias(3, 2, same_length=True, same_length_keys="pytorch", mem_len=2).numpy() != 0
    assert (~blocked).sum(axis=1).tolist() == [2, 2, 2]
    assert attention_bias(1, 0).numpy()[0, 0] == 0 and MASK_VALUE == -1e30


def test_uniform_attention_by_hand():
    """Zero query weights and u = v = 0 give uniform attention: output = LayerNorm(h + mean of values)."""
    layer = RelativeMultiHeadAttention(d_model=2, n_head=1, d_head=2)
    layer.build()
    layer.query.kernel.assign(np.zeros([2, 2], np.float32))  # q = k = 0, v = x
    layer.key.kernel.assign(np.zeros([2, 2], np.float32))
    layer.value.kernel.assign(np.eye(2, dtype=np.float32))
    layer.attention_output.kernel.assign(np.eye(2, dtype=np.float32))
    h = tf.constant([[[0.0, 1.0]]])  # [1, 1, 2]
    mem = tf.constant([[[2.0, 3.0]]])
    pos = tf.zeros([2, 2])
    zeros = tf.zeros([1, 2])
    out, _, probs = layer(h, LayerMemory(mem), position_encoding=pos, attention_bias=attention_bias(1, 1),
                          content_bias=zeros, position_bias=zeros, return_probs=True)
    np.testing.assert_allclose(probs.numpy().ravel(), [0.5, 0.5])
    # h + mean(v) = [0, 1] + [1, 2] = [1, 3] -> LayerNorm -> [-1, 1]
    np.testing.assert_allclose(out.numpy().ravel(), [-1.0, 1.0], atol=1e-6)


def _np_sinusoid(distance, d):
    inv_freq = 1.0 / 10000 ** (np.arange(0, d, 2) / d)
    return np.concatenate([np.sin(distance * inv_freq), np.cos(distance * inv_freq)])


def _np_layer_norm(x, eps):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps)


def oracle(h, mem, wq, wk, wv, wr, wo, u, v, clamp_len, same_length, eps):
    """Slow loop over (b, n, i, j) of A = (a) + (b) + (c) + (d) from the paper, then softmax, values, W_o, LN."""
    cat = np.concatenate([mem, h], axis=1)  # [B, K, d]
    nb, nq, _ = h.shape
    nm = mem.shape[1]
    out = np.zeros_like(h)
    for b in range(nb):
        heads = []
        for n in range(N):
            sl = slice(n * D, (n + 1) * D)
            att = np.zeros([nq, D])
            for i in range(nq):
                q_i = h[b, i] @ wq[:, sl]
                scores, values = [], []
                for j in range(nm + nq):
                    dist = nm + i - j
                    if dist < 0 or (same_length and dist > nm):
                        continue
                    k_j = cat[b, j] @ wk[:, sl]
                    r = _np_sinusoid(min(dist, clamp_len) if clamp_len > 0 else dist, h.shape[-1])
                    wr_r = r @ wr[:, sl]
                    a = q_i @ k_j + q_i @ wr_r + u[n] @ k_j + v[n] @ wr_r
                    scores.append(a / np.sqrt(D))
                    values.append(cat[b, j] @ wv[:, sl])
                p = np.exp(np.array(scores) - max(scores))
                att[i] = (p / p.sum()) @ np.array(values)
            heads.append(att)
        out[b] = _np_layer_norm(h[b] + np.concatenate(heads, -1) @ wo, eps)
    return out


@pytest.mark.parametrize("state", ["memory", "cache"])
@pytest.mark.parametrize("clamp_len,same_length", [(-1, False), (3, False), (-1, True), (2, True)])
def test_matches_paper_oracle(clamp_len, same_length, state):
    rng = np.random.default_rng(0)
    eps = 1e-12
    layer = RelativeMultiHeadAttention(DM, N, D, layer_norm_epsilon=eps)
    layer.build()
    w = {k: rng.normal(0, 0.3, s).astype(np.float32) for k, s in
         dict(q=(DM, N * D), k=(DM, N * D), v=(DM, N * D), r=(DM, N * D), o=(N * D, DM)).items()}
    u, v = rng.normal(0, 0.3, (2, N, D)).astype(np.float32)
    for sub, key in [("query", "q"), ("key", "k"), ("value", "v"), ("position", "r"), ("attention_output", "o")]:
        getattr(layer, sub).kernel.assign(w[key])
    h = rng.normal(size=(B, L, DM)).astype(np.float32)
    mem = rng.normal(size=(B, M, DM)).astype(np.float32)
    from txl_tf.model.embedding import RelativePositionalEncoding

    encoding = RelativePositionalEncoding(DM)
    if state == "memory":
        pos = encoding(tf.constant(M + L), clamp_len=clamp_len)
        out, _ = layer(h, LayerMemory(mem), position_encoding=pos,
                       attention_bias=attention_bias(L, M, same_length), content_bias=u, position_bias=v)
    else:  # a zero cache of M positions fed `mem` as one segment keeps exactly mem's keys and values
        cache = layer.initial_cache(B, M, M, encoding(tf.constant(2 * M), clamp_len=clamp_len))
        _, cache = layer(mem, cache, attention_bias=attention_bias(M, M), content_bias=u, position_bias=v)
        out, _ = layer(h, cache, attention_bias=attention_bias(L, M, same_length), content_bias=u, position_bias=v)
    expected = oracle(h, mem, w["q"], w["k"], w["v"], w["r"], w["o"], u, v, clamp_len, same_length, eps)
    np.testing.assert_allclose(out.numpy(), expected, atol=1e-5)


def _attention_call(attn_type):
    rng = np.random.default_rng(1)
    h = tf.constant(rng.normal(size=(B, L, DM)), tf.float32)
    mem = tf.constant(rng.normal(size=(B, M, DM)), tf.float32)
    uv = tf.constant(rng.normal(size=(N, D)), tf.float32)

    def call(layer, training):
        from txl_tf.model.embedding import RelativePositionalEncoding

        pos = RelativePositionalEncoding(DM, dtype=layer.dtype_policy)(tf.constant(M + L))
        return layer(h, LayerMemory(mem), position_encoding=pos, attention_bias=attention_bias(L, M),
                     content_bias=uv, position_bias=uv, training=training)[0]

    return call


@pytest.mark.parametrize("attn_type", ["xl", "shaw", "vaswani"])
@pytest.mark.parametrize("pre_lnorm", [False, True])
def test_layer_contract(attn_type, pre_lnorm):
    def make(**kw):
        return RelativeMultiHeadAttention(DM, N, D, dropout=0.1, dropatt=0.1, attn_type=attn_type,
                                          pre_lnorm=pre_lnorm, max_position=6, **kw)

    run_layer_checks(make, _attention_call(attn_type))


def test_rejects_unknown_attn_type():
    with pytest.raises(ValueError, match="attn_type"):
        RelativeMultiHeadAttention(DM, N, D, attn_type="t5_buckets")


def test_projection_after_memory_gradient_is_tensorflows():
    """The keys/values projection over [memory, segment] in training: TensorFlow's values and gradients for the
    segment and the kernel (float32 rounding), none for the constant memory."""
    from txl_tf.model.attention import _dense_after_memory
    from txl_tf.model.projection import dense

    rng = np.random.default_rng(4)
    memory, x = tf.constant(rng.normal(size=(2, 3, 5)), tf.float32), tf.constant(rng.normal(size=(2, 4, 5)), tf.float32)
    kernel, weights = tf.constant(rng.normal(size=(5, 6)), tf.float32), tf.constant(rng.normal(size=(2, 7, 6)),
                                                                                    tf.float32)
    results = []
    for fn in (_dense_after_memory, lambda m, x, k: dense(tf.concat([m, x], axis=1), k)):
        with tf.GradientTape() as tape:
            tape.watch([memory, x, kernel])
            out = fn(memory, x, kernel)
            loss = tf.reduce_sum(out * weights)
        results.append([out, *tape.gradient(loss, [memory, x, kernel])])
    (out, d_memory, d_x, d_kernel), (want, _, want_x, want_kernel) = results
    assert d_memory is None
    for got, expected in [(out, want), (d_x, want_x), (d_kernel, want_kernel)]:
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-5, atol=1e-5)


def test_one_row_through_half_width_kernels_is_the_plain_product():
    """`projection.dense_row` (decoding at batch 1) gives x @ kernel for projections side by side; a quantized
    projection or an odd width gets no halves (the layer's own call runs)."""
    import keras

    from txl_tf.model.projection import dense_row, halves

    rng = np.random.default_rng(7)
    layers = [keras.layers.Dense(units, use_bias=False) for units in (6, 4, 3)]
    for layer in layers:
        layer.build((None, 5))
        layer.kernel.assign(rng.normal(size=layer.kernel.shape).astype(np.float32))
    x = tf.constant(rng.normal(size=(1, 1, 5)), tf.float32)
    got = dense_row(x, halves(layers[0], layers[1], dtype=tf.float32))
    want = tf.matmul(x[0], tf.concat([layers[0].kernel, layers[1].kernel], axis=1))[None]
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-6)
    assert halves(layers[2], dtype=tf.float32) is None  # 3 columns
    layers[0].quantize("int8")
    assert halves(layers[0], dtype=tf.float32) is None


def test_training_gradients_equal_inference_gradients():
    """A training call (no dropout) takes the projection above; its weight gradients equal those of an
    inference call, which keeps TensorFlow's own concat and gradient."""
    layer = RelativeMultiHeadAttention(DM, N, D)
    layer.build()
    call = _attention_call("xl")
    grads = []
    for training in (True, False):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(call(layer, training) ** 2)
        grads.append(tape.gradient(loss, layer.trainable_weights))
    for got, want in zip(*grads, strict=True):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
