"""scripts/benchmark_jax_step.py on this CPU: the model's training step on JAX runs (a row with the first step's
loss where TensorFlow's model of the same case starts), and --prepare refuses a folder the device tool would not
carry as meant, in one line."""

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "benchmark_jax_step.py")


def run(*args, cwd=REPO):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KERAS_BACKEND")}
    env.update(JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def test_the_step_runs_on_jax_and_starts_at_tensorflows_loss():
    pytest.importorskip("jax")
    proc = run("--measure", "--cases=tiny", "--modes=f32,bf16", "--steps=2", "--matmul_size=64")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = re.findall(r"^tiny\s+(f32|bf16)\s+4\s+([\d.]+)\s+([\d,]+)\s+\S+\s+([\d.]+)%\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$",
                      proc.stdout, re.M)
    assert [r[0] for r in rows] == ["f32", "bf16"], proc.stdout
    for _, seconds, rate, mfu, memory, loss, at_zero in rows:
        assert float(seconds) > 0 and float(mfu) > 0 and float(memory) > 0
        rate, seconds = float(rate.replace(",", "")), float(seconds)  # 64 tokens a step, printed to 0.1 ms
        assert 64 / (seconds + 5e-5) - 1 <= rate <= 64 / max(seconds - 5e-5, 1e-9) + 1
        # Keras's initialisers (unit LayerNorm scales): TensorFlow's model of this case starts at 12.3-12.4 nats
        # (two seeds), above the 10.17 of zero logits
        assert float(at_zero) == pytest.approx(10.17, abs=0.01) and 11.5 < float(loss) < 13.0


def test_prepare_refuses_folders_the_device_tool_would_not_carry(tmp_path):
    proc = run(f"--prepare={tmp_path}")
    assert proc.returncode == 2 and "is outside the repository" in proc.stderr.strip().splitlines()[-1]
    proc = run("--prepare=scripts")
    assert proc.returncode == 2 and "--prepare=scripts is not ignored by git" in proc.stderr.strip().splitlines()[-1]
    proc = run("--measure", "--prepare=x")
    assert proc.returncode == 2 and "give exactly one of" in proc.stderr
    proc = run("--measure", "--cases=nope")
    assert proc.returncode == 2 and "unknown ['nope']" in proc.stderr
