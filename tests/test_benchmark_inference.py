"""The serving benchmark runs end to end on a tiny random model, exporting a real SavedModel, and prints its
tables (latency percentiles that are ordered, tokens/s for both paths, the ratios)."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# slow: ~150 s (500 tokens a cell, the generator compiled for three widths per cell); CI runs it in its slow phase
@pytest.mark.slow
def test_tiny_benchmark_prints_latencies():
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "benchmark_inference.py"), "--arch=2,16,2,8,24",
         "--n_token=11", "--mem_len=24", "--max_len=8", "--contexts=5,24", "--batches=1,3", "--tokens=500",
         "--segments=2", "--repeats=3"],  # tokens/s: a slope over three timings, ~20 us a token here
        cwd=REPO, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, capture_output=True, text=True,
        timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("| Python |", "| SavedModel |"))]
    generation = [r for r in rows if r.count("|") == 8]
    scoring = [r for r in rows if r.count("|") == 7]
    assert len(generation) == 2 * 2 * 2 and len(scoring) == 2 * 2  # paths x batches x contexts; paths x batches
    for row in generation:
        cells = [c.strip() for c in row.strip("|").split("|")]
        p50, p90, p99, speed = float(cells[3]), float(cells[4]), float(cells[5]), float(cells[6].replace(",", ""))
        assert 0 < p50 <= p90 <= p99 and speed > 0
    assert "SavedModel / Python tokens/s" in proc.stdout and "p50 at context 24 / at 5" in proc.stdout
    table = proc.stdout.split("| batch | MB read per step | bound tokens/s |")[1].split("\n\n")[0]
    bounds = [[float(c.replace(",", "")) for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    # The ring's 2 layers x 25 positions x 16 floats, keys and values of each row and the shared position keys:
    # (2 x batch + 1) x 3,200 bytes a step.
    assert [(batch, megabytes) for batch, megabytes, _ in bounds] == [(1, 0.010), (3, 0.022)], table
    assert all(bound > 0 for *_, bound in bounds)
