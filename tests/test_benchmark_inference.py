"""The serving benchmark runs end to end on a tiny random model, exporting a real SavedModel, and prints its
tables (latency percentiles that are ordered, tokens/s for both paths with their spread, the ratios, and with
--peer=gpt2 keras-hub's GPT-2 beside them)."""

import math
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def run_benchmark(*args):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "benchmark_inference.py"), *args],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def numbers(text):
    """The figures of a table cell such as '1,234 (1,100-1,300)' or '0.95x'."""
    return [float(x.replace(",", "")) for x in re.findall(r"nan|inf|[0-9][0-9,]*(?:\.[0-9]+)?", text)]


def table(stdout, header):
    """The rows of the table under `header` (its cells, stripped)."""
    lines = stdout.split(header + "\n")[1].split("\n\n")[0].splitlines()[1:]
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines if line.startswith("|")]


def test_gpt2_peer_table():
    """--peer=gpt2: a ratio row per batch and context, every figure (median, min, max of GPT-2's and both
    Transformer-XL paths' rounds, and of the per-round ratios) positive and finite, min <= median <= max. No timing bound. One
    context: two took ~48 s on a 2-core machine. 64 new tokens: this model's ~3 us a token made 24 a difference of
    ~70 us, which a busy machine's noise between two calls could hide in every round of a cell (nan cells, CI of
    2026-11-29 beside another Bazel test); such a round is timed again (`RETRIES`)."""
    stdout = run_benchmark("--arch=1,16,2,8,32", "--n_token=11", "--mem_len=16", "--max_len=8", "--contexts=4",
                           "--batches=1", "--tokens=64", "--most_tokens=64", "--segments=1", "--repeats=2",
                           "--stream_tokens=48", "--peer=gpt2")
    rows = table(stdout, "| batch | context | GPT-2 | Transformer-XL Python | Transformer-XL SavedModel | "
                         "ratio Python | ratio SavedModel |")
    assert [(row[0], row[1]) for row in rows] == [("1", "4")], stdout
    for row in rows:
        assert len(row) == 7 and all(row[:2]) and "x (" in row[5] and "x (" in row[6], row
        for text in row[2:]:  # both models' rounds, then the per-round ratios
            median, low, high = numbers(text)
            assert all(math.isfinite(x) and x > 0 for x in (median, low, high)) and low <= median <= high, row
    assert "GPT-2 (keras-hub GPT2CausalLM, greedy, XLA)" in stdout
    # Streaming at batch 1: ms per token after the first piece, to the first piece, the loop's, their ratio.
    streamed = table(stdout, "| context | pieces | new tokens | streamed ms/token | first piece ms | loop ms/token | "
                             "streamed / loop |")
    # 3 pieces of --stream_chunk=16, then the default's pieces sized by time
    assert [row[:3] for row in streamed] == [["4", "16", "48"], ["4", "by time", "48"]], stdout
    # read against a loop making the stream's 48 new tokens (the same width), not --tokens=64
    assert "the loop making 48:" in stdout, stdout
    for row in streamed:
        median, low, high = numbers(row[3])
        first, loop, ratio = (numbers(cell) for cell in row[4:])
        # The loop's ms per token is printed to 0.001 ms: this tiny model's (~3 us, and less in a noisy round) may
        # print as 0.000; the ratio is computed before rounding.
        assert 0 < low <= median <= high and all(x > 0 for x in first + ratio) and loop[0] >= 0, streamed
        assert all(math.isfinite(x) for x in first + loop + ratio), streamed


# slow: ~150 s (500 tokens a cell, the generator compiled for three widths per cell); CI runs it in its slow phase
@pytest.mark.slow
def test_tiny_benchmark_prints_latencies():
    stdout = run_benchmark("--arch=2,16,2,8,24", "--n_token=11", "--mem_len=24", "--max_len=8", "--contexts=5,24",
                           "--batches=1,3", "--tokens=500", "--segments=2", "--repeats=3")  # ~20 us a token here
    rows = [line for line in stdout.splitlines() if line.startswith(("| Python |", "| SavedModel |"))]
    generation = [r for r in rows if r.count("|") == 8]
    scoring = [r for r in rows if r.count("|") == 7]
    assert len(generation) == 2 * 2 * 2 and len(scoring) == 2 * 2  # paths x batches x contexts; paths x batches
    for row in generation:
        cells = [c.strip() for c in row.strip("|").split("|")]
        p50, p90, p99 = float(cells[3]), float(cells[4]), float(cells[5])
        speed, low, high = numbers(cells[6])
        assert 0 < p50 <= p90 <= p99 and 0 < low <= speed <= high
    assert "SavedModel / Python tokens/s" in stdout and "p50 at context 24 / at 5" in stdout
    bounds = table(stdout, "| batch | context | ring slots | MB read per step | bound tokens/s | Python loop tokens/s "
                           "| of the bound |")
    loops = {(row[1], row[2]): row[6] for row in table(stdout, "| path | batch | context | p50 ms | p90 ms | p99 ms | "
                                                              "tokens/s |") if row[0] == "Python"}
    for row in bounds:  # the loop's cell as in the generation table, its median's share of the bound
        assert row[5] == loops[row[0], row[1]], (row, loops)
        share = numbers(row[5])[0] / float(row[4].replace(",", "")) * 100
        assert row[6].endswith("%") and abs(float(row[6][:-1]) - share) <= 0.5 + 1e-9, row
    bounds = [[float(c.replace(",", "")) for c in row[:5]] for row in bounds]
    # The loop's longer call makes >= 500 tokens, past the memory of 24: a ring of 25 slots. Its 2 layers x 25
    # positions x 16 floats, keys and values of each row and the shared position keys: (2 x batch + 1) x 3,200
    # bytes a step.
    assert [tuple(row[:4]) for row in bounds] == [(1, 5, 25, 0.010), (1, 24, 25, 0.010), (3, 5, 25, 0.022),
                                                  (3, 24, 25, 0.022)], bounds
    assert all(row[4] > 0 for row in bounds)


def test_ring_fit_recovers_a_steps_fixed_cost_and_the_reads_rate():
    """The line through the loop's seconds a step against its ring: rounds made from a known line (2 ms a step
    plus 1 us a slot) give that line back, the slope's bytes a second, and the fixed share of the longest ring's
    step; a batch timed at one ring size gets no line, and a cell lost in noise (nan) is left out."""
    sys.path.insert(0, REPO)
    from scripts import benchmark_inference as bench
    from txl_tf.model.protocol import Protocol
    from txl_tf.model.transformer_xl import TransformerXL

    model = TransformerXL(n_token=11, n_layer=2, d_model=16, n_head=2, d_head=8, d_inner=32, dropout=0.0,
                          dropatt=0.0, mem_len=100)
    protocol = Protocol(100)
    batch = 4

    def rounds(positions):  # tokens/s of a step of 2 ms + 1 us a slot, with a spread
        seconds = 2e-3 + 1e-6 * bench.ring_slots(protocol, positions)
        return [batch / seconds * factor for factor in (0.9, 1.0, 1.1)]

    rows = [(batch, 10, 30, rounds(30)), (batch, 50, 70, rounds(70)), (batch, 90, 140, rounds(140)),
            (batch, 95, 120, [float("nan")] * 3), (1, 10, 30, rounds(30))]
    [(fit_batch, fixed, per_slot, rate, share)] = bench.ring_fits(model, protocol, rows)
    assert fit_batch == batch and fixed == pytest.approx(2e-3, rel=1e-6) and per_slot == pytest.approx(1e-6, rel=1e-6)
    slot_bytes = bench.ring_bytes(model, protocol, batch, 140) / bench.ring_slots(protocol, 140)
    assert rate == pytest.approx(slot_bytes / 1e-6, rel=1e-6)
    assert share == pytest.approx(2e-3 / (2e-3 + 1e-6 * 101), rel=1e-6)


def test_the_ring_products_alone_get_a_line_at_the_batches_the_step_got_one():
    """`product_fits` times the ring's two products alone at the ring sizes of each batch whose step got a line
    (`ring_fits`), and at no other batch; each fit is finite and each timing a positive number of seconds."""
    sys.path.insert(0, REPO)
    from scripts import benchmark_inference as bench
    from txl_tf.model.protocol import Protocol
    from txl_tf.model.transformer_xl import TransformerXL

    model = TransformerXL(n_token=11, n_layer=2, d_model=16, n_head=2, d_head=8, d_inner=32, dropout=0.0,
                          dropatt=0.0, mem_len=100)
    protocol = Protocol(100)
    seconds = bench.ring_products(model, 3, 31, steps=4, repeats=2)
    assert math.isfinite(seconds) and seconds > 0
    rows = [(3, 10, 30, [1e3] * 3), (3, 50, 70, [9e2] * 3), (1, 10, 30, [5e2] * 3)]
    fits = bench.ring_fits(model, protocol, rows)
    assert [fit[0] for fit in fits] == [3]
    products = bench.product_fits(model, protocol, fits, rows)
    assert list(products) == [3] and all(math.isfinite(x) for x in products[3]), products


def test_the_dense_work_and_the_ceiling_it_puts_on_the_share_of_the_bound():
    """`dense_flops` counts a step's products besides the ring by hand (2 layers of q, k, v, output projections
    and feed-forward for each row, the logits, and the few FLOPs of one token's scores against itself), and
    `ceilings` gives, at each fitted batch's longest ring, bound / (bound + dense at the peak)."""
    sys.path.insert(0, REPO)
    from scripts import benchmark_inference as bench
    from txl_tf.model.protocol import Protocol
    from txl_tf.model.transformer_xl import TransformerXL

    model = TransformerXL(n_token=11, n_layer=2, d_model=16, n_head=2, d_head=8, d_inner=32, dropout=0.0,
                          dropatt=0.0, mem_len=100)
    batch, d, width, inner = 3, 16, 16, 32
    per_layer = batch * (2 * d * 3 * width + 2 * width * d + 2 * 2 * d * inner)  # projections, feed-forward
    per_layer += batch * (2 * width + 2 * 2 * width + 2 * width)  # (a)+(c) against the one key, (b)+(d) against it
    per_layer += 2 * d * width  # and rel_shift's zero row, probabilities x values; W_R R of the one position
    expected = 2 * per_layer
    expected += batch * 2 * d * 11  # the logits over 11 tokens
    assert bench.dense_flops(model, batch) == expected
    protocol = Protocol(100)
    rows = [(batch, 10, 30, [1e3] * 3), (batch, 50, 140, [9e2] * 3), (1, 10, 30, [5e2] * 3)]
    fits = [(batch, 2e-3, 1e-6, 1e9, 0.5)]
    [(fit_batch, slots, bound, work, seconds, most)] = bench.ceilings(model, protocol, fits, rows, 10.0, 1e9)
    assert (fit_batch, slots, work) == (batch, 101, expected)
    assert bound == pytest.approx(bench.ring_bytes(model, protocol, batch, 140) / 1e10, rel=1e-9)
    assert seconds == pytest.approx(expected / 1e9) and most == pytest.approx(bound / (bound + expected / 1e9))
    assert 0 < most < 1
    for rows in (batch, 1):  # the dense work alone in an XLA loop; batch 1 through the row kernels
        seconds = bench.dense_seconds(model, rows, steps=4, repeats=2)
        assert math.isfinite(seconds) and seconds > 0


def test_a_short_pair_is_timed_again_in_its_round_and_one_slow_call_does_not_make_the_round():
    """`decode_speeds` on calls of a known cost (20 ms + 0.3 ms a new token) where every 7th call is 50 ms slow: a
    round times the short pair until its calls take ROUND_SECONDS (at most MOST_PAIRS pairs) and reads the
    medians, so every round gives the steps' true rate; a pair of calls longer than ROUND_SECONDS (no slow calls) is
    timed once a round."""
    sys.path.insert(0, REPO)
    from scripts import benchmark_inference as bench

    def timer(fixed, slow_calls):
        made = []

        def run(new, n):
            made.append((new, n))
            return fixed + 3e-4 * (new - 1) + (0.05 if slow_calls and len(made) % 7 == 0 else 0.0)
        return run, made

    quick, quick_calls = timer(0.02, True)
    slow, slow_calls = timer(0.4, False)
    rates, calls = bench.decode_speeds({"quick": (quick, False), "slow": (slow, False)}, rows=2, tokens=64,
                                       repeats=3, most=64)
    assert rates["quick"] == [pytest.approx(2 / 3e-4)] * 3, rates
    assert calls["quick"][0] == 64 and calls["quick"][1] == pytest.approx(0.02)
    pairs = min(bench.MOST_PAIRS, math.ceil(bench.ROUND_SECONDS / (0.04 + 3e-4 * 63)))
    assert pairs > 1 and len(quick_calls) == 4 + 3 * 2 * pairs  # compiling and calibrating pairs, then the rounds
    assert len(slow_calls) == 4 + 3 * 2  # one pair a round
