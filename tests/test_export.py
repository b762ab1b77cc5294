"""SavedModel export: a fresh process without txl_tf loads it and gives the Python model's numbers."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from txl_tf import evaluation, export
from txl_tf.configs import ModelConfig
from txl_tf.data.vocab import Vocab  # the in-graph tokenizer comes with the data package

MEM_LEN, CLAMP_LEN = 6, 4
TEXTS = ["the cat sat", "a hat"]

# Runs in a fresh interpreter whose cwd and PYTHONPATH do not contain txl_tf; importing it is also blocked,
# so the SavedModel has to work with tensorflow and tensorflow_text alone.
LOADER = textwrap.dedent("""
    import importlib.abc, importlib.util, sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "txl_tf" or name.startswith("txl_tf."):
                raise ImportError("txl_tf must not be needed to load the SavedModel")
            return None

    # First on the meta path: also hides an installed txl_tf (`make test` installs it, editable, as CI does).
    installed = importlib.util.find_spec("txl_tf") is not None
    sys.meta_path.insert(0, Block())
    try:
        import txl_tf  # noqa: F401
    except ImportError:
        pass
    else:
        raise AssertionError("txl_tf is still importable")
    print("txl_tf installed in this interpreter:", installed, "- blocked for this check")
    import numpy as np
    import tensorflow as tf
    import tensorflow_text  # noqa: F401  (registers the tokenizer's ops)

    export_dir, inputs_path, outputs_path = sys.argv[1:]
    inp = np.load(inputs_path)
    loaded = tf.saved_model.load(export_dir)
    sigs = loaded.signatures
    out = {"names": np.array(sorted(sigs.keys()))}
    mems = sigs["initial_mems"](batch_size=tf.constant(2))["mems"]
    score = sigs["score"](tokens=tf.constant(inp["tokens"]), targets=tf.constant(inp["targets"]), mems=mems)
    out["nll"], out["new_mems"] = score["nll"].numpy(), score["new_mems"].numpy()
    nxt = sigs["next_token_logits"](tokens=tf.constant(inp["next"]), mems=score["new_mems"])
    out["logits"], out["logits_mems"] = nxt["logits"].numpy(), nxt["new_mems"].numpy()
    text = sigs["score_text"](text=tf.constant(list(inp["texts"])), mems=mems)
    out["text_tokens"], out["text_lengths"], out["text_nll"] = (
        text["tokens"].numpy(), text["lengths"].numpy(), text["nll"].numpy())
    out["asset"] = np.array(loaded.vocab_asset.asset_path.numpy().decode())
    assert not any(m == "txl_tf" or m.startswith("txl_tf.") for m in sys.modules)
    np.savez(outputs_path, **out)
""")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export")
    vocab = Vocab([ord(c) for c in "abcdefghijklmnopqrstuvwxyz "], "char")
    vocab.save(str(tmp / "vocab.json"))
    tf.keras.utils.set_random_seed(9)
    model = ModelConfig(n_layer=2, d_model=8, n_head=2, d_head=3, d_inner=10, mem_len=MEM_LEN).build(len(vocab))
    export.export_model(model, str(tmp / "saved"), mem_len=MEM_LEN, clamp_len=CLAMP_LEN, same_length=True,
                        vocab=vocab, vocab_file=str(tmp / "vocab.json"))
    return tmp, model, vocab


def _python_reference(model, vocab, inputs):
    ref = {}
    with evaluation.eval_protocol(model, mem_len=MEM_LEN, clamp_len=CLAMP_LEN, same_length=True):
        hidden, mems = model(inputs["tokens"], mems=model.initial_mems(2))
        ref["nll"], ref["new_mems"] = model.nll(hidden, inputs["targets"]).numpy(), mems.numpy()
        hidden, mems = model(inputs["next"], mems=mems)
        ref["logits"], ref["logits_mems"] = model.log_probs(hidden[:, -1:]).numpy()[:, 0], mems.numpy()
        ids = [vocab.encode(t) for t in TEXTS]
        width = max(map(len, ids))
        padded = np.array([i + [0] * (width - len(i)) for i in ids], np.int32)
        hidden, _ = model(padded[:, :-1], mems=model.initial_mems(2))
        nll = model.nll(hidden, padded[:, 1:]).numpy()
        mask = np.arange(width - 1)[None, :] < (np.array([len(i) for i in ids]) - 1)[:, None]
        ref["text_tokens"], ref["text_lengths"], ref["text_nll"] = padded, [len(i) for i in ids], nll * mask
    return ref


def test_fresh_process_without_txl_tf_matches_python(exported):
    tmp, model, vocab = exported
    rng = np.random.default_rng(0)
    inputs = {"tokens": rng.integers(0, len(vocab), [2, 5]).astype(np.int32),
              "targets": rng.integers(0, len(vocab), [2, 5]).astype(np.int32),
              "next": rng.integers(0, len(vocab), [2, 3]).astype(np.int32), "texts": np.array(TEXTS)}
    np.savez(tmp / "inputs.npz", **inputs)
    (tmp / "loader.py").write_text(LOADER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(tmp / "loader.py"), str(tmp / "saved"), str(tmp / "inputs.npz"),
                           str(tmp / "outputs.npz")], cwd=str(tmp), env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = np.load(tmp / "outputs.npz")
    assert sorted(out["names"].tolist()) == sorted(export.SIGNATURES)
    assert str(out["asset"]).endswith("vocab.json")
    ref = _python_reference(model, vocab, inputs)
    for key, expected in ref.items():
        np.testing.assert_allclose(out[key], expected, atol=1e-5, rtol=0, err_msg=key)


def test_saved_model_cli_lists_signatures(exported):
    tmp = exported[0]
    cli = os.path.join(os.path.dirname(sys.executable), "saved_model_cli")
    proc = subprocess.run([cli, "show", "--all", "--dir", str(tmp / "saved")], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in export.SIGNATURES:
        assert f"signature_def['{name}']" in proc.stdout
    # mems and new_mems are [n_layer, B, M, d_model] in every signature
    assert proc.stdout.count(f"shape: (2, -1, {MEM_LEN}, 8)") == 2 * len(export.SIGNATURES) - 1
