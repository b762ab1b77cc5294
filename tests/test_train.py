"""`python -m txl_tf.train` as users run it, in real subprocesses: SIGTERM saves and exits cleanly, kill -9 then
re-running the same command ends with the uninterrupted run's weights, and 2 local workers under
MultiWorkerMirroredStrategy (started by scripts/launch_local_multiworker.sh) match single-process training."""

import os
import random
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from train_utils import (
    REPO_ROOT,
    checkpoint_weights,
    prepare_tiny_corpus,
    run_training,
    subprocess_env,
    tiny_params,
    train_command,
)


@pytest.fixture(scope="module")
def char_data(tmp_path_factory):
    return prepare_tiny_corpus(str(tmp_path_factory.mktemp("data")), "char")


def _start(model_dir, params):
    return subprocess.Popen(train_command(str(model_dir), params), cwd=REPO_ROOT, env=subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _read_until(process, marker):
    """Reads the process's output until a line contains `marker`; returns everything read."""
    lines = []
    for line in process.stdout:
        lines.append(line)
        if marker in line:
            return "".join(lines)
    process.wait()
    raise AssertionError(f"the run ended ({process.returncode}) before printing {marker!r}:\n{''.join(lines)}")


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(char_data, tmp_path):
    params = tiny_params(char_data, **{"TrainConfig.train_steps": 100000, "TrainConfig.checkpoint_every": 0,
                                       "ModelConfig.n_layer": 1})
    process = _start(tmp_path, params)
    try:
        _read_until(process, "step       4/")
        process.send_signal(signal.SIGTERM)
        rest, _ = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 0, rest
    assert "stopped at step" in rest and "Re-run the same command to resume" in rest
    step = int(tf.train.latest_checkpoint(str(tmp_path)).rsplit("-", 1)[1])
    assert 4 <= step < 100000
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".tmp")]


@pytest.mark.slow
def test_kill_9_then_rerun_ends_with_the_uninterrupted_weights(char_data, tmp_path):
    # Dropout on: the resumed run must also continue the dropout RNG streams; deterministic kernels on.
    params = tiny_params(char_data, **{"TrainConfig.train_steps": 12, "TrainConfig.checkpoint_every": 2,
                                       "TrainConfig.steps_per_loop": 1, "TrainConfig.log_every": 1,
                                       "TrainConfig.deterministic": True, "ModelConfig.dropout": 0.1,
                                       "ModelConfig.dropatt": 0.1})
    run_training(str(tmp_path / "whole"), params)
    kill_at = random.Random(os.getpid()).randint(3, 9)
    interrupted = tmp_path / "interrupted"
    process = _start(interrupted, params)
    try:
        _read_until(process, f"step {kill_at:>7d}/")
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
    finally:
        process.kill()
    assert process.returncode == -signal.SIGKILL
    resumed_from = tf.train.latest_checkpoint(str(interrupted))
    result = run_training(str(interrupted), params)  # the same command again
    assert (resumed_from is None) or "resumed from" in result.stdout, result.stdout
    whole = checkpoint_weights(tf.train.latest_checkpoint(str(tmp_path / "whole")))
    again = checkpoint_weights(tf.train.latest_checkpoint(str(interrupted)))
    assert whole.keys() == again.keys() and whole
    for name in whole:
        np.testing.assert_array_equal(again[name], whole[name], err_msg=f"{name} (killed at step {kill_at})")


def _kill_when(process, kind, rng, model_dir, eval_every):
    """Reads the run's output and SIGKILLs it at a random point of `kind`; returns where it landed."""
    import time

    resumed_at, lines = 0, []
    for line in process.stdout:
        lines.append(line)
        if "resumed from" in line:
            resumed_at = int(re.search(r" at step (\d+)", line).group(1))  # "...; set aside ..." may follow
        if line.startswith("model:"):
            break
    else:
        raise AssertionError("the run ended before training:\n" + "".join(lines))
    if kind == "checkpoint":  # the moment CheckpointManager writes ckpt-N_temp/ (then merges and renames it)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and process.poll() is None:
            if any(name.endswith("_temp") for name in os.listdir(model_dir)):
                process.send_signal(signal.SIGKILL)
                return "checkpoint write"
        raise AssertionError("no checkpoint write was seen")
    if kind == "evaluation":  # just after the log line of a step that evaluates
        target = (resumed_at // eval_every + 1) * eval_every
    else:
        target = resumed_at + rng.randint(1, 4)
    for line in process.stdout:
        if line.startswith(f"step {target:>7d}/"):
            time.sleep(rng.uniform(0.0, 0.05))
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=60)
            rest = process.stdout.read()  # what it printed before it died
            evaluated = f"valid step {target}:" in rest
            return f"step {target}" + (" (evaluation)" if kind == "evaluation" and not evaluated else
                                       " (after evaluation)" if kind == "evaluation" else "")
    raise AssertionError(f"the run ended before step {target}")


@pytest.mark.slow
def test_ten_random_kill_9_points_end_with_the_uninterrupted_weights(char_data, tmp_path):
    """Fault injection: kill -9 at 10 random points (during steps, checkpoint writes and evaluations), re-running
    the same command after each; the final weights are bitwise those of an uninterrupted run."""
    eval_every = 4
    params = tiny_params(char_data, **{"TrainConfig.train_steps": 20, "TrainConfig.checkpoint_every": 2,
                                       "TrainConfig.keep_checkpoints": 2, "TrainConfig.steps_per_loop": 1,
                                       "TrainConfig.log_every": 1, "TrainConfig.eval_every": eval_every,
                                       "TrainConfig.deterministic": True, "ModelConfig.dropout": 0.1,
                                       "ModelConfig.dropatt": 0.1, "EvalConfig.max_steps": 40})
    run_training(str(tmp_path / "whole"), params)
    seed = int(os.environ.get("TXL_FAULT_SEED", os.getpid()))
    rng = random.Random(seed)
    kinds = ["step"] * 4 + ["checkpoint"] * 3 + ["evaluation"] * 3
    rng.shuffle(kinds)
    interrupted = tmp_path / "interrupted"
    landed = []
    for kind in kinds:
        process = _start(interrupted, params)
        try:
            landed.append(_kill_when(process, kind, rng, str(interrupted), eval_every))
            process.wait(timeout=60)
        finally:
            process.kill()
            process.stdout.close()
        assert process.returncode == -signal.SIGKILL, (kind, landed)
    result = run_training(str(interrupted), params)  # the same command, to the end
    print(f"seed {seed} (TXL_FAULT_SEED): killed at {'; '.join(landed)}")
    assert "resumed from" in result.stdout, result.stdout
    whole = checkpoint_weights(tf.train.latest_checkpoint(str(tmp_path / "whole")))
    final = tf.train.latest_checkpoint(str(interrupted))
    again = checkpoint_weights(final)
    assert final.endswith("ckpt-20") and whole.keys() == again.keys() and whole
    for name in whole:
        np.testing.assert_array_equal(again[name], whole[name], err_msg=f"{name}; seed {seed}, kills {landed}")


def test_two_local_workers_match_single_process_training(char_data, tmp_path):
    params = tiny_params(char_data, **{"TrainConfig.train_steps": 5, "TrainConfig.checkpoint_every": 0})
    single = tmp_path / "single"
    run_training(str(single), params)
    workers = tmp_path / "workers"
    command = ["bash", os.path.join(REPO_ROOT, "scripts", "launch_local_multiworker.sh"), "2",
               "--gin_file=gin/sample.gin", f"--model_dir={workers}"] + [f"--gin_param={p}" for p in params]
    env = dict(subprocess_env(), PYTHON=sys.executable)
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[worker 0] training in" in result.stdout and "[worker 1] training in" in result.stdout
    assert "(2 replica(s))" in result.stdout
    assert not [name for name in os.listdir(workers) if name.startswith(".tmp")]  # non-chief temp dirs removed
    expected = checkpoint_weights(tf.train.latest_checkpoint(str(single)))
    got = checkpoint_weights(tf.train.latest_checkpoint(str(workers)))
    assert expected.keys() == got.keys()
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], atol=1e-5, err_msg=name)
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(str(workers)))
    np.testing.assert_allclose(reader.get_tensor("mems/.ATTRIBUTES/VARIABLE_VALUE"),
                               tf.train.load_checkpoint(tf.train.latest_checkpoint(str(single)))
                               .get_tensor("mems/.ATTRIBUTES/VARIABLE_VALUE"), atol=1e-5)


def test_launcher_propagates_a_worker_failure(tmp_path):
    command = ["bash", os.path.join(REPO_ROOT, "scripts", "launch_local_multiworker.sh"), "2",
               "--gin_file=does_not_exist.gin", f"--model_dir={tmp_path}"]
    env = dict(subprocess_env(), PYTHON=sys.executable)
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "does_not_exist.gin" in result.stdout + result.stderr
