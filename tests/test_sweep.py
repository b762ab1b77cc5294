"""Evaluation sweep on the converted golden fixture: the row at the fixture's own protocol gives its mean NLL,
other rows differ, and the command prints (and writes) one markdown table."""

import json
import os
import subprocess
import sys

import gin
import pytest
from golden_utils import convert_golden, eval_gin, golden_data

from txl_tf import sweep

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
@pytest.fixture(autouse=True)
def _clean_gin():
    yield
    gin.clear_config()


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    converted = convert_golden(tmp / "converted")
    data_dir, expected = golden_data(tmp / "data")
    (tmp / "eval.gin").write_text(eval_gin(data_dir))  # the fixture's own protocol
    return converted, str(tmp / "eval.gin"), expected


def test_grid_rows_and_the_configured_protocol(golden):
    converted, gin_file, expected = golden
    result = sweep.run(checkpoint=converted, gin_files=[gin_file], grid=sweep.parse_grid(
        ["mem_len=0,7", "same_length=false,true"]), log=lambda line: None)
    rows = result["rows"]
    assert [(r["mem_len"], r["same_length"]) for r in rows] == [(0, False), (0, True), (7, False), (7, True)]
    configured = [r for r in rows if r["configured"]]
    assert len(configured) == 1 and configured[0]["mem_len"] == 7 and not configured[0]["same_length"]
    assert abs(configured[0]["loss"] - expected) < 1e-5
    assert all(r["tokens"] == 45 and r["tgt_len"] == 5 for r in rows)
    assert len({round(r["loss"], 6) for r in rows}) == 4  # memory and same_length change the scores
    table = sweep.markdown(result)
    lines = table.splitlines()
    assert lines[2] == "| tgt_len | mem_len | clamp_len | same_length | batch_size | loss | bpc | tokens/s |  |"
    assert len(lines) == 4 + 4 and sum("**" in line for line in lines) == 1
    assert lines[6].startswith(f"| 5 | 7 | -1 | false | 3 | {configured[0]['loss']:.4f} |")
    assert lines[6].endswith("| configured |")


def test_bad_grid_specs_are_named():
    with pytest.raises(ValueError, match="FIELD one of tgt_len"):
        sweep.parse_grid(["memlen=1,2"])
    with pytest.raises(ValueError, match="same_length takes true/false"):
        sweep.parse_grid(["same_length=maybe"])
    with pytest.raises(ValueError, match="names mem_len twice"):
        sweep.parse_grid(["mem_len=1", "mem_len=2"])


def test_command_prints_and_writes_the_table(golden, tmp_path):
    converted, gin_file, _ = golden
    proc = subprocess.run(
        [sys.executable, "-m", "txl_tf.sweep", f"--checkpoint={converted}", f"--gin_file={gin_file}",
         "--grid=tgt_len=4,5", "--grid=mem_len=7", f"--markdown={tmp_path / 'table.md'}",
         f"--json={tmp_path / 'sweep.json'}"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "table.md").read_text() == proc.stdout
    assert [line.split(" | ")[:2] for line in proc.stdout.splitlines()[4:]] == [["| 4", "7"], ["| 5", "7"]]
    assert [r["tgt_len"] for r in json.loads((tmp_path / "sweep.json").read_text())["rows"]] == [4, 5]
