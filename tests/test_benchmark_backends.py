"""scripts/benchmark_backends.py on this CPU: a row per backend, its figures consistent with one another (tokens/s
from the step's seconds, the first loss near ln(vocabulary) for random weights), and bad flags refused in one line."""

import math
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "benchmark_backends.py")
TINY = ["--arch=2,16,2,8,32", "--n_token=40", "--tgt_len=8", "--mem_len=8", "--train_batch=2", "--steps=1",
        "--decode_batches=1,2", "--context=5", "--new_tokens=128", "--repeats=5"]
ROW = re.compile(r"^(tensorflow|jax|torch)\s+([\d.]+)\s+([\d,]+)\s+([\d.]+)\s+([\d,]+)\s+([\d,]+)$", re.M)


def run(*args):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KERAS_BACKEND")}
    env.update(PYTHONPATH=REPO)
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)


def _check(stdout: str, backends: list) -> None:
    assert stdout.startswith("CPU: ")
    rows = ROW.findall(stdout)
    assert [row[0] for row in rows] == backends, stdout
    for _, seconds, rate, loss, *decode in rows:
        seconds, rate = float(seconds), float(rate.replace(",", ""))
        assert 16 / (seconds + 5e-4) - 1 <= rate <= 16 / max(seconds - 5e-4, 1e-9) + 1  # 16 tokens a step
        assert abs(float(loss) - math.log(40)) < 1.5  # random weights (Keras's initialisers)
        # 127 tokens' steps of 1-2 rows; XLA's loop of this tiny model takes ~3 us a step here: below 1e7 tokens/s
        assert all(0 < float(d.replace(",", "")) < 1e7 for d in decode), decode


def test_torch_row():
    pytest.importorskip("torch")
    proc = run(*TINY, "--backends=torch")
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check(proc.stdout, ["torch"])


@pytest.mark.slow  # ~45 s: three processes, JAX's and TensorFlow's compilations
def test_every_backend_side_by_side():
    pytest.importorskip("jax")
    pytest.importorskip("torch")
    proc = run(*TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check(proc.stdout, ["tensorflow", "jax", "torch"])


@pytest.mark.parametrize("flag, message", [
    ("--backends=mxnet", "--backends: 'mxnet' is none of tensorflow, jax, torch"),
    ("--arch=2,16,2,8", "--arch=2,16,2,8 must be five whole numbers"),
    ("--arch=2,99999,2,8,32", "a size out of range"),
])
def test_bad_flags_are_one_line(flag, message):
    proc = run(flag)
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, \
        proc.stderr[-2000:]
