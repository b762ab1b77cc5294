"""Feed-forward and Transformer-XL block: values from set weights, and the shared layer checks."""

import numpy as np
import pytest
import tensorflow as tf
from layer_test_case import run_layer_checks

from txl_tf.model.attention import attention_bias
from txl_tf.model.block import PositionwiseFeedForward, TransformerXLBlock
from txl_tf.model.embedding import RelativePositionalEncoding
from txl_tf.model.state import LayerMemory

B, L, M, N, D, DM, DI = 2, 3, 5, 2, 7, 12, 11


def _np_layer_norm(x, eps=1e-12):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps)


@pytest.mark.parametrize("pre_lnorm", [False, True])
def test_feed_forward_values(pre_lnorm):
    rng = np.random.default_rng(0)
    layer = PositionwiseFeedForward(DM, DI, pre_lnorm=pre_lnorm)
    layer.build()
    w1, b1, w2, b2 = (rng.normal(size=s).astype(np.float32) for s in [(DM, DI), (DI,), (DI, DM), (DM,)])
    layer.inner.kernel.assign(w1)
    layer.inner.bias.assign(b1)
    layer.outer.kernel.assign(w2)
    layer.outer.bias.assign(b2)
    x = rng.normal(size=(B, L, DM)).astype(np.float32)
    ffn = lambda y: np.maximum(y @ w1 + b1, 0) @ w2 + b2  # noqa: E731
    expected = x + ffn(_np_layer_norm(x)) if pre_lnorm else _np_layer_norm(x + ffn(x))
    np.testing.assert_allclose(layer(x).numpy(), expected, atol=1e-4)


def test_feed_forward_contract():
    x = tf.constant(np.random.default_rng(1).normal(size=(B, L, DM)), tf.float32)
    run_layer_checks(lambda: PositionwiseFeedForward(DM, DI, dropout=0.2), lambda layer, training: layer(x, training=training))


def _block_call():
    rng = np.random.default_rng(2)
    h = tf.constant(rng.normal(size=(B, L, DM)), tf.float32)
    mem = tf.constant(rng.normal(size=(B, M, DM)), tf.float32)
    uv = tf.constant(rng.normal(size=(N, D)), tf.float32)

    def call(layer, training):
        pos = RelativePositionalEncoding(DM, dtype=layer.dtype_policy)(tf.constant(M + L))
        return layer(h, LayerMemory(mem), position_encoding=pos, attention_bias=attention_bias(L, M),
                     content_bias=uv, position_bias=uv, training=training)[0]

    return call


@pytest.mark.parametrize("attn_type", ["xl", "al_rfou"])
def test_block_contract(attn_type):
    run_layer_checks(lambda: TransformerXLBlock(DM, N, D, DI, dropout=0.1, attn_type=attn_type, max_position=9),
                     _block_call())


def test_block_is_attention_then_feed_forward():
    block = TransformerXLBlock(DM, N, D, DI)
    call = _block_call()
    out = call(block, False)
    pos = RelativePositionalEncoding(DM)(tf.constant(M + L))
    rng = np.random.default_rng(2)
    h, mem, uv = rng.normal(size=(B, L, DM)), rng.normal(size=(B, M, DM)), rng.normal(size=(N, D))
    attn = block.attention(tf.constant(h, tf.float32), LayerMemory(tf.constant(mem, tf.float32)),
                           position_encoding=pos, attention_bias=attention_bias(L, M),
                           content_bias=tf.constant(uv, tf.float32), position_bias=tf.constant(uv, tf.float32))[0]
    np.testing.assert_allclose(out.numpy(), block.feed_forward(attn).numpy(), atol=1e-6)


def test_al_rfou_positions_past_the_table_share_its_last_row():
    """A context longer than max_position (K = M + L = 8 > 6) reuses row 5 for positions 5..7, like a table
    whose rows 6 and 7 were copies of row 5."""
    short = TransformerXLBlock(DM, N, D, DI, attn_type="al_rfou", max_position=6)
    out_short = _block_call()(short, False)
    long = TransformerXLBlock(DM, N, D, DI, attn_type="al_rfou", max_position=M + L)
    _block_call()(long, False)
    for target, source in zip(long.weights, short.weights, strict=True):
        value = source.numpy()
        if "absolute_positions" in target.path:
            value = np.concatenate([value, np.repeat(value[-1:], M + L - 6, axis=0)])
        target.assign(value)
    np.testing.assert_allclose(_block_call()(long, False).numpy(), out_short.numpy(), atol=1e-6)
