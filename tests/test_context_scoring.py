"""The fixed scored tokens of study `context` and its copy probe, on token arrays whose answer is known."""

import numpy as np
import pytest

from txl_tf.evaluation import corpus_streams
from txl_tf.study import probe, scoring


def test_kept_positions_are_the_targets_of_the_kept_predictions():
    tokens = np.arange(1, 1002, dtype=np.int32)  # token value = its position + 1
    scored = scoring.ScoredTokens(tokens, batch_size=4, drop=50, block=10, subset_blocks=7)
    streams = corpus_streams(tokens, 4)[0]  # [4, S + 1]
    targets = streams[:, 1:][:, 50:].reshape(-1)  # what the kept predictions predict, in the kept order
    assert scored.stream_len == 250 and scored.count == 4 * 200
    np.testing.assert_array_equal(tokens[scored.positions()], targets)
    subset = scored.subset()
    assert subset.shape == (70,)
    blocks = subset.reshape(7, 10)
    np.testing.assert_array_equal(np.diff(blocks, axis=1), 1)  # consecutive kept tokens ...
    assert len({int(b[0]) // 200 for b in blocks}) >= 3  # ... spread over the streams
    assert all(int(b[0]) // 200 == int(b[-1]) // 200 for b in blocks)  # never across two streams


def test_too_few_tokens_for_the_drop_is_named():
    with pytest.raises(ValueError, match="not more than the 300 dropped"):
        scoring.ScoredTokens(np.zeros(1001, np.int32), batch_size=4, drop=300).check()


def test_probe_streams_repeat_the_span_at_each_distance():
    tokens = np.arange(5000, dtype=np.int32) % 997
    p = probe.Probe(distances=(40, 100, 300), span=12, examples=2, lead=50, seed=3)
    streams, first, second = p.streams(tokens)
    assert streams.shape == (6, p.length + 1)
    for row, a, b, distance in zip(streams, first, second, np.repeat(p.distances, 2), strict=True):
        assert b - a == distance and a >= p.lead and b + p.span == p.length + 1
        np.testing.assert_array_equal(row[b:b + p.span], row[a:a + p.span])
    again = p.streams(tokens)[0]
    np.testing.assert_array_equal(again, streams)  # the seed fixes the probe
    # Prediction j predicts token j + 1: the copy losses read predictions a .. a + span - 2.
    losses = np.tile(np.arange(p.length, dtype=np.float64), (6, 1))
    one, two = p.copy_losses(losses, first, second)
    np.testing.assert_array_equal(one[0], np.arange(first[0], first[0] + p.span - 1))
    np.testing.assert_array_equal(two[0], np.arange(second[0], second[0] + p.span - 1))


def test_probe_summary_by_hand():
    p = probe.Probe(distances=(40, 80), span=3, examples=2, lead=10)
    first = np.full((4, 2), np.log(2.0) * 2)  # 2 bits everywhere
    second = np.array([[0.0, 0.0], [0.0, 0.0], [2.0, 2.0], [2.0, 2.0]]) * np.log(2.0)
    out = probe.summarize(first, second, p)
    assert out["40"]["difference"] == pytest.approx(-2.0) and out["40"]["low"] == pytest.approx(-2.0)
    assert out["80"]["difference"] == pytest.approx(0.0) and out["80"]["high"] == pytest.approx(0.0)
