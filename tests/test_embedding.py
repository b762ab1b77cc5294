"""Sinusoid relative encodings and the adaptive embedding, checked against explicit values."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf
from layer_test_case import run_layer_checks

from txl_tf.model.embedding import AdaptiveEmbedding, RelativePositionalEncoding

V, DM = 19, 6


def test_relative_encoding_values():
    pos = RelativePositionalEncoding(4)(tf.constant(3)).numpy()  # rows: distances 2, 1, 0
    freqs = np.array([1.0, 1.0 / 100.0])  # 1 / 10000**(0/4), 1 / 10000**(2/4)
    for row, dist in enumerate([2, 1, 0]):
        np.testing.assert_allclose(pos[row], np.concatenate([np.sin(dist * freqs), np.cos(dist * freqs)]),
                                   atol=1e-6)
    clamped = RelativePositionalEncoding(4)(tf.constant(5), clamp_len=2).numpy()  # distances 4,3,2,1,0 -> 2,2,2,1,0
    np.testing.assert_allclose(clamped[:3], np.repeat(pos[:1], 3, 0), atol=1e-6)
    np.testing.assert_allclose(clamped[3:], pos[1:], atol=1e-6)
    layer = RelativePositionalEncoding(8, name="p")
    assert RelativePositionalEncoding.from_config(layer.get_config()).get_config() == layer.get_config()


def test_single_table_without_projection():
    layer = AdaptiveEmbedding(V, DM)
    layer.build()
    table = np.arange(V * DM, dtype=np.float32).reshape(V, DM) / 100
    layer.table_0.assign(table)
    assert layer.projections == [None]
    out = layer(tf.constant([[3, 0, 18]])).numpy()
    np.testing.assert_allclose(out[0], table[[3, 0, 18]] * math.sqrt(DM), rtol=1e-6)


def test_bins_with_div_val():
    layer = AdaptiveEmbedding(V, DM, d_embed=8, cutoffs=(4, 10), div_val=2)
    layer.build()
    assert [tuple(t.shape) for t in layer.tables] == [(4, 8), (6, 4), (9, 2)]
    assert [tuple(p.shape) for p in layer.projections] == [(8, DM), (4, DM), (2, DM)]
    rng = np.random.default_rng(0)
    values = [rng.normal(size=w.shape).astype(np.float32) for w in layer.tables + layer.projections]
    for w, value in zip(layer.tables + layer.projections, values, strict=True):
        w.assign(value)
    tables, projs = values[:3], values[3:]
    ids = np.array([[0, 3, 4, 9, 10, 18]])
    starts = [0, 4, 10]
    bins = [0, 0, 1, 1, 2, 2]  # bin of each id above
    expected = [tables[b][t - starts[b]] @ projs[b] for t, b in zip(ids[0], bins, strict=True)]
    np.testing.assert_allclose(layer(tf.constant(ids)).numpy()[0], np.array(expected) * math.sqrt(DM), rtol=1e-5)


def test_proj_same_dim():
    layer = AdaptiveEmbedding(V, DM, cutoffs=(5,), div_val=2, proj_same_dim=False)
    layer.build()
    assert layer.projections[0] is None and layer.projections[1] is not None
    with pytest.raises(ValueError, match="cutoffs"):
        AdaptiveEmbedding(V, DM, cutoffs=(5, 5))


@pytest.mark.parametrize("kwargs", [dict(), dict(d_embed=4), dict(cutoffs=(4, 10), div_val=2, d_embed=8)])
def test_layer_contract(kwargs):
    ids = tf.constant([[0, 3, 5, 11, 18], [1, 2, 9, 10, 17]])
    run_layer_checks(lambda: AdaptiveEmbedding(V, DM, **kwargs), lambda layer, training: layer(ids))
    keras.config.set_dtype_policy("float32")
