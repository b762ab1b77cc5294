"""The training benchmark runs end to end on a one-layer model: its table, and the profile read back from the XSpace
that TensorFlow's profiler writes (matmul-running time within the wall time, op time by kind)."""

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "benchmark_model.py")
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow  # ~8-16 s of subprocesses; CI runs it in its slow phase
def test_tiny_benchmark_prints_speed_and_profile():
    proc = run("--n_layer=1", "--tgt_len=16", "--mem_len=16", "--batch=1", "--modes=f32", "--steps=1", "--profile",
               "--matmul_size=128")
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = re.search(r"^f32\s+1\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)%", proc.stdout, re.M)
    assert row, proc.stdout
    seconds, tokens_per_second = float(row.group(1)), float(row.group(2))
    # s/step is printed to the millisecond: tokens/s must lie within what that rounding allows
    assert 16 / (seconds + 5e-4) <= tokens_per_second <= 16 / max(seconds - 5e-4, 1e-9)
    profile = re.search(r"profile f32 batch 1: (\d+) ms/step wall; a matmul runs during (\d+) ms of it .* no matmul "
                        r"runs for (\d+) ms .* (\d+) ms of host/idle", proc.stdout)
    assert profile, proc.stdout
    wall, matmul, rest, idle = map(int, profile.groups())
    assert 0 < matmul <= wall and abs(wall - matmul - rest) <= 1 and idle <= rest
    kinds = dict(re.findall(r"^  ([a-z -]+?)\s+([\d.]+) ms\s+[\d.]+%$", proc.stdout, re.M))
    assert set(kinds) == {"matmul", "attention elementwise", "dropout", "layer norm", "feed-forward elementwise",
                          "casts", "optimizer", "embedding and softmax", "other"}
    # The kinds sure to show time on this tiny model (LayerNorm and dropout may round to 0.0 ms).
    assert float(kinds["matmul"]) > 0 and float(kinds["optimizer"]) > 0 and float(kinds["attention elementwise"]) > 0


def test_peer_directory_without_the_setup_is_a_one_line_error(tmp_path):
    proc = run(f"--peer={tmp_path}", "--modes=f32", "--matmul_size=64")
    assert proc.returncode != 0
    assert f"--peer={tmp_path} is not a directory made by ../shared/peer/setup.sh" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow  # ~30 s: the auto mode times its candidates, then the chosen path
def test_auto_mode_times_the_path_the_trainer_would_choose(tmp_path):
    env = {**ENV, "TXL_TF_CACHE": str(tmp_path / "cache"), "TF_ENABLE_ONEDNN_OPTS": "1"}
    proc = subprocess.run([sys.executable, SCRIPT, "--n_layer=1", "--tgt_len=16", "--mem_len=16", "--batch=1",
                           "--modes=auto,f32", "--steps=1", "--matmul_size=128"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "TF_ENABLE_ONEDNN_OPTS=1 in the timed children" in proc.stdout  # a user's setting is kept
    row = re.search(r"^auto=(f32|bf16)(_xla)?(\+fused)?\s+1\s+[\d.]+\s+[\d.]+", proc.stdout, re.M)
    assert row, proc.stdout
    assert re.search(r"^f32\s+1\s+[\d.]+", proc.stdout, re.M)
    # The child measured the candidates and cached its choice, unless the passes left the ranking unclear (a busy
    # machine: then it says so and caches nothing).
    cache = tmp_path / "cache" / "choices.json"
    choices = cache.read_text() if cache.exists() else ""
    assert "choosing the training path (auto): timing" in proc.stderr, proc.stderr[-3000:]
    assert "tokens_per_second" in choices or "not cached: the passes moved by up to" in proc.stderr, proc.stderr[-3000:]


def test_unknown_modes_are_a_one_line_error():
    proc = run("--modes=f16", "--matmul_size=64")
    assert proc.returncode != 0 and "--modes=f16: f16 is not one of auto, f32, bf16, f32_xla, bf16_xla" in proc.stderr
    assert "Traceback" not in proc.stderr
