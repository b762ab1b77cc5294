"""scripts/benchmark_memory.py end to end at a tiny size: real child processes, the table and the budget search
(a probe above the budget is killed and does not fit; probes within it do)."""

import re
import subprocess
import sys

import pytest
from train_utils import REPO_ROOT, subprocess_env

TINY = ["--gin_param=ModelConfig.n_layer=2", "--gin_param=ModelConfig.d_model=24", "--gin_param=ModelConfig.n_head=2",
        "--gin_param=ModelConfig.d_head=12", "--gin_param=ModelConfig.d_inner=40", "--tgt_len=64", "--steps=1",
        "--batch=3"]
ROW = re.compile(r"^(\S+/\S+) +(\d+\.\d+) +(-?\d+\.\d+) +(\d+\.\d+) +(\S+) +(\S+)$")
LONGEST = re.compile(r"^(\S+/\S+) +(\d+) +(\S+)$")


def _run(*flags):
    result = subprocess.run([sys.executable, "scripts/benchmark_memory.py", *TINY, *flags], cwd=REPO_ROOT,
                            env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def _table(out, pattern):
    return {m.group(1): m.groups()[1:] for m in map(pattern.match, out.splitlines()) if m}


@pytest.mark.slow  # CI's slow phase: the fast suite stays near 10 minutes on 2 cores
def test_a_row_reports_its_peak_and_a_probe_over_the_budget_is_killed():
    out = _run("--recompute=block", "--budget_gib=0.2", "--max_length=128")
    assert re.search(r"^cpu: .+ \(\d+ cores\)", out, re.M)
    rows = _table(out, ROW)
    assert list(rows) == ["f32/block"]
    peak, over_base, tokens_per_s, _, speed = rows["f32/block"]
    assert 0.2 < float(peak) < 8 and 0 < float(over_base) < float(peak)  # TensorFlow alone holds > 0.2 GiB
    assert float(tokens_per_s) > 0 and speed == "-"  # no f32/none row to compare with
    assert "probe f32/block length 64: peak" in out and "over the budget" in out
    assert _table(out, LONGEST) == {"f32/block": ("0", "-")}


@pytest.mark.slow
def test_both_rows_and_the_longest_segment_within_a_budget():
    out = _run("--budget_gib=6", "--max_length=128")
    rows = _table(out, ROW)
    assert list(rows) == ["f32/none", "f32/block"]
    assert float(rows["f32/block"][0]) > 0 and rows["f32/block"][4].endswith("x")  # speed against f32/none
    assert re.search(r"^goal: f32/block at most a third slower than f32/none: -?\d+% slower", out, re.M)
    assert _table(out, LONGEST) == {"f32/none": ("128", "-"), "f32/block": ("128", "-")}  # 64 and 128 fit
