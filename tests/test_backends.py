"""The model's layers on every Keras backend: on TensorFlow `txl_tf.model.tensor_ops` is TensorFlow's own functions
(the graphs stay as they were), and on JAX and PyTorch the layers give TensorFlow's numbers without importing it.

Each other backend runs in its own process (a process has one Keras backend): tests/backend_layers.py, fed the
TensorFlow run's inputs and weights through an .npz file."""

import json
import os
import subprocess
import sys

import backend_layers
import backend_model
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = os.path.join(REPO, "tests", "backend_layers.py")


def run_under(backend: str, tmp_path, given: dict, weights: dict | None = None, script: str = CHILD) -> dict:
    """`script` IN.npz OUT.npz under `backend` in a child process; IN.npz holds `given` under in/ and `weights`
    under w/ (or `given` as it is, without `weights`); returns OUT.npz's arrays."""
    source, target = tmp_path / "in.npz", tmp_path / f"{backend}.npz"
    if weights is None:
        np.savez(source, **given)
    else:
        np.savez(source, **{f"in/{k}": v for k, v in given.items()}, **{f"w/{k}": v for k, v in weights.items()})
    env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "PYTHONPATH")}
    env.update(KERAS_BACKEND=backend, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, script, str(source), str(target)], env=env, capture_output=True, text=True,
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
                 "pad", "slice", "stop_gradient", "shape", "size", "unstack", "convert_to_tensor", "expand_dims",
                 "einsum", "repeat", "tile", "roll", "equal", "reduce_all", "cond", "ensure_shape"):
        assert getattr(T, name) is getattr(tf, name), name
    assert T.arange is tf.range and T.float32 is tf.float32 and T.int32 is tf.int32
    assert T.relu is tf.nn.relu and T.map_structure is tf.nest.map_structure
    assert T.invert_permutation is tf.math.invert_permutation
    for name in ("softmax", "log_softmax", "sparse_softmax_cross_entropy_with_logits"):
        assert getattr(T, name) is getattr(tf.nn, name), name


BACKENDS = ["jax", "torch"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_leaf_layers_give_tensorflows_numbers(tmp_path, backend):
    pytest.importorskip(backend)
    given = backend_layers.inputs()
    expected, weights = backend_layers.run(given)
    got = run_under(backend, tmp_path, given, weights)
    assert str(got.pop("backend")) == backend
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


def _model_case(name: str, model, tokens, tgt_len: int, segments: int) -> dict:
    given = dict(config=np.array(json.dumps(model.get_config())), tokens=tokens, tgt_len=np.array(tgt_len),
                 segments=np.array(segments), **{f"w/{i}": w for i, w in enumerate(model.get_weights())})
    return {f"{name}/{key}": value for key, value in given.items()}


@pytest.mark.parametrize("backend", [pytest.param("jax", marks=pytest.mark.slow), "torch"])  # JAX: ~35 s here
def test_the_model_meets_the_authors_numbers_and_tensorflows(tmp_path, backend):
    """The golden fixture (the authors' TF code: NLL and memories of 3 segments) on JAX within 1e-5, with the memory
    (inference and training calls) and with the cache; and a model of every encoding, with an adaptive softmax,
    equal to TensorFlow's, the loss of a training call and its gradient for every weight too."""
    pytest.importorskip(backend)
    import golden_utils
    from conftest import FIXTURE_DIR

    from txl_tf.model import encodings
    from txl_tf.model.transformer_xl import TransformerXL

    cases, expected = {}, {}
    golden_model = golden_utils.golden_model()
    golden = np.load(FIXTURE_DIR / "golden.npz")
    tokens = golden["tokens"].T.astype(np.int32)  # [B, T]
    tgt_len = golden_utils.PROTOCOL["tgt_len"]
    cases.update(_model_case("golden", golden_model, tokens, tgt_len, 3))
    expected.update({f"golden/{k}": v for k, v in backend_model.run(golden_model, tokens, tgt_len, 3).items()})
    rng = np.random.default_rng(1)
    random_tokens = rng.integers(0, 40, (2, 13)).astype(np.int32)
    for attn_type in encodings.NAMES:
        model = TransformerXL(n_token=40, n_layer=2, d_model=16, n_head=2, d_head=8, d_inner=24, dropout=0.0, dropatt=0.0, mem_len=5,
                              cutoffs=(10, 20), div_val=2, attn_type=attn_type, max_position=16, untie_r=True)
        model(random_tokens[:, :1], model.initial_memory(2))  # builds every weight
        cases.update(_model_case(attn_type, model, random_tokens, 4, 3))
        expected.update({f"{attn_type}/{k}": v for k, v in backend_model.run(model, random_tokens, 4, 3).items()})
    got = run_under(backend, tmp_path, cases, script=os.path.join(REPO, "tests", "backend_model.py"))
    assert str(got.pop("backend")) == backend and not got.pop("tensorflow_loaded")
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        np.testing.assert_allclose(got[key], value, atol=1e-5, rtol=0, err_msg=key)
    for s in range(3):  # the authors' own numbers: nll [L, B], memories [M, B, d] per layer
        for form in ("memory", "training", "cache"):
            np.testing.assert_allclose(got[f"golden/{form}/nll_{s}"].T, golden[f"nll_{s}"], atol=1e-5, rtol=0)
        for i in range(golden_model.n_layer):
            np.testing.assert_allclose(np.transpose(got[f"golden/memory/memory_{s}"][i], (1, 0, 2)),
                                       golden[f"mem_{s}_{i}"], atol=1e-5, rtol=0)
