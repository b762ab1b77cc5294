"""Attention maps by relative distance: oracle re-indexing, normalisation, PNG and TensorBoard output."""

import glob

import numpy as np
import pytest
import tensorflow as tf

from txl_tf.analysis import attention_maps
from txl_tf.model.protocol import Protocol

N_LAYER, BATCH, N_HEAD, QLEN, MLEN = 2, 3, 4, 5, 6
KLEN = MLEN + QLEN


def _causal_probs(seed=0):
    """Softmax over keys with the Transformer-XL causal mask: query i sees keys 0 .. MLEN + i."""
    logits = np.random.default_rng(seed).normal(size=[N_LAYER, BATCH, N_HEAD, QLEN, KLEN])
    allowed = np.arange(KLEN)[None, :] <= (MLEN + np.arange(QLEN))[:, None]  # [L, K]
    logits = np.where(allowed, logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    return probs / probs.sum(-1, keepdims=True)


def _oracle_sums(probs, max_distance):
    sums = np.zeros([N_LAYER, N_HEAD, max_distance])
    for layer in range(N_LAYER):
        for b in range(BATCH):
            for h in range(N_HEAD):
                for i in range(QLEN):
                    for j in range(KLEN):
                        distance = MLEN + i - j
                        if 0 <= distance < max_distance:
                            sums[layer, h, distance] += probs[layer, b, h, i, j]
    return sums


@pytest.mark.parametrize("max_distance", [4, KLEN, KLEN + 3])
def test_distance_sums_match_loop_oracle(max_distance):
    probs = _causal_probs()
    sums = attention_maps.distance_sums(probs.astype(np.float32), max_distance).numpy()
    assert sums.shape == (N_LAYER, N_HEAD, max_distance)
    np.testing.assert_allclose(sums, _oracle_sums(probs, max_distance), rtol=1e-5, atol=1e-6)


def test_average_rows_are_distributions_when_window_covers_all_keys():
    acc = attention_maps.AttentionMapAccumulator(max_distance=KLEN)
    acc.update(_causal_probs(seed=1))
    acc.update(_causal_probs(seed=2))
    avg = acc.result()
    assert acc.num_queries == 2 * BATCH * QLEN
    assert avg.shape == (N_LAYER, N_HEAD, KLEN)
    np.testing.assert_allclose(avg.sum(-1), 1.0, rtol=1e-5)
    assert (avg >= 0).all()
    # A narrower window keeps only part of the mass, never more than 1.
    narrow = attention_maps.AttentionMapAccumulator(max_distance=3)
    narrow.update(_causal_probs(seed=1))
    assert (narrow.result().sum(-1) < 1.0).all()


def test_attention_on_previous_token_lands_at_distance_one():
    probs = np.zeros([1, 1, 2, QLEN, KLEN], np.float32)
    for i in range(QLEN):
        probs[0, 0, 0, i, MLEN + i - 1] = 1.0  # head 0 looks one token back
        probs[0, 0, 1, i, 0] = 1.0  # head 1 looks at the oldest key: distance MLEN + i
    acc = attention_maps.AttentionMapAccumulator(max_distance=KLEN)
    acc.update(probs)
    avg = acc.result()
    np.testing.assert_allclose(avg[0, 0], np.eye(KLEN)[1])
    np.testing.assert_allclose(avg[0, 1, MLEN:], np.full(QLEN, 1.0 / QLEN))


def test_png_and_tensorboard_image(tmp_path):
    avg = np.random.default_rng(3).uniform(size=[N_LAYER, N_HEAD, 7])
    png = attention_maps.plot_attention_map(avg, str(tmp_path / "map.png"), scale="log")
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "map.png").read_bytes() == png
    attention_maps.write_summary(png, str(tmp_path / "tb"), step=3)
    (event_file,) = glob.glob(str(tmp_path / "tb" / "events.*"))
    tags = []
    for record in tf.data.TFRecordDataset(event_file):
        event = tf.compat.v1.Event.FromString(record.numpy())
        tags += [(value.tag, event.step) for value in event.summary.value]
    assert ("attention_map", 3) in tags
    with pytest.raises(ValueError, match="scale"):
        attention_maps.plot_attention_map(avg, scale="cubic")


@pytest.mark.parametrize("same_length", [False, True])
def test_average_over_a_split_with_a_real_model(same_length):
    from txl_tf.configs import ModelConfig

    tf.keras.utils.set_random_seed(6)
    model = ModelConfig(n_layer=2, d_model=8, n_head=3, d_head=4, d_inner=12, mem_len=4).build(10)
    tokens = np.random.default_rng(0).integers(0, 10, size=70).astype(np.int32)
    avg = attention_maps.average_attention(model, tokens, tgt_len=3, protocol=Protocol(5, same_length=same_length),
                                           batch_size=2, max_segments=4)
    # layers, heads, every reachable distance: 0 .. mem_len with same_length, else 0 .. mem_len + tgt_len - 1
    assert avg.shape == ((2, 3, 6) if same_length else (2, 3, 8))
    np.testing.assert_allclose(avg.sum(-1), 1.0, rtol=1e-5)
    if not same_length:  # the last query of a segment reaches distance mem_len + tgt_len - 1
        assert (avg[..., 7] > 0).all()
    with pytest.raises(ValueError, match="lower max_segments"):
        attention_maps.average_attention(model, tokens, tgt_len=3, protocol=Protocol(5), batch_size=2,
                                         max_segments=40)
