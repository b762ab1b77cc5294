"""The training step's kernels are a configuration choice (TrainConfig.kernels) that a run records: the same seed and
gin file with the fused kernels give bitwise the same weights, config.gin holds the path that trained (also when the
fused kernels cannot run and the trainer falls back to TensorFlow's ops), a resume on the other path says in one
line that bitwise equality with an uninterrupted run no longer holds, and the fused kernels under XLA are a
one-line configuration error. Training runs are real `python -m txl_tf.train` subprocesses."""

import subprocess

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

from txl_tf.base.errors import ConfigError
from txl_tf.configs import TrainConfig
from txl_tf.model import fused

NOT_BITWISE = "from here its weights are no longer bit for bit those of an uninterrupted run"
needs_compiler = pytest.mark.skipif(fused._compiler() is None,
                                    reason="no C++ compiler to build the fused kernels (apt-get install g++)")


@pytest.fixture(scope="module")
def char_data(tmp_path_factory):
    return prepare_tiny_corpus(str(tmp_path_factory.mktemp("data")), "char")


def _params(data_dir, kernels, steps):
    """Dropout on, so that the two paths' masks matter; a checkpoint every 2 steps."""
    return tiny_params(data_dir, **{"TrainConfig.kernels": repr(kernels), "TrainConfig.train_steps": steps,
                                    "TrainConfig.checkpoint_every": 2, "ModelConfig.dropout": 0.1,
                                    "ModelConfig.dropatt": 0.1})


def _weights(model_dir):
    return checkpoint_weights(tf.train.latest_checkpoint(str(model_dir)))


def test_fused_kernels_under_xla_and_unknown_kernels_are_one_line_errors():
    with pytest.raises(ConfigError, match=r"^TrainConfig.kernels='fused' cannot run under "
                                          r"TrainConfig.jit_compile=True \(XLA cannot compile custom ops\); set "):
        TrainConfig(kernels="fused", jit_compile=True)
    with pytest.raises(ConfigError, match=r"^TrainConfig.kernels='xla' must be one of 'tf', 'fused', 'auto'; fix "):
        TrainConfig(kernels="xla")
    assert TrainConfig().kernels == "auto" and TrainConfig(kernels="tf", jit_compile=True).jit_compile
    assert TrainConfig(kernels="fused", jit_compile="auto").jit_compile == "auto"  # "auto" leaves XLA out


@needs_compiler
@pytest.mark.slow  # five training subprocesses, ~10 s each on 2 cores
def test_fused_runs_repeat_bitwise_and_a_resume_across_paths_says_so_once(char_data, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    run_training(str(first), _params(char_data, "fused", 2))
    run_training(str(second), _params(char_data, "fused", 2))
    want, got = _weights(first), _weights(second)
    assert want.keys() == got.keys() and want
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert "TrainConfig.kernels = 'fused'" in (first / "config.gin").read_text()

    same = run_training(str(first), _params(char_data, "fused", 4))  # a resume on the same path: nothing extra
    assert "resumed from" in same.stdout and NOT_BITWISE not in same.stdout + same.stderr, same.stdout

    to_tf = run_training(str(second), _params(char_data, "tf", 4))
    assert to_tf.stdout.count(NOT_BITWISE) == 1, to_tf.stdout
    assert (f"{second} trained on float32, no XLA, the fused kernels (config.gin) and resumes on float32, no XLA, "
            f"TensorFlow's ops: {NOT_BITWISE}") in to_tf.stdout
    assert "TrainConfig.kernels = 'tf'" in (second / "config.gin").read_text()

    to_fused = run_training(str(second), _params(char_data, "fused", 6))
    assert to_fused.stdout.count(NOT_BITWISE) == 1, to_fused.stdout
    assert (f"{second} trained on float32, no XLA, TensorFlow's ops (config.gin) and resumes on float32, no XLA, "
            f"the fused kernels: {NOT_BITWISE}") in to_fused.stdout


@pytest.mark.slow  # one training subprocess, ~10 s on 2 cores
def test_without_the_kernels_a_fused_run_trains_with_tensorflows_ops_and_records_it(char_data, tmp_path):
    """A compiler that fails (`false`): one warning naming why, the steps run TensorFlow's ops, and config.gin ends
    with the binding of the path that trained, under a comment that says why."""
    model_dir = tmp_path / "run"
    env = {**subprocess_env(), "CXX": "false", "TXL_TF_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(train_command(str(model_dir), _params(char_data, "fused", 2)), cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "TrainConfig.kernels='fused' but" in line]
    assert len(warnings) == 1 and "false failed; its output is in" in warnings[0], proc.stderr
    assert "training with TensorFlow's ops" in warnings[0]
    assert "kernels 'tf': TensorFlow's ops" in proc.stdout, proc.stdout
    recorded = (model_dir / "config.gin").read_text().rstrip().splitlines()
    assert recorded[-1] == "TrainConfig.kernels = 'tf'"
    assert recorded[-2].startswith("# TrainConfig.kernels='fused' was asked for, but ")
    assert recorded[-2].endswith(": this run trained with 'tf'.")


@needs_compiler
@pytest.mark.slow  # ~13 s: trains with the fused kernels, then loads and scores; CI's slow phase
def test_the_kernels_are_a_policy_a_fused_run_loads_and_scores_as_the_architecture_alone(char_data, tmp_path):
    """Issue 35: `get_config` holds no kernels, recomputation or precision; a run trained with the fused kernels
    (and recomputation) is a plain model: it loads from its folder and scores exactly as the same weights in a
    model built from the architecture alone."""
    from txl_tf import TransformerXL, TransformerXLCausalLM
    from txl_tf.configs import ModelConfig

    config = TransformerXL(**ModelConfig(n_layer=2, d_model=16, n_head=2, d_head=8, d_inner=24).model_kwargs(11),
                           dtype="mixed_bfloat16").get_config()
    assert not {"fused_kernels", "recompute", "kernels", "dtype", "policy"} & set(config), sorted(config)
    run = tmp_path / "run"
    run_training(str(run), _params(char_data, "fused", 2) + ["TrainConfig.recompute = 'block'"])
    recorded = (run / "config.gin").read_text()
    assert "TrainConfig.kernels = 'fused'" in recorded and "TrainConfig.recompute = 'block'" in recorded
    lm = TransformerXLCausalLM.from_preset(str(run))
    plain = TransformerXL.from_config(lm.transformer_xl.get_config())
    plain.set_weights(lm.transformer_xl.get_weights())
    text = "0 the memory of a segment."
    ids = tf.constant([lm.vocab.encode(text)])
    model = lm.transformer_xl
    np.testing.assert_array_equal(plain.log_probs(plain(ids)[0]).numpy(), model.log_probs(model(ids)[0]).numpy())
    again = TransformerXLCausalLM.around(plain, lm.eval_config, lm.vocab)
    np.testing.assert_array_equal(again.score_text(text).log_probs, lm.score_text(text).log_probs)
