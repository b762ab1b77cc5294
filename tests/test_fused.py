"""The fused CPU kernels, built and loaded for real: the attention's softmax chain checked against TensorFlow's
ops (values and gradients, float32 and bfloat16), dropout's rate, scale, reproducibility and gradient, the residual
LayerNorm against Keras' LayerNormalization, the heads' split and merge against tf.split and tf.transpose, and
where they are used (training calls under the training policy's kernels, `kernels=True`; never inference),
whatever the environment."""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from txl_tf.model import fused as fused_mod
from txl_tf.model.attention import RelativeMultiHeadAttention, attention_bias, shift_padded
from txl_tf.model.block import PositionwiseFeedForward
from txl_tf.model.dropout import Dropout
from txl_tf.model.state import LayerMemory

if fused_mod._compiler() is None and not os.environ.get("CI"):
    pytest.skip("no C++ compiler to build the kernels (CI installs g++)", allow_module_level=True)


def test_builds_and_loads():
    library, reason = fused_mod._load()
    assert library is not None, reason
    assert fused_mod.unavailable() is None


def _reference(content, position, bias):
    """TensorFlow's chain in float32: shift, add, mask, softmax."""
    score = tf.cast(content, tf.float32) + tf.cast(shift_padded(position), tf.float32)
    return tf.nn.softmax(score if bias is None else score + bias, axis=-1)


def _value_and_grads(fn, content, position, weights):
    with tf.GradientTape() as tape:
        tape.watch([content, position])
        probs = tf.cast(fn(content, position), tf.float32)
        loss = tf.reduce_sum(probs * weights)
    return [probs.numpy()] + [tf.cast(g, tf.float32).numpy() for g in tape.gradient(loss, [content, position])]


@pytest.mark.parametrize("heads,batch,qlen,mlen", [(2, 3, 5, 4), (1, 1, 7, 0), (3, 2, 1, 6), (2, 2, 16, 16)])
@pytest.mark.parametrize("masked", [True, False])
def test_float32_equals_tensorflow_chain(heads, batch, qlen, mlen, masked):
    rng = np.random.default_rng(qlen + mlen)
    klen = qlen + mlen
    content = tf.constant(rng.normal(0, 3, [heads, batch, qlen, klen]), tf.float32)
    position = tf.constant(rng.normal(0, 3, [heads, batch, qlen, klen + 1]), tf.float32)
    weights = tf.constant(rng.normal(size=[heads, batch, qlen, klen]), tf.float32)
    bias = attention_bias(qlen, mlen) if masked else None
    fused = _value_and_grads(lambda c, p: fused_mod.rel_softmax(c, p, bias), content, position, weights)
    reference = _value_and_grads(lambda c, p: _reference(c, p, bias), content, position, weights)
    for got, want, name in zip(fused, reference, ["probs", "d_content", "d_position"], strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-5, err_msg=name)
    # The shift skips the first L elements of each flat [L, K+1] block of position scores: their gradient is zero.
    d_position = fused[2].reshape(heads * batch, -1)
    assert not d_position[:, :qlen].any()


def test_bfloat16_within_rounding_of_float32():
    rng = np.random.default_rng(1)
    heads, batch, qlen, mlen = 2, 2, 12, 12
    klen = qlen + mlen
    content = tf.constant(rng.normal(0, 3, [heads, batch, qlen, klen]), tf.float32)
    position = tf.constant(rng.normal(0, 3, [heads, batch, qlen, klen + 1]), tf.float32)
    weights = tf.constant(rng.normal(size=[heads, batch, qlen, klen]), tf.float32)
    bias = attention_bias(qlen, mlen)
    half = _value_and_grads(lambda c, p: fused_mod.rel_softmax(c, p, bias),
                            tf.cast(content, tf.bfloat16), tf.cast(position, tf.bfloat16), weights)
    # The float32 reference of the same bfloat16 inputs: the kernel adds them in float32, then rounds the output.
    full = _value_and_grads(lambda c, p: _reference(c, p, bias),
                            tf.cast(tf.cast(content, tf.bfloat16), tf.float32),
                            tf.cast(tf.cast(position, tf.bfloat16), tf.float32), weights)
    np.testing.assert_allclose(half[0], full[0], atol=2 ** -8)  # probabilities <= 1: bfloat16's 8 bits
    for got, want in zip(half[1:], full[1:], strict=True):
        # The incoming gradient is rounded to bfloat16 before the kernel sees it (probs are bfloat16).
        np.testing.assert_allclose(got, want, atol=0.02 * np.abs(want).max())


def test_bad_shapes_name_the_tensor():
    library = fused_mod._library_or_raise()
    with pytest.raises(tf.errors.InvalidArgumentError, match="position must be"):
        library.txl_rel_softmax(tf.zeros([2, 3, 4]), tf.zeros([2, 3, 4]), tf.zeros([3, 4]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="bias must be"):
        library.txl_rel_softmax(tf.zeros([2, 3, 4]), tf.zeros([2, 3, 5]), tf.zeros([4, 3]))


def _layer(seed=0):
    tf.random.set_seed(seed)
    layer = RelativeMultiHeadAttention(d_model=16, n_head=2, d_head=8)
    layer.build((None, None, 16))
    return layer


def _attention_step(layer, training, kernels):
    rng = np.random.default_rng(2)
    x = tf.constant(rng.normal(size=[2, 6, 16]), tf.float32)
    memory = tf.constant(rng.normal(size=[2, 5, 16]), tf.float32)
    pos = tf.constant(rng.normal(size=[11, 16]), tf.float32)
    u = tf.constant(rng.normal(size=[2, 8]), tf.float32)
    v = tf.constant(rng.normal(size=[2, 8]), tf.float32)
    with tf.GradientTape() as tape:
        out = layer(x, LayerMemory(memory), mem_len=5, position_encoding=pos, attention_bias=attention_bias(6, 5),
                    content_bias=u, position_bias=v, training=training, kernels=kernels)[0]
        loss = tf.reduce_sum(out * out)
    return [out.numpy()] + [g.numpy() for g in tape.gradient(loss, layer.trainable_weights)]


def test_training_layer_equals_tensorflow_ops():
    """A training call of the attention layer (no dropout) gives TensorFlow's outputs and weight gradients."""
    layer = _layer()
    fused = _attention_step(layer, training=True, kernels=True)
    plain = _attention_step(layer, training=True, kernels=False)
    for got, want in zip(fused, plain, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def _op_types(training, kernels=True):
    layer = _layer()
    fn = tf.function(lambda: _attention_step_graph(layer, training, kernels))
    return {op.type for op in fn.get_concrete_function().graph.get_operations()}


def _attention_step_graph(layer, training, kernels):
    x = tf.ones([1, 4, 16])
    out = layer(x, LayerMemory(tf.ones([1, 3, 16])), mem_len=3, position_encoding=tf.ones([7, 16]),
                attention_bias=attention_bias(4, 3), content_bias=tf.ones([2, 8]), position_bias=tf.ones([2, 8]),
                training=training, kernels=kernels)[0]
    return out


_ATTENTION_OPS = {"TxlRelSoftmax", "TxlAddLayerNorm", "TxlSplitHeads", "TxlMergeHeads"}


def test_used_for_training_calls_with_the_kernels_policy_only():
    assert _ATTENTION_OPS <= _op_types(training=True)
    # Inference and SavedModels keep TensorFlow's ops.
    assert not _ATTENTION_OPS & _op_types(training=False)
    assert not _ATTENTION_OPS & _op_types(training=True, kernels=False)


def test_applies_is_a_pure_function_of_its_arguments():
    assert fused_mod.applies(True, tf.float32, True) and fused_mod.applies(True, "bfloat16", True)
    assert not fused_mod.applies(False, tf.float32, True)
    assert not fused_mod.applies(True, tf.float32, False) and not fused_mod.applies(True, tf.float32, None)
    assert not fused_mod.applies(True, tf.float16, True)


def test_a_failed_build_says_why_and_a_fused_layer_names_it(tmp_path):
    """A broken compiler: `unavailable` names the compiler's log (the trainer then trains with TensorFlow's ops,
    tests/test_train_kernels.py), and a layer built with the kernels anyway stops with that reason."""
    script = (
        "import tensorflow as tf\n"
        "from txl_tf.model import fused\n"
        "from txl_tf.model.dropout import Dropout\n"
        "print('unavailable:', fused.unavailable())\n"
        "Dropout(0.5)(tf.ones([4]), training=True, kernels=True)\n"
    )
    env = {**os.environ, "CXX": "false", "TXL_TF_CACHE": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "unavailable: " in proc.stdout and "failed; its output is in" in proc.stdout, proc.stdout
    assert "the fused CPU kernels are unavailable: " in proc.stderr and "TrainConfig.kernels='tf'" in proc.stderr
    log = next(tmp_path.rglob("*.log"))
    assert "false" in log.read_text()


def test_dropout_rate_scale_and_gradient():
    """The kernel drops round(rate * 65536) / 65536 of the elements, scales the rest by 1 / (1 - rate), and its
    gradient uses the same mask."""
    x = tf.random.normal([64, 1001], seed=1) + 3.0  # no exact zeros in the input
    seed = tf.constant([7, 11], tf.int32)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = fused_mod.dropout(x, seed, round(0.1 * 65536), 1 / 0.9)
        loss = tf.reduce_sum(y * 2.0)
    grad, y, x = tape.gradient(loss, x).numpy(), y.numpy(), x.numpy()
    kept = y != 0
    assert abs(1 - kept.mean() - 0.1) < 0.004, kept.mean()  # 64,064 elements: std of the rate ~0.0012
    np.testing.assert_allclose(y[kept], x[kept] / 0.9, rtol=1e-6)
    np.testing.assert_array_equal(grad != 0, kept)
    np.testing.assert_allclose(grad[kept], 2.0 / 0.9, rtol=1e-6)
    # Same seed, same mask; another seed, another mask; a mask that does not repeat across the tensor's rows.
    np.testing.assert_array_equal(fused_mod.dropout(x, seed, 6554, 1 / 0.9).numpy(), y)
    assert not np.array_equal(fused_mod.dropout(x, seed + 1, 6554, 1 / 0.9).numpy() != 0, kept)
    assert not np.array_equal(kept[0], kept[1])


def test_dropout_bfloat16_and_layer():
    x = tf.ones([3, 5, 40], tf.bfloat16)
    y = fused_mod.dropout(x, tf.constant([1, 2]), 32768, 2.0)
    assert y.dtype == tf.bfloat16
    assert set(np.unique(y.numpy().astype(np.float32))) == {0.0, 2.0}
    # The layer takes the kernel in training calls when built with it, else TensorFlow's ops; both reproducible
    # from the Keras seed and with the rate's drop probability, and their masks differ.
    masks = []
    for kernels in (True, False):
        outs = []
        for _ in range(2):
            layer = Dropout(0.25, seed=3)
            outs.append(layer(tf.ones([50, 200]), training=True, kernels=kernels).numpy())
        np.testing.assert_array_equal(outs[0], outs[1])
        assert abs((outs[0] == 0).mean() - 0.25) < 0.01
        masks.append(outs[0] == 0)
    assert not np.array_equal(masks[0], masks[1])
    for kernels in (True, False):
        layer = Dropout(0.2)
        graph = tf.function(lambda lay=layer, k=kernels: lay(tf.ones([4, 4]), training=True, kernels=k)
                            ).get_concrete_function().graph
        assert ("TxlDropout" in {op.type for op in graph.get_operations()}) == kernels


def test_dropout_bad_input():
    with pytest.raises(tf.errors.InvalidArgumentError, match="seed must be"):
        fused_mod.dropout(tf.ones([4]), tf.constant([1, 2, 3]), 10, 1.0)


def test_dropout_draws_tensorflows_philox_stream():
    """The kernel's Philox4x32-10 is TensorFlow's: its mask is the one TensorFlow's own Philox op's 16-bit halves
    give for the same key and counter (a reimplementation error would change the bits)."""
    n = 8 * 64 * 3 + 5  # three of the kernel's chunks and a partial block
    seed = tf.constant([123456, -7], tf.int32)
    key = (np.uint64(np.int32(-7).view(np.uint32)) | (np.uint64(123456) << np.uint64(32)))
    words = tf.raw_ops.StatelessRandomUniformFullIntV2(
        shape=[4 * ((n + 7) // 8)], key=tf.constant([key], tf.uint64), counter=tf.constant([0, 0x74786C5F], tf.uint64),
        alg=1, dtype=tf.uint32).numpy()  # alg 1: Philox
    bits = np.stack([words & 0xFFFF, words >> 16], axis=1).reshape(-1)[:n]
    for threshold in (1, 6554, 32768, 65535):
        kept = fused_mod.dropout(tf.ones([n]), seed, threshold, 1.0).numpy() != 0
        np.testing.assert_array_equal(kept, bits >= threshold)


def test_bias_broadcasts_like_tensorflows_add():
    """A mask that broadcasts to [L, K] (here one row for every query) is taken as TensorFlow's add takes it."""
    rng = np.random.default_rng(4)
    content = tf.constant(rng.normal(size=[2, 1, 4, 6]), tf.float32)
    position = tf.constant(rng.normal(size=[2, 1, 4, 7]), tf.float32)
    row = attention_bias(4, 2)[-1:]  # [1, K]
    np.testing.assert_allclose(fused_mod.rel_softmax(content, position, row).numpy(),
                               _reference(content, position, row).numpy(), atol=1e-6)


def test_describe_names_each_choice():
    assert fused_mod.describe("tf") == "TensorFlow's ops"
    assert fused_mod.describe("fused").startswith("fused C++ CPU kernels in training steps")
    with pytest.raises(ValueError, match="kernels='auto': use one of tf, fused"):
        fused_mod.describe("auto")


def _norm(width, epsilon, seed, **kwargs):
    norm = keras.layers.LayerNormalization(epsilon=epsilon, **kwargs)
    norm.build((None, None, width))
    rng = np.random.default_rng(seed)
    if norm.gamma is not None:
        norm.gamma.assign(rng.normal(1, 0.5, [width]).astype(np.float32))
    if norm.beta is not None:
        norm.beta.assign(rng.normal(0, 0.5, [width]).astype(np.float32))
    return norm


def _norm_value_and_grads(fn, norm, x, residual, weights):
    with tf.GradientTape() as tape:
        tape.watch([x, residual])
        y = tf.cast(fn(x, residual), tf.float32)
        loss = tf.reduce_sum(y * weights)
    grads = tape.gradient(loss, [x, residual, *norm.trainable_weights])
    return [y.numpy()] + [tf.cast(g, tf.float32).numpy() for g in grads]


@pytest.mark.parametrize("shape,epsilon", [([2, 5, 16], 1e-12), ([1, 1, 8], 1e-5), ([3, 40, 24], 1e-12)])
def test_add_layer_norm_float32_equals_keras(shape, epsilon):
    """LayerNorm(x + residual) and its gradients for x, residual, gamma and beta equal Keras' layer (3 x 40 rows
    span several blocks of gamma's and beta's partial sums, the last one partial)."""
    rng = np.random.default_rng(len(shape) + shape[-1])
    x = tf.constant(rng.normal(2, 3, shape), tf.float32)
    residual = tf.constant(rng.normal(0, 1, shape), tf.float32)
    weights = tf.constant(rng.normal(size=shape), tf.float32)
    norm = _norm(shape[-1], epsilon, seed=shape[0])
    fused = _norm_value_and_grads(lambda a, b: fused_mod.add_layer_norm(norm, a, b, True), norm, x, residual,
                                  weights)
    keras_ = _norm_value_and_grads(lambda a, b: norm(a + b), norm, x, residual, weights)
    for got, want, name in zip(fused, keras_, ["y", "d_x", "d_residual", "d_gamma", "d_beta"], strict=True):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5, err_msg=name)
    # Deterministic: the same inputs give the same bits (gamma's and beta's sums are added in a fixed order).
    again = _norm_value_and_grads(lambda a, b: fused_mod.add_layer_norm(norm, a, b, True), norm, x, residual,
                                  weights)
    for got, want in zip(again, fused, strict=True):
        np.testing.assert_array_equal(got, want)


def test_add_layer_norm_bfloat16_within_rounding():
    rng = np.random.default_rng(3)
    x = tf.constant(rng.normal(1, 2, [2, 9, 32]), tf.bfloat16)
    residual = tf.constant(rng.normal(0, 1, [2, 9, 32]), tf.bfloat16)
    weights = tf.constant(rng.normal(size=[2, 9, 32]), tf.float32)
    norm = _norm(32, 1e-12, seed=4)
    half = _norm_value_and_grads(lambda a, b: fused_mod.add_layer_norm(norm, a, b, True), norm, x, residual,
                                 weights)
    # Keras' float32 result for the same bfloat16 inputs (the kernel adds them in float32, then rounds the output).
    full = _norm_value_and_grads(lambda a, b: norm(tf.cast(a, tf.float32) + tf.cast(b, tf.float32)), norm, x,
                                 residual, weights)
    for got, want, name in zip(half, full, ["y", "d_x", "d_residual", "d_gamma", "d_beta"], strict=True):
        # y and the input gradients are rounded to bfloat16's 8 bits; gamma's and beta's are float32 sums of
        # bfloat16 incoming gradients.
        np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max(), err_msg=name)


def test_add_layer_norm_bad_shapes():
    library = fused_mod._library_or_raise()
    with pytest.raises(tf.errors.InvalidArgumentError, match="residual must have x's shape"):
        library.txl_add_layer_norm(tf.zeros([4, 8]), tf.zeros([4, 6]), tf.ones([8]), tf.zeros([8]), epsilon=1e-5)
    with pytest.raises(tf.errors.InvalidArgumentError, match="gamma and beta must be"):
        library.txl_add_layer_norm(tf.zeros([4, 8]), tf.zeros([4, 8]), tf.ones([6]), tf.zeros([6]), epsilon=1e-5)


def test_add_layer_norm_keeps_keras_for_other_norms():
    """Norms the kernel does not compute (without beta or gamma) run Keras' layer."""
    x = tf.ones([2, 3, 8])
    for kwargs in ({"center": False}, {"scale": False}):
        norm = _norm(8, 1e-6, seed=0, **kwargs)
        graph = tf.function(lambda n=norm: fused_mod.add_layer_norm(n, x, x, True)).get_concrete_function().graph
        assert "TxlAddLayerNorm" not in {op.type for op in graph.get_operations()}


def test_feed_forward_training_equals_tensorflow_ops():
    """A training call of the feed-forward layer (no dropout) gives Keras' outputs and weight gradients."""
    tf.random.set_seed(5)
    layer = PositionwiseFeedForward(d_model=16, d_inner=32)
    layer.build((None, None, 16))
    x = tf.constant(np.random.default_rng(6).normal(size=[2, 7, 16]), tf.float32)

    def step(kernels):
        with tf.GradientTape() as tape:
            tape.watch(x)
            out = layer(x, training=True, kernels=kernels)
            loss = tf.reduce_sum(out * out)
        return [out.numpy()] + [g.numpy() for g in tape.gradient(loss, [x, *layer.trainable_weights])]

    graph = tf.function(lambda: layer(x, training=True, kernels=True)).get_concrete_function().graph
    assert {"TxlAddLayerNorm", "TxlBiasReluDropout"} <= {op.type for op in graph.get_operations()}
    fused = step(True)
    plain = step(False)
    for got, want in zip(fused, plain, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rate", [0.0, 0.25])
def test_bias_relu_dropout_equals_bias_relu_then_dropout(rate):
    """The feed-forward kernel gives relu(z + bias) dropped with TxlDropout's bits for the same seed, bit for bit in
    float32, and its gradients (for z: through the mask and ReLU; for bias: the column sums) equal TensorFlow's."""
    rng = np.random.default_rng(7)
    z = tf.constant(rng.normal(size=[37, 24]), tf.float32)  # 888 elements: two Philox chunks, the last partial
    bias = tf.constant(rng.normal(size=[24]), tf.float32)
    weights = tf.constant(rng.normal(size=[37, 24]), tf.float32)
    seed = tf.constant([3, 11], tf.int32)
    layer = Dropout(rate)
    threshold, scale = layer.threshold, 1.0 / (1.0 - rate)

    def run(fn):
        with tf.GradientTape() as tape:
            tape.watch([z, bias])
            y = fn(z, bias)
            loss = tf.reduce_sum(y * weights)
        return [y.numpy()] + [g.numpy() for g in tape.gradient(loss, [z, bias])]

    fused = run(lambda a, b: fused_mod.bias_relu_dropout(a, b, seed, threshold, scale))
    reference = run(lambda a, b: fused_mod.dropout(tf.nn.relu(a + b), seed, threshold, scale))
    np.testing.assert_array_equal(fused[0], reference[0])
    np.testing.assert_allclose(fused[1], reference[1], rtol=1e-6)
    np.testing.assert_allclose(fused[2], reference[2], rtol=1e-5, atol=1e-5)
    kept = fused[0] != 0
    assert abs(1 - kept.mean() / (tf.nn.relu(z + bias).numpy() != 0).mean() - rate) < 0.06
    half = fused_mod.bias_relu_dropout(tf.cast(z, tf.bfloat16), bias, seed, threshold, scale)
    np.testing.assert_allclose(tf.cast(half, tf.float32).numpy(), fused[0], atol=2 ** -7 * np.abs(fused[0]).max())


def test_bias_relu_dropout_bad_shapes():
    library = fused_mod._library_or_raise()
    with pytest.raises(tf.errors.InvalidArgumentError, match="bias must be"):
        library.txl_bias_relu_dropout(tf.zeros([4, 8]), tf.zeros([6]), tf.zeros([2], tf.int32), threshold=0,
                                      scale=1.0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="grad must have y's shape"):
        library.txl_bias_relu_dropout_grad(tf.zeros([4, 6]), tf.zeros([4, 8]), scale=1.0)


@pytest.mark.parametrize("dtype", [tf.float32, tf.bfloat16])
@pytest.mark.parametrize("splits,heads,batch,length,d_head", [(1, 2, 3, 5, 4), (2, 3, 2, 7, 8), (3, 1, 1, 1, 6)])
def test_split_and_merge_heads_are_tensorflows_split_and_transpose(dtype, splits, heads, batch, length, d_head):
    """Bit for bit tf.split + reshape + transpose (and back), with gradients; a part left unused gets zeros."""
    x = tf.cast(tf.random.stateless_normal([batch, length, splits * heads * d_head], [3, splits]), dtype)
    parts = tf.split(x, splits, axis=-1)
    want = [tf.transpose(tf.reshape(p, [batch, length, heads, d_head]), [2, 0, 1, 3]) for p in parts]
    with tf.GradientTape() as tape:
        tape.watch(x)
        got = fused_mod.split_heads(x, heads, splits)
        loss = tf.reduce_sum(tf.cast(got[0], tf.float32) * 3.0)  # the other parts unused
    assert len(got) == splits
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype and g.shape == w.shape
        np.testing.assert_array_equal(tf.cast(g, tf.float32).numpy(), tf.cast(w, tf.float32).numpy())
    grad = tf.cast(tape.gradient(loss, x), tf.float32).numpy()
    np.testing.assert_array_equal(grad, tf.concat([tf.fill(tf.shape(parts[0]), 3.0)] + [
        tf.zeros_like(tf.cast(p, tf.float32)) for p in parts[1:]], axis=-1).numpy())
    heads_in = [tf.identity(h) for h in want]
    with tf.GradientTape() as tape:
        tape.watch(heads_in)
        merged = fused_mod.merge_heads(heads_in, heads)
        loss = tf.reduce_sum(tf.cast(merged, tf.float32) * tf.cast(x, tf.float32))
    np.testing.assert_array_equal(tf.cast(merged, tf.float32).numpy(), tf.cast(x, tf.float32).numpy())
    for g, w in zip(tape.gradient(loss, heads_in), want, strict=True):  # d(sum merged * x)/d heads = split of x
        np.testing.assert_array_equal(tf.cast(g, tf.float32).numpy(), tf.cast(w, tf.float32).numpy())


def test_split_and_merge_heads_bad_shapes():
    library = fused_mod._library_or_raise()
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="num_splits \\* num_heads = 6"):
        library.txl_split_heads(tf.zeros([2, 3, 8]), num_heads=3, num_splits=2)
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="heads\\[1\\] must have heads\\[0\\]'s"):
        library.txl_merge_heads([tf.zeros([2, 1, 3, 4]), tf.zeros([2, 1, 4, 4])], num_heads=2)
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="num_heads = 2"):
        library.txl_merge_heads([tf.zeros([3, 1, 3, 4])], num_heads=2)
