"""Adaptive softmax: normalised, equal to a full softmax without cutoffs, NLL in token order, tail column order
as in the TF original, all checked against NumPy with explicitly set weights."""

import numpy as np
import pytest
import tensorflow as tf
from layer_test_case import run_layer_checks

from txl_tf.model.embedding import AdaptiveEmbedding
from txl_tf.model.softmax import AdaptiveSoftmax

V, DM, B, L = 19, 6, 2, 5
CUTOFFS = (4, 10)


def _np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _set_random(weights, seed):
    rng = np.random.default_rng(seed)
    values = []
    for w in weights:
        if w is None:
            values.append(None)
            continue
        values.append(rng.normal(size=w.shape).astype(np.float32))
        w.assign(values[-1])
    return values


def _hidden(seed=3):
    return np.random.default_rng(seed).normal(size=(B, L, DM)).astype(np.float32)


def test_full_softmax_without_cutoffs():
    emb = AdaptiveEmbedding(V, DM, d_embed=4)
    emb.build()
    soft = AdaptiveSoftmax(V, DM, d_embed=4)
    soft.build()
    assert soft.tie_projs == (True,) and soft.own_projections == [None]
    table, proj = _set_random(emb.tables + emb.projections, 0)
    (bias,) = _set_random([soft.bias], 1)
    h = _hidden()
    h64 = h.astype(np.float64)  # a float64 reference: float32's own rounding at log-probabilities of -50 is ~4e-6
    expected = _np_log_softmax((h64 @ proj.T) @ table.T + bias)
    np.testing.assert_allclose(soft.log_probs(h, emb.tables, emb.projections).numpy(), expected, rtol=1e-6,
                               atol=1e-5)
    targets = np.array([[0, 18, 5, 5, 2], [7, 1, 0, 9, 3]])
    nll = soft.nll(h, targets, emb.tables, emb.projections).numpy()
    np.testing.assert_allclose(nll, -np.take_along_axis(expected, targets[..., None], -1)[..., 0], atol=1e-5)


@pytest.mark.parametrize("div_val,tie_projs", [(2, (False, True, False)), (1, (False, False, True))])
def test_cutoffs_match_numpy(div_val, tie_projs):
    d_embed = 8 if div_val > 1 else 4
    emb = AdaptiveEmbedding(V, DM, d_embed=d_embed, cutoffs=CUTOFFS, div_val=div_val)
    emb.build()
    soft = AdaptiveSoftmax(V, DM, d_embed=d_embed, cutoffs=CUTOFFS, div_val=div_val, tie_projs=tie_projs)
    soft.build()
    emb_tables = _set_random(emb.tables, 0)
    emb_projs = _set_random(emb.projections, 1)
    own_projs = _set_random(soft.own_projections, 2)
    bias, cluster_w, cluster_b = _set_random([soft.bias, soft.cluster_kernel, soft.cluster_bias], 4)
    edges = [0, *CUTOFFS, V]
    h = _hidden()
    h64 = h.astype(np.float64)  # a float64 reference (see test_full_softmax_without_cutoffs)

    def bin_logits(i):
        table = emb_tables[0][edges[i]:edges[i + 1]] if div_val == 1 else emb_tables[i]
        proj = (emb_projs[0] if div_val == 1 else emb_projs[i]) if tie_projs[i] else own_projs[i]
        return (h64 @ proj.T) @ table.T + bias[edges[i]:edges[i + 1]]

    head = _np_log_softmax(np.concatenate([bin_logits(0), (h64 @ (own_projs[0]).T) @ cluster_w.T + cluster_b],
                                          -1))
    expected = [head[..., :4]]
    for i in (1, 2):  # tail cluster i is head column cutoffs[0] + i - 1
        expected.append(head[..., 4 + i - 1 : 4 + i] + _np_log_softmax(bin_logits(i)))
    expected = np.concatenate(expected, -1)  # [B, L, V]
    log_probs = soft.log_probs(h, emb.tables, emb.projections).numpy()
    np.testing.assert_allclose(log_probs, expected, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(np.exp(log_probs).sum(-1), 1.0, atol=1e-5)
    targets = np.array([[18, 0, 4, 9, 10], [3, 17, 5, 11, 2]])  # bins mixed in every row
    nll = soft.nll(h, targets, emb.tables, emb.projections).numpy()
    np.testing.assert_allclose(nll, -np.take_along_axis(expected, targets[..., None], -1)[..., 0], atol=1e-5)


def test_tie_projs_must_match_bins():
    with pytest.raises(ValueError, match="tie_projs"):
        AdaptiveSoftmax(V, DM, cutoffs=CUTOFFS, tie_projs=(True,))


@pytest.mark.parametrize("kwargs", [dict(), dict(cutoffs=CUTOFFS, div_val=2, d_embed=8)])
def test_layer_contract(kwargs):
    targets = tf.constant([[18, 0, 4, 9, 10], [3, 17, 5, 11, 2]])
    h = tf.constant(_hidden())

    emb = AdaptiveEmbedding(V, DM, **kwargs)  # the tied weights, shared by every softmax the checks make
    emb.build()
    run_layer_checks(
        lambda: AdaptiveSoftmax(V, DM, **kwargs),
        lambda layer, training: layer(h, targets, emb.tables, emb.projections),
        mixed_dtype=tf.float32,  # the loss stays float32 under mixed precision
    )
