"""Checkpoint averaging: identical checkpoints give the same weights, different ones their mean; the command
writes a checkpoint that the restore path of evaluate/export/generate takes, and leaves the run's own alone."""

import os
import shutil
import subprocess
import sys

import gin
import numpy as np
import pytest
import tensorflow as tf
from train_utils import AVERAGE_CONFIG as CONFIG
from train_utils import make_run

from txl_tf import average
from txl_tf.base import errors
from txl_tf.configs import ModelConfig
from txl_tf.runs import loading

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _clean_gin():
    yield
    gin.clear_config()


def float_weights(model):
    return [v.numpy() for v in model.weights if average.is_float(v)]


def test_identical_checkpoints_average_to_the_same_weights(tmp_path):
    saved = make_run(tmp_path / "run", [0.0, 0.0])
    model = loading.build_model(ModelConfig(**CONFIG))
    average.average_weights(model, average.last_checkpoints(str(tmp_path / "run"), 2))
    for got, want in zip(float_weights(model), saved[0], strict=True):
        np.testing.assert_array_equal(got, want)


def test_different_checkpoints_average_to_their_mean(tmp_path):
    saved = make_run(tmp_path / "run", [0.0, 0.25, 1.0])
    prefix = average.average(average.last_checkpoints(str(tmp_path / "run"), 2), str(tmp_path / "avg"),
                             model_dir=str(tmp_path / "run"))
    assert os.path.basename(prefix) == "ckpt-30"
    model, _, found = loading.load_model(str(tmp_path / "avg"))  # what evaluate / export / generate do
    assert found == prefix
    for got, second, third in zip(float_weights(model), saved[1], saved[2], strict=True):
        np.testing.assert_allclose(got, (second + third) / 2, rtol=0, atol=1e-6)
        assert not np.allclose(got, third)


def test_command_writes_into_the_run_without_touching_its_checkpoints(tmp_path):
    run = tmp_path / "run"
    saved = make_run(run, [0.0, 0.5])
    before = {name: os.path.getmtime(run / name) for name in os.listdir(run)}
    command = [sys.executable, "-m", "txl_tf.average", f"--model_dir={run}", "--last=2"]
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "averaged 2 checkpoints (ckpt-10, ckpt-20) -> " in proc.stdout
    assert {name: os.path.getmtime(run / name) for name in before} == before
    assert tf.train.latest_checkpoint(str(run)).endswith("ckpt-20")  # the run still resumes from its own
    model, _, prefix = loading.load_model(str(run / "averaged"))
    assert prefix == str(run / "averaged" / "ckpt-20")
    for got, first, second in zip(float_weights(model), saved[0], saved[1], strict=True):
        np.testing.assert_allclose(got, (first + second) / 2, rtol=0, atol=1e-6)
    with pytest.raises(FileExistsError, match="pass --overwrite"):
        average.average(average.last_checkpoints(str(run), 2), str(run / "averaged"), model_dir=str(run))


def test_output_dir_that_holds_the_checkpoints_is_refused(tmp_path):
    make_run(tmp_path / "run", [0.0, 0.5])
    with pytest.raises(ValueError, match="holds the averaged checkpoint"):
        average.average(average.last_checkpoints(str(tmp_path / "run"), 2), str(tmp_path / "run"),
                        model_dir=str(tmp_path / "run"))


def test_a_checkpoint_removed_while_it_is_read_is_named_in_one_line(tmp_path):
    """`--last=3` while a trainer saves into the run: CheckpointManager deletes the oldest listed checkpoint between
    the listing and the reading. One line names it (a UserError), not a NotFoundError traceback."""
    run = tmp_path / "run"
    make_run(run, [0.0, 0.25, 0.5])
    prefixes = average.last_checkpoints(str(run), 3)
    assert [os.path.basename(p) for p in prefixes] == ["ckpt-10", "ckpt-20", "ckpt-30"]
    for name in os.listdir(run):
        if name.startswith("ckpt-10."):
            os.remove(run / name)  # what CheckpointManager does to a checkpoint beyond max_to_keep
    model = loading.build_model(ModelConfig(**CONFIG))
    with pytest.raises(errors.UserError) as raised:
        average.average_weights(model, prefixes)
    line = errors.one_line(raised.value)
    assert f"{run / 'ckpt-10'} was removed while it was being read" in line and "re-run" in line, line


# ---- --checkpoints without --model_dir (issue 52, item 14): the model is rebuilt from the config.gin of the
# checkpoints' run, and checkpoints of runs whose configs make different models are refused in one line.
def test_the_command_finds_config_gin_beside_the_checkpoints(tmp_path):
    run = tmp_path / "run"
    saved = make_run(run, [0.0, 0.5])
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.run([sys.executable, "-m", "txl_tf.average", f"--checkpoints={run / 'ckpt-10'}",
                           f"--checkpoints={run / 'ckpt-20'}", f"--output_dir={out}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"averaged 2 checkpoints (ckpt-10, ckpt-20) -> {out / 'ckpt-20'}" in proc.stdout
    model, _, prefix = loading.load_model(str(out))
    assert prefix == str(out / "ckpt-20")
    for got, first, second in zip(float_weights(model), saved[0], saved[1], strict=True):
        np.testing.assert_allclose(got, (first + second) / 2, rtol=0, atol=1e-6)


def test_checkpoints_of_two_runs_of_one_model_average(tmp_path):
    saved = make_run(tmp_path / "a", [0.0, 1.0])
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # the same model (config.gin), another folder
    prefix = average.average([str(tmp_path / "a" / "ckpt-10"), str(tmp_path / "b" / "ckpt-20")],
                             str(tmp_path / "out"))
    model, _, _ = loading.load_model(str(tmp_path / "out"))
    assert prefix == str(tmp_path / "out" / "ckpt-20")
    for got, first, second in zip(float_weights(model), saved[0], saved[1], strict=True):
        np.testing.assert_allclose(got, (first + second) / 2, rtol=0, atol=1e-6)


def test_checkpoints_of_runs_of_different_models_are_refused(tmp_path):
    make_run(tmp_path / "a", [0.0])
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    config = tmp_path / "b" / "config.gin"
    config.write_text(config.read_text().replace("ModelConfig.d_inner = 10", "ModelConfig.d_inner = 12"))
    with pytest.raises(errors.ConfigError) as raised:
        average.average([str(tmp_path / "a" / "ckpt-10"), str(tmp_path / "b" / "ckpt-10")], str(tmp_path / "out"))
    assert errors.one_line(raised.value) == (
        f"the checkpoints come from runs of different models: {tmp_path / 'a' / 'config.gin'} has "
        f"ModelConfig.d_inner=10, {config} has 12; average checkpoints of one model")
    assert not (tmp_path / "out").exists()
