"""The decoding benchmark runs end to end on a tiny random model: keras-hub's sampler loop in a graph with the
memory moved, under XLA with the memory moved, under XLA with the ring of keys/values, and txl_tf.lm.generation's
Generator, each giving the same greedy tokens, with its table and ratios."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# slow: ~50 s (four paths traced and, for XLA, compiled); CI runs it in its slow phase
@pytest.mark.slow
def test_tiny_benchmark_prints_speeds_of_four_paths_with_the_same_tokens():
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "benchmark_generate.py"), "--arch=2,16,2,8,24",
         "--n_token=11", "--mem_len=12", "--tgt_len=4", "--context=9", "--tokens=6", "--batches=1,3",
         "--repeats=1"],
        cwd=REPO, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, capture_output=True, text=True,
        timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("| txl_tf", "| keras-hub"))]
    assert len(rows) == 4 * 2, proc.stdout
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert float(cells[2].replace(",", "")) > 0 and cells[4] == "yes", row
    assert proc.stdout.count("tokens/s against the keras-hub graph, memory moved") == 2
