"""A two-worker cluster (scripts/launch_local_multiworker.sh, real processes on localhost) that loses a worker:
kill -9 and SIGSTOP (a machine that vanishes or hangs: its sockets stay open) of one worker end the run within a
bounded time with one line naming the lost worker and intact checkpoints, SIGTERM to one worker (a preemption)
saves every worker at the same step, and re-running the same command ends with the uninterrupted run's weights,
bit for bit."""

import os
import random
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf
from train_utils import (
    REPO_ROOT,
    checkpoint_weights,
    prepare_tiny_corpus,
    subprocess_env,
    tiny_params,
)

pytestmark = pytest.mark.slow

TRAIN_STEPS = 24
# A stopped worker is found by TensorFlow's coordination service after its heartbeat timeout (about 10 s); the
# rest is start-up and the launcher's grace period for the stopped process (STOP_GRACE_S below).
LOST_WORKER_BOUND_S = 60
# The launcher's grace period after a stop request. It must exceed the heartbeat timeout: when worker 1 dies
# while worker 0 waits in a step or a checkpoint that only the heartbeat can abort, the launcher's SIGTERM to
# worker 0 must leave it time to find the lost peer and say so, instead of a race between two 10 s clocks.
GRACE_S = 25


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(params, weights of an uninterrupted two-worker run)."""
    root = tmp_path_factory.mktemp("cluster")
    data = prepare_tiny_corpus(str(root), "char")
    params = tiny_params(data, **{"TrainConfig.train_steps": TRAIN_STEPS, "TrainConfig.checkpoint_every": 4,
                                  "TrainConfig.steps_per_loop": 1, "TrainConfig.log_every": 1,
                                  "TrainConfig.deterministic": True, "ModelConfig.dropout": 0.1,
                                  "ModelConfig.dropatt": 0.1})
    whole = root / "whole"
    process = _launch(whole, params)
    out, _ = process.communicate(timeout=300)
    assert process.returncode == 0, out
    return params, checkpoint_weights(tf.train.latest_checkpoint(str(whole)))


def _launch(model_dir, params):
    command = ["bash", os.path.join(REPO_ROOT, "scripts", "launch_local_multiworker.sh"), "2",
               "--gin_file=gin/sample.gin", f"--model_dir={model_dir}"] + [f"--gin_param={p}" for p in params]
    env = dict(subprocess_env(), PYTHON=sys.executable, STOP_GRACE_S=str(GRACE_S))
    return subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _signal_worker_1(process, sig, at_step):
    """Reads the launcher's output until the chief logs `at_step`, then sends `sig` to worker 1; returns
    (output so far, monotonic time of the signal)."""
    lines, pids = [], None
    for line in process.stdout:
        lines.append(line)
        found = re.search(r"started 2 workers .*\(pids (\d+) (\d+)\)", line)
        if found:
            pids = [int(found.group(1)), int(found.group(2))]
        if line.startswith(f"[worker 0] step {at_step:>7d}/"):
            os.kill(pids[1], sig)
            return "".join(lines), time.monotonic(), pids[1]
    process.wait()
    raise AssertionError(f"the run ended ({process.returncode}) before step {at_step}:\n{''.join(lines)}")


def _intact_checkpoints(model_dir):
    """Every checkpoint the state file lists reads back whole; returns the newest one's step."""
    state = tf.train.get_checkpoint_state(str(model_dir))
    assert state is not None and state.all_model_checkpoint_paths
    for prefix in state.all_model_checkpoint_paths:
        reader = tf.train.load_checkpoint(prefix)
        for name, _ in tf.train.list_variables(prefix):
            reader.get_tensor(name)
    return int(state.model_checkpoint_path.rsplit("-", 1)[1])


def _relaunch_matches(cluster, model_dir):
    params, whole = cluster
    process = _launch(model_dir, params)
    out, _ = process.communicate(timeout=300)
    assert process.returncode == 0, out
    assert "resumed from" in out, out
    again = checkpoint_weights(tf.train.latest_checkpoint(str(model_dir)))
    assert again.keys() == whole.keys() and whole
    for name in whole:
        np.testing.assert_array_equal(again[name], whole[name], err_msg=name)


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL], ids=["sigstop", "kill_9"])
def test_a_lost_worker_ends_the_run_in_bounded_time_and_the_same_command_resumes(cluster, tmp_path, sig):
    params, _ = cluster
    at_step = random.Random(os.getpid()).randint(6, 14)
    process = _launch(tmp_path, params)
    try:
        before, signalled, lost_pid = _signal_worker_1(process, sig, at_step)
        rest, _ = process.communicate(timeout=LOST_WORKER_BOUND_S + 30)
    finally:
        process.kill()
        if sig == signal.SIGSTOP:
            subprocess.run(["kill", "-KILL", str(lost_pid)], capture_output=True)
    elapsed = time.monotonic() - signalled
    assert process.returncode != 0, rest
    assert elapsed < LOST_WORKER_BOUND_S, f"the run took {elapsed:.0f} s to end:\n{rest}"
    errors = [line for line in rest.splitlines() if line.startswith("[worker 0] error:")]
    assert len(errors) == 1 and "lost a worker: worker 1 (127.0.0.1:" in errors[0], rest
    assert "re-run the same command" in errors[0]
    assert "[worker 0] Traceback" not in rest, rest
    if sig == signal.SIGSTOP:
        assert "stopped sending heartbeats" in errors[0]
        assert f"worker 1 did not stop within {GRACE_S} s (STOP_GRACE_S)" in rest, rest
    assert _intact_checkpoints(tmp_path) <= at_step + 4
    _relaunch_matches(cluster, tmp_path)


def test_sigterm_to_one_worker_saves_every_worker_at_the_same_step_and_the_run_resumes(cluster, tmp_path):
    params, _ = cluster
    process = _launch(tmp_path, params)
    try:
        _, signalled, _ = _signal_worker_1(process, signal.SIGTERM, 7)
        rest, _ = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 0, rest
    stops = re.findall(r"\[worker (\d)\] stopped at step (\d+) on request; saved (\S+)\.", rest)
    assert sorted(worker for worker, _, _ in stops) == ["0", "1"], rest
    assert stops[0][1] == stops[1][1], rest
    step = int(stops[0][1])
    assert 7 <= step < TRAIN_STEPS
    assert _intact_checkpoints(tmp_path) == step
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".tmp")]
    _relaunch_matches(cluster, tmp_path)
