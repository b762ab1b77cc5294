"""RECL on synthetic per-token losses whose answer is known by construction."""

import math
import os
import subprocess
import sys

import numpy as np
import pytest

from txl_tf.analysis import recl

CONTEXTS = (100, 200, 300, 400, 500, 600)


def test_relative_gains_by_hand():
    # Two models, two contexts, four tokens. b(c0) = [1, 1, 3, 4]; r = 0.5 keeps tokens 3 and 2.
    losses = np.array([
        [[1, 2, 3, 4], [1, 2, 2, 5]],
        [[2, 1, 3, 5], [0, 0, 0, 0]],
    ], dtype=np.float64)
    gains = recl.relative_gains(losses, r=0.5)
    # f(c, c) = mean(3, 4) = 3.5; model 0: mean(min(3, 2), min(4, 5)) = 3; model 1: mean(0, 0) = 0.
    np.testing.assert_allclose(gains[:, 0], [1 - math.exp(-0.5), 1 - math.exp(-3.5)], rtol=1e-12)


def _base_losses(num_tokens=1000, seed=0):
    return np.random.default_rng(seed).uniform(2.0, 3.0, size=num_tokens)


def test_group_baseline_makes_recl_relative():
    base = _base_losses()
    # Model A gains 0.1 nats per step up to 400 tokens of context, then nothing more.
    a = np.stack([base - 0.1 * min(k, 3) for k in range(len(CONTEXTS))])
    # Model B improves faster in absolute terms (0.3 per step, all the way to 600), but at the first pair
    # its longer-context losses are still above the group's baseline (A at 100), so its RECL is 100.
    b = np.stack([base + 0.5 - 0.3 * k for k in range(len(CONTEXTS))])
    result = recl.compute_recl(np.stack([a, b]), CONTEXTS, r=1.0)
    assert result.recl == [400, 100]
    assert result.truncated == [False, False]
    np.testing.assert_allclose(result.gains[0, :3], 1 - math.exp(-0.1), rtol=1e-9)
    assert abs(result.gains[1, 0]) < 1e-12


def test_ratio_selects_hard_tokens():
    base = _base_losses()
    hard = np.zeros(base.shape, bool)
    hard[::10] = True  # exactly 10% of the tokens, made the hardest
    base[hard] += 1.5
    # Only hard tokens improve, by 0.05 nats per step up to 300 tokens.
    losses = np.stack([base - 0.05 * min(k, 2) * hard for k in range(len(CONTEXTS))])[None]
    assert recl.compute_recl(losses, CONTEXTS, r=0.1).recl == [300]  # gain 1 - e^-0.05 ~ 0.049
    assert recl.compute_recl(losses, CONTEXTS, r=1.0).recl == [100]  # diluted to ~0.005 < 0.01


def test_still_improving_is_a_lower_bound():
    base = _base_losses(num_tokens=50)
    losses = np.stack([base - 0.1 * k for k in range(3)])[None]
    result = recl.compute_recl(losses, CONTEXTS[:3], r=0.5)
    assert result.recl == [300] and result.truncated == [True]
    assert ">=300" in recl.format_table(["m"], [result])


def test_bad_inputs_are_named(tmp_path):
    with pytest.raises(ValueError, match="ascending"):
        recl.compute_recl(np.zeros([1, 2, 3]), (200, 100))
    with pytest.raises(ValueError, match="r must be"):
        recl.relative_gains(np.zeros([1, 2, 3]), r=0.0)
    with pytest.raises(FileNotFoundError, match="missing.npy"):
        recl.load_token_losses(str(tmp_path / "missing.npy"))
    np.save(tmp_path / "a_c1.npy", np.ones(3))
    np.save(tmp_path / "a_c2.npy", np.ones(4))
    with pytest.raises(ValueError, match="a@2: 4"):
        recl.load_group({"a": str(tmp_path / "a_c{c}.npy")}, [1, 2])


def test_cli_reads_npy_and_text_files(tmp_path):
    base = _base_losses(num_tokens=200)
    for k, c in enumerate(CONTEXTS):
        np.save(tmp_path / f"xl_c{c}.npy", (base - 0.1 * min(k, 4)).astype(np.float32))
        np.savetxt(tmp_path / f"rnn_c{c}.txt", base + 0.2 - 0.05 * k)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-m", "txl_tf.analysis.recl", "--contexts=" + ",".join(map(str, CONTEXTS)),
         f"--model=xl={tmp_path}/xl_c{{c}}.npy", f"--model=rnn={tmp_path}/rnn_c{{c}}.txt", "--r=0.1,1.0"],
        capture_output=True, text=True, cwd=repo, env={**os.environ, "PYTHONPATH": repo}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line.split()[1:] for line in proc.stdout.split("RECL:")[1].splitlines()
            if line.startswith(("xl", "rnn"))}
    assert rows == {"xl": ["500", "500"], "rnn": ["100", "100"]}


def test_bootstrap_recl_separates_a_real_lead_from_noise():
    rng = np.random.default_rng(0)
    base = rng.uniform(2.0, 3.0, size=4000)
    contexts = CONTEXTS[:4]
    # A gains 0.1 nats per step up to 300; B only up to 200; C is B plus per-token noise of the same size.
    a = np.stack([base - 0.1 * min(k, 2) for k in range(4)])
    b = np.stack([base - 0.1 * min(k, 1) for k in range(4)])
    spread = recl.bootstrap_recl(np.stack([a, b]), contexts, r=1.0, samples=50, block=100)
    assert spread["low"] == [300, 200] and spread["high"] == [300, 200]
    assert spread["longest"] == [1.0, 0.0]
    # Two identical models never lead: ties are counted as no one strictly the longest.
    same = recl.bootstrap_recl(np.stack([a, a]), contexts, r=1.0, samples=20, block=100)
    assert same["longest"] == [0.0, 0.0]
