"""`python -m txl_tf.train` as users run it, in real subprocesses: SIGTERM saves and exits cleanly, kill -9 then
re-running the same command ends with the uninterrupted run's weights, and 2 local workers under
MultiWorkerMirroredStrategy (started by scripts/launch_local_multiworker.sh) match single-process training."""

import json
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


def _sigterm_after(process, marker, delay=0.0):
    """Reads the run's output until `marker`, waits `delay` s, sends SIGTERM; asserts a clean exit and returns
    (output before the signal, output after it, seconds from the signal to the exit)."""
    import time

    try:
        before = _read_until(process, marker)
        time.sleep(delay)
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        rest, _ = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 0, before + rest
    return before, rest, time.monotonic() - signalled


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


def test_sigterm_ends_a_long_host_loop_after_the_current_step(char_data, tmp_path):
    """A host loop of 100,000 steps (one tf.function call) does not delay the stop: the signal's thread sets the
    trainer's stop flag, which the compiled loop reads after every step."""
    params = tiny_params(char_data, **{"TrainConfig.train_steps": 100000, "TrainConfig.steps_per_loop": 100000,
                                       "TrainConfig.log_every": 100000, "TrainConfig.checkpoint_every": 0,
                                       "ModelConfig.n_layer": 1})
    _, rest, seconds = _sigterm_after(_start(tmp_path, params), "model:", delay=3)  # tracing, then ~10 ms steps
    assert seconds < 20, rest
    step = int(re.search(r"stopped at step (\d+) on request", rest).group(1))
    assert 0 < step < 100000
    assert tf.train.latest_checkpoint(str(tmp_path)).endswith(f"ckpt-{step}")


@pytest.mark.slow  # ~8-16 s of subprocesses; CI runs it in its slow phase
def test_sigterm_abandons_a_long_evaluation_which_shows_its_progress(tmp_path):
    """The whole validation split (~20,000 tokens), one token per segment: progress lines (tokens, rate, time left)
    after a few seconds, and a SIGTERM then ends the evaluation after its current segment, saves and exits
    cleanly."""
    data = prepare_tiny_corpus(str(tmp_path), "char", n_lines=8000)
    params = tiny_params(data, **{"TrainConfig.train_steps": 4, "TrainConfig.eval_every": 2,
                                  "TrainConfig.checkpoint_every": 0, "TrainConfig.eval_steps": 0,
                                  "EvalConfig.max_steps": 0, "EvalConfig.tgt_len": 1, "EvalConfig.batch_size": 1})
    progress, rest, seconds = _sigterm_after(_start(tmp_path / "run", params), "evaluating: [")
    assert seconds < 10, rest
    line = progress.splitlines()[-1]
    assert re.search(r"evaluating: \[#* *\] +\d+\.\d% [\d,]+/[\d,]+ tokens [\d,.]+ tokens/s, \d+ (s|min) left", line), line
    assert re.search(r"the evaluation \(stopped after [\d,]+ tokens\) at step 2: abandoned on the stop request", rest), rest
    assert "stopped at step 2 on request" in rest and "valid step 2:" not in rest
    assert tf.train.latest_checkpoint(str(tmp_path / "run")).endswith("ckpt-2")


@pytest.mark.slow  # ~8-16 s of subprocesses; CI runs it in its slow phase
def test_a_second_trainer_on_the_same_folder_is_refused_and_a_dead_holder_blocks_nothing(char_data, tmp_path):
    """Two trainers on one --model_dir would interleave checkpoints, config.gin and event files: the second one
    stops with one line naming the holder, before it writes anything; after a kill -9 of the holder (the kernel
    drops its lock) the same command resumes."""
    params = tiny_params(char_data, **{"TrainConfig.train_steps": 100000, "TrainConfig.checkpoint_every": 50,
                                       "TrainConfig.log_every": 50, "TrainConfig.steps_per_loop": 50,
                                       "ModelConfig.n_layer": 1})
    first = _start(tmp_path, params)
    try:
        _read_until(first, "step      50/")
        files = sorted(os.listdir(tmp_path))
        second = subprocess.run(train_command(str(tmp_path), params), cwd=REPO_ROOT, env=subprocess_env(),
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stdout + second.stderr
        errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and f"is being trained by pid {first.pid} on host " in errors[0], second.stderr
        assert "train.lock" in errors[0] and "Traceback" not in second.stderr
        assert first.poll() is None  # the first run goes on
        assert len(os.listdir(tmp_path / "train")) == 1  # one event file: the second wrote none
        assert set(files) <= set(os.listdir(tmp_path))
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    finally:
        first.kill()
        first.stdout.close()
    resumed = run_training(str(tmp_path), tiny_params(char_data, **{"TrainConfig.train_steps": 100,
                                                                    "TrainConfig.checkpoint_every": 50,
                                                                    "TrainConfig.log_every": 50,
                                                                    "TrainConfig.steps_per_loop": 50,
                                                                    "ModelConfig.n_layer": 1}))
    assert "resumed from" in resumed.stdout, resumed.stdout


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


# bfloat16: CPU collectives gather no bfloat16, so the memory saved with each checkpoint (gathered from both
# workers) travels as float32; the run passes a checkpoint at step 2 before the last one.
@pytest.mark.parametrize("mixed_precision", [False, pytest.param(True, marks=pytest.mark.slow)])  # CI: both
@pytest.mark.slow  # CI's slow phase: the fast suite stays near 10 minutes on 2 cores
def test_two_local_workers_match_single_process_training(char_data, tmp_path, mixed_precision):
    params = tiny_params(char_data, **{"TrainConfig.train_steps": 5, "TrainConfig.checkpoint_every": 2,
                                       "TrainConfig.mixed_precision": mixed_precision})
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
    assert tf.train.get_checkpoint_state(str(workers)).all_model_checkpoint_paths[-2].endswith("ckpt-4")
    expected = checkpoint_weights(tf.train.latest_checkpoint(str(single)))
    got = checkpoint_weights(tf.train.latest_checkpoint(str(workers)))
    assert expected.keys() == got.keys()
    # bfloat16 matmuls of a 2-row and a 4-row batch round differently, and 5 Adam steps carry that into the weights
    atol = 5e-3 if mixed_precision else 1e-5
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], atol=atol, err_msg=name)
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(str(workers)))
    mems = reader.get_tensor("mems/.ATTRIBUTES/VARIABLE_VALUE")
    assert mems.dtype == (tf.bfloat16.as_numpy_dtype if mixed_precision else np.float32)
    np.testing.assert_allclose(mems.astype(np.float32),
                               tf.train.load_checkpoint(tf.train.latest_checkpoint(str(single)))
                               .get_tensor("mems/.ATTRIBUTES/VARIABLE_VALUE").astype(np.float32),
                               atol=atol * 10 if mixed_precision else 1e-5)


def test_launcher_propagates_a_worker_failure(tmp_path):
    command = ["bash", os.path.join(REPO_ROOT, "scripts", "launch_local_multiworker.sh"), "2",
               "--gin_file=does_not_exist.gin", f"--model_dir={tmp_path}"]
    env = dict(subprocess_env(), PYTHON=sys.executable)
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "does_not_exist.gin" in result.stdout + result.stderr


# ---- issue 34: a batch the data cannot fill is one line, before a model is built or a path measured -------------
AUTO_PATH = {"TrainConfig.mixed_precision": "'auto'", "TrainConfig.jit_compile": "'auto'",
             "TrainConfig.kernels": "'auto'"}


def _too_large(data_dir: str, batch: int) -> str:
    with open(os.path.join(data_dir, "metadata.json")) as f:
        tokens = json.load(f)["splits"]["train"]["num_tokens"]
    return (f"TrainConfig.batch_size={batch} is too large for the train split of {data_dir} ({tokens} tokens): "
            f"{batch} streams of tgt_len=5 need at least batch_size x (tgt_len + 1) = {batch * 6} tokens; set "
            f"TrainConfig.batch_size to at most {tokens // 6} (or lower tgt_len, or prepare more data)")


@pytest.mark.parametrize("path", ["auto", "explicit"])
def test_a_batch_the_data_cannot_fill_is_refused_before_a_model_is_built(char_data, tmp_path, capsys, path):
    from txl_tf import train
    from txl_tf.base.errors import ConfigError

    params = tiny_params(char_data, **{"TrainConfig.batch_size": 10000, **(AUTO_PATH if path == "auto" else {})})
    with pytest.raises(ConfigError) as raised:
        train.run(["gin/sample.gin"], params, str(tmp_path / "run"))
    assert str(raised.value) == _too_large(char_data, 10000)
    out = capsys.readouterr().out
    assert "choosing the training path" not in out and "training in" not in out, out  # nothing measured or built
    assert not (tmp_path / "run").exists()


def _limit_memory():  # a model of this batch would fail to allocate here rather than take the machine's memory
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (16 << 30, 16 << 30))


def test_train_with_a_batch_of_a_hundred_million_says_why_in_one_line(char_data, tmp_path):
    params = tiny_params(char_data, **{"TrainConfig.batch_size": 100000000, **AUTO_PATH})
    result = subprocess.run(train_command(str(tmp_path / "run"), params), cwd=REPO_ROOT, env=subprocess_env(),
                            capture_output=True, text=True, timeout=600, preexec_fn=_limit_memory)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
        f"error: {_too_large(char_data, 100000000)}"], result.stderr[-3000:]
    assert "choosing the training path" not in result.stdout
