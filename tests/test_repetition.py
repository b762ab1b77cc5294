"""The corpus measurement (txl_tf.analysis.repetition): running counts and the order-k model against plain loops,
and text whose answer is known: a random block repeated at a known distance recurs (and pays) only in the windows
that reach it."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from txl_tf.analysis import repetition
from txl_tf.base.errors import UserError
from txl_tf.data import corpora
from txl_tf.data import prepare as prep

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def random_tokens(n, vocab, seed):
    return np.random.default_rng(seed).integers(0, vocab, size=n)


def test_running_counts_equal_plain_loops():
    keys = random_tokens(500, 7, seed=1)
    values = random_tokens(500, 2, seed=2).astype(bool)
    counts = [sum(keys[j] == keys[i] for j in range(i)) for i in range(keys.size)]
    sums = [sum(values[j] for j in range(i) if keys[j] == keys[i]) for i in range(keys.size)]
    prev = [max([j for j in range(i) if keys[j] == keys[i]], default=-1) for i in range(keys.size)]
    assert repetition.prior_counts(keys).tolist() == counts
    assert repetition.prior_sums(keys, values).tolist() == sums
    assert repetition.previous_occurrence(keys).tolist() == prev


def naive_order_k(tokens, vocab, order):
    """Interpolated Witten-Bell, one token at a time with dictionaries."""
    counts = [dict() for _ in range(order + 1)]  # level k: context tuple -> {symbol: count}
    out = []
    for i, x in enumerate(tokens):
        p = 1.0 / vocab
        for k in range(order + 1):
            context = tuple([vocab] * max(0, k - i) + list(tokens[max(0, i - k):i]))
            seen = counts[k].get(context, {})
            total, distinct = sum(seen.values()), len(seen)
            if total:
                p = (seen.get(x, 0) + distinct * p) / (total + distinct)
        out.append(p)
        for k in range(order + 1):
            context = tuple([vocab] * max(0, k - i) + list(tokens[max(0, i - k):i]))
            level = counts[k].setdefault(context, {})
            level[x] = level.get(x, 0) + 1
    return np.array(out)


def test_order_k_model_equals_a_plain_loop_and_sums_to_one():
    vocab = 4
    tokens = np.concatenate([random_tokens(300, vocab, seed=3), np.tile([0, 1, 2], 40)])
    model = repetition.ContextModel(tokens, vocab, order=2)
    np.testing.assert_allclose(model.p, naive_order_k(tokens.tolist(), vocab, 2), rtol=1e-12)
    positions = np.array([0, 1, 5, 150, 299, 400, 419])
    total = sum(model.probability_of(positions, np.full(positions.size, s)) for s in range(vocab))
    np.testing.assert_allclose(total, 1.0, rtol=1e-12)
    np.testing.assert_allclose(model.probability_of(positions, tokens[positions]), model.p[positions], rtol=1e-12)


def test_match_lengths_count_backwards_up_to_the_cap():
    tokens = np.array([5, 1, 2, 3, 9, 1, 2, 3, 7])
    assert repetition.match_lengths(tokens, np.array([8, 8]), np.array([4, 3])).tolist() == [3, 0]
    assert repetition.match_lengths(tokens, np.array([8]), np.array([4]), cap=2).tolist() == [2]


DISTANCE = 3000  # the period of the repeated block: between the windows 2,048 and 4,096
WINDOWS = (1024, 2048, 4096, 8192)


def test_a_repeat_at_a_known_distance_recurs_and_pays_only_within_windows_that_reach_it():
    block = random_tokens(DISTANCE, 50, seed=4)  # no 8 tokens of it occur twice (50 ** 8 strings)
    tokens = np.tile(block, 8)
    result = repetition.measure_tokens(tokens, 50, windows=WINDOWS, positions=2000, seed=5)
    assert result["recurrence"]["fraction"] == {1024: 0.0, 2048: 0.0, 4096: 1.0, 8192: 1.0}
    assert result["recurrence"]["distance_quartiles"] == [DISTANCE] * 3
    bits = result["bits"]
    assert bits["short_range_bits"] > 1.0
    for window in (1024, 2048):  # nothing to match: the mixture is the order-k model itself
        assert bits["windows"][window]["matched"] == 0.0
        assert bits["windows"][window]["saving"] == 0.0
    for window in (4096, 8192):  # every token after the first block is predicted by its copy
        assert bits["windows"][window]["matched"] == pytest.approx(7 / 8, abs=0.01)
        assert bits["windows"][window]["match_right"] == 1.0
        assert bits["windows"][window]["saving"] > 0.15  # of at most ~0.37: the order-k model learns the blocks too


def test_one_planted_copy_pays_in_proportion_to_its_length():
    tokens = random_tokens(40_000, 50, seed=6)
    tokens[30_000:32_000] = tokens[30_000 - DISTANCE:32_000 - DISTANCE]
    bits = repetition.measure_bits(tokens, 50, WINDOWS)
    assert bits["windows"][2048]["saving"] == 0.0
    saved = bits["windows"][4096]["saving"] * tokens.size  # bits saved in all
    assert 0.5 * 2000 < saved < 2000 * np.log2(50)  # about the order-k model's cost of the copy, less learning
    assert bits["windows"][8192]["saving"] == pytest.approx(bits["windows"][4096]["saving"], rel=1e-9)


def test_too_short_for_the_widest_window_is_one_line():
    with pytest.raises(UserError, match="too few to sample positions with a full window of 8,192"):
        repetition.recurrence(np.zeros(5000, np.int64), WINDOWS)


def test_cli_on_a_prepared_folder_writes_tables_and_json(tmp_path):
    block = random_tokens(600, 26, seed=7)
    (tmp_path / "text.txt").write_bytes(bytes((block + ord("a")).astype(np.uint8).tolist()) * 20)
    data_dir = str(tmp_path / "data")
    prep.prepare("text", data_dir, corpora.PrepareSettings(source=str(tmp_path / "text.txt"),
                                                    cache_dir=str(tmp_path / "cache")))
    out = tmp_path / "out" / "repetition.json"
    proc = subprocess.run(
        [sys.executable, "-m", "txl_tf.analysis.repetition", f"--data_dir={data_dir}", "--windows=256,1024",
         "--positions=500", f"--json={out}"],
        capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "| text (data) | 10,800 | 0.0% | 100.0% | 600 |" in proc.stdout
    report = json.loads(out.read_text())
    corpus = report["corpora"][0]
    assert corpus["split"] == "train" and corpus["tokens"] == 10_800 and corpus["vocab_size"] == 26
    assert corpus["bits"]["windows"]["1024"]["saving"] > 0.05 > corpus["bits"]["windows"]["256"]["saving"] == 0.0
    bad = subprocess.run([sys.executable, "-m", "txl_tf.analysis.repetition", f"--data_dir={data_dir}",
                          "--split=nope"], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": REPO}, timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "has no 'nope' split" in bad.stderr
