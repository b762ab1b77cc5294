"""The fixed scored tokens of study `context` and its copy probe, on token arrays whose answer is known."""

import numpy as np
import pytest

from txl_tf.evaluation.loops import corpus_streams
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


def test_probe_streams_repeat_the_span_at_each_distance_and_the_controls_do_not():
    tokens = np.arange(5000, dtype=np.int32) % 997
    p = probe.Probe(distances=(40, 100, 300), span=12, examples=2, lead=50, seed=3)
    streams, first, second = p.streams(tokens)
    assert streams.shape == (12, p.length + 1) and first.shape == second.shape == (6,)
    rows, controls = streams[:6], streams[6:]
    for row, control, a, b, distance in zip(rows, controls, first, second, np.repeat(p.distances, 2), strict=True):
        assert b - a == distance and a >= p.lead and b + p.span == p.length + 1
        np.testing.assert_array_equal(row[b:b + p.span], row[a:a + p.span])
        # The control differs only where the first copy was: the same last span, with no earlier occurrence.
        np.testing.assert_array_equal(control[:a], row[:a])
        np.testing.assert_array_equal(control[a + p.span:], row[a + p.span:])
        assert not np.array_equal(control[a:a + p.span], row[a:a + p.span])
    again = p.streams(tokens)[0]
    np.testing.assert_array_equal(again, streams)  # the seed fixes the probe
    # Prediction j predicts token j + 1: the copy losses read predictions a .. a + span - 2, the control's the
    # second copy's positions of its own row.
    losses = np.arange(12 * p.length, dtype=np.float64).reshape(12, p.length)
    one, two, control = p.copy_losses(losses, first, second)
    np.testing.assert_array_equal(one[0], np.arange(first[0], first[0] + p.span - 1))
    np.testing.assert_array_equal(two[0], np.arange(second[0], second[0] + p.span - 1))
    np.testing.assert_array_equal(control[1], 7 * p.length + np.arange(second[1], second[1] + p.span - 1))


def test_probe_summary_by_hand():
    p = probe.Probe(distances=(40, 80), span=3, examples=2, lead=10)
    first = np.full((4, 2), np.log(2.0) * 2)  # 2 bits everywhere
    second = np.array([[0.0, 0.0], [0.0, 0.0], [2.0, 2.0], [2.0, 2.0]]) * np.log(2.0)
    control = np.array([[3.0, 3.0], [3.0, 3.0], [2.0, 2.0], [2.0, 2.0]]) * np.log(2.0)
    out = probe.summarize(first, second, control, p)
    assert out["40"]["difference"] == pytest.approx(-2.0) and out["40"]["low"] == pytest.approx(-2.0)
    assert out["80"]["difference"] == pytest.approx(0.0) and out["80"]["high"] == pytest.approx(0.0)
    assert out["40"]["copy"] == pytest.approx(-3.0) and out["40"]["copy_high"] == pytest.approx(-3.0)
    assert out["80"]["copy"] == pytest.approx(0.0) and out["80"]["control"] == pytest.approx(2.0)
