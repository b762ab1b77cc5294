"""The model's layers on every Keras backend: on TensorFlow `txl_tf.model.tensor_ops` is TensorFlow's own functions
(the graphs stay as they were), and on JAX the ported layers give TensorFlow's numbers without importing it.

Each other backend runs in its own process (a process has one Keras backend): tests/backend_layers.py, fed the
TensorFlow run's inputs and weights through an .npz file."""

import os
import subprocess
import sys

import backend_layers
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = os.path.join(REPO, "tests", "backend_layers.py")


def run_under(backend: str, tmp_path, given: dict, weights: dict) -> dict:
    source, target = tmp_path / "in.npz", tmp_path / f"{backend}.npz"
    np.savez(source, **{f"in/{k}": v for k, v in given.items()}, **{f"w/{k}": v for k, v in weights.items()})
    env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "PYTHONPATH")}
    env.update(KERAS_BACKEND=backend, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, CHILD, str(source), str(target)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(target) as f:
        return {k: f[k] for k in f.files}


def test_tensor_ops_are_tensorflows_own_functions_on_tensorflow():
    import tensorflow as tf

    from txl_tf.model import tensor_ops as T

    assert T.BACKEND == "tensorflow" and T.TENSORFLOW
    for name in ("cast", "constant", "reshape", "transpose", "concat", "split", "matmul", "where", "zeros",
                 "zeros_like", "sin", "cos", "minimum", "maximum", "gather", "clip_by_value", "broadcast_to", "stack",
                 "pad", "slice", "stop_gradient", "shape", "size"):
        assert getattr(T, name) is getattr(tf, name), name
    assert T.arange is tf.range and T.float32 is tf.float32 and T.int32 is tf.int32
    for name in ("softmax", "log_softmax", "sparse_softmax_cross_entropy_with_logits"):
        assert getattr(T, name) is getattr(tf.nn, name), name


def test_leaf_layers_on_jax_give_tensorflows_numbers(tmp_path):
    pytest.importorskip("jax")
    given = backend_layers.inputs()
    expected, weights = backend_layers.run(given)
    got = run_under("jax", tmp_path, given, weights)
    assert str(got.pop("backend")) == "jax"
    assert not got.pop("tensorflow_loaded")  # every layer here ran on keras.ops alone
    for key in ("dropout_kept", "dropout_values", "dropout_same_seed"):  # another random stream: its statistics
        mine, theirs = got.pop(key), expected.pop(key)
        if key == "dropout_kept":
            assert mine == pytest.approx(0.7, abs=0.01) and theirs == pytest.approx(0.7, abs=0.01)
        else:
            np.testing.assert_allclose(mine, theirs, rtol=1e-6, err_msg=key)  # {0, 1/0.7}; the same seed, same mask
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert got[key].shape == value.shape, key
        np.testing.assert_allclose(got[key], value, atol=1e-5, rtol=1e-5, err_msg=key)
