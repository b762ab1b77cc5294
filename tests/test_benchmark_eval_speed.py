"""The Table-7 benchmark script runs end to end on a tiny architecture and prints its table."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # ~8-16 s of subprocesses; CI runs it in its slow phase
def test_tiny_benchmark_prints_ratios():
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "benchmark_eval_speed.py"), "--arch=2,16,2,8,24",
         "--attn_lens=24,40", "--tgt_len=8", "--xl_segments=2", "--vanilla_passes=2", "--n_token=11",
         "--dtypes=float32,mixed_bfloat16"],
        cwd=REPO, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("| 24 ", "| 40 "))]
    assert len(rows) == 4  # two lengths in each precision
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        vanilla_s, xl_ms, ratio = float(cells[1]), float(cells[2]), float(cells[3].rstrip("x"))
        cached_ms, cached_ratio = float(cells[4]), float(cells[5].rstrip("x"))
        assert len(cells) == 8 and cells[6].count("x") == 2  # ratios by CPU time; no peer column without --peer
        assert vanilla_s > 0 and xl_ms > 0 and abs(ratio - vanilla_s / (xl_ms / 1000)) <= 0.5 + 0.02 * ratio
        assert abs(cached_ratio - vanilla_s / (cached_ms / 1000)) <= 0.5 + 0.02 * cached_ratio
    assert "float32, batch 1" in proc.stdout and "mixed_bfloat16, batch 1" in proc.stdout
    assert "load average" in proc.stdout and "authors'" not in proc.stdout
