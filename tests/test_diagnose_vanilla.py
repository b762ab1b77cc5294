"""scripts/diagnose_vanilla.py (issue 54) runs end to end on a tiny model: it trains the position encodings (and
the vanilla model on the half loss) from the study's gin files, scores the same validation windows by window
position, and a second call trains nothing again."""

import os
import subprocess
import sys

import pytest
from train_utils import REPO_ROOT


def _run(out, data_root):
    return subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "scripts", "diagnose_vanilla.py"), f"--output_dir={out}",
         f"--data_root={data_root}", "--steps=3", "--valid_windows=4", "--quick"],
        cwd=REPO_ROOT, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, capture_output=True,
        text=True, timeout=600)


@pytest.mark.slow  # four tiny trainings in a subprocess (~45 s on 2 cores); CI runs it in its slow phase
def test_each_encoding_trained_and_scored_by_window_position(tmp_path):
    out, data_root = tmp_path / "vanilla", tmp_path / "data"
    proc = _run(out, data_root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line for line in proc.stdout.splitlines() if line.startswith("| ")}
    names = ("relative", "learned_absolute", "sinusoid_absolute", "learned_absolute_half_loss")
    assert set(rows) == {"model", *names}
    for name in names:
        cells = [c.strip() for c in rows[name].strip().strip("|").split("|")]
        values = [float(c) for c in cells[1:]]
        assert len(values) == 8 and all(0 < v < 10 for v in values)  # bits per character of a 200-symbol vocab
        assert os.path.exists(out / f"{name}_seed1" / "study.json")  # a finished, resumable run directory
    assert "4 windows of 256" in proc.stdout
    again = _run(out, data_root)
    assert again.returncode == 0 and (again.stderr + again.stdout).count("trained already") == 4
    assert [line for line in again.stdout.splitlines() if line.startswith("| ")] == \
        [line for line in proc.stdout.splitlines() if line.startswith("| ")]  # read back, not trained again
