"""SavedModel export: a fresh process without txl_tf loads it and gives the Python model's numbers."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from txl_tf import export
from txl_tf.configs import ModelConfig
from txl_tf.data.vocab import Vocab  # the in-graph tokenizer comes with the data package
from txl_tf.model.protocol import Protocol

MEM_LEN, CLAMP_LEN, MAX_LEN = 6, 4, 4
PROTOCOL = Protocol(MEM_LEN, CLAMP_LEN, same_length=True)
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
    state = sigs["initial_state"](batch_size=tf.constant(2))  # pass every state tensor back by its name
    out["state_names"] = np.array(sorted(state))
    score = sigs["score"](tokens=tf.constant(inp["tokens"]), targets=tf.constant(inp["targets"]), **state)
    out["nll"] = score["nll"].numpy()
    state = {name: score[name] for name in state}
    nxt = sigs["next_token_logits"](tokens=tf.constant(inp["next"]), lengths=tf.constant(inp["next_lengths"]),
                                    **state)
    out["logits"] = nxt["logits"].numpy()
    fresh = sigs["initial_state"](batch_size=tf.constant(2))
    text = sigs["score_text"](text=tf.constant(list(inp["texts"])), **fresh)
    out["text_tokens"], out["text_lengths"], out["text_nll"] = (
        text["tokens"].numpy(), text["lengths"].numpy(), text["nll"].numpy())
    out["max_len"] = loaded.max_len.numpy()
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
    before = (model.get_config(), [block.get_config() for block in model.blocks])
    export.export_model(model, str(tmp / "saved"), protocol=PROTOCOL, max_len=MAX_LEN, vocab=vocab,
                        vocab_file=str(tmp / "vocab.json"))
    assert (model.get_config(), [block.get_config() for block in model.blocks]) == before  # nothing set on it
    assert model.protocol == Protocol(MEM_LEN)
    return tmp, model, vocab


def _segments(model, tokens, mems):
    """Hidden states of tokens [B, T] fed in segments of MAX_LEN with the hidden memory (the authors' form)."""
    pieces = []
    for start in range(0, tokens.shape[1], MAX_LEN):
        hidden, mems = model(tokens[:, start:start + MAX_LEN], mems, protocol=PROTOCOL)
        pieces.append(hidden)
    return tf.concat(pieces, axis=1), mems


def _python_reference(model, vocab, inputs):
    """What the signatures must give, from the Python model with the hidden-state memory."""
    ref = {}
    hidden, mems = model(inputs["tokens"], model.initial_memory(2, PROTOCOL), protocol=PROTOCOL)
    ref["nll"] = model.nll(hidden, inputs["targets"]).numpy()
    logits = []
    for row, length in enumerate(inputs["next_lengths"]):  # each row alone, only its own tokens
        hidden, _ = model(inputs["next"][row:row + 1, :length], mems.select_rows(row, row + 1), protocol=PROTOCOL)
        logits.append(model.log_probs(hidden[:, -1:]).numpy()[0, 0])
    ref["logits"] = np.stack(logits)
    ids = [vocab.encode(t) for t in TEXTS]
    width = max(map(len, ids))
    ref["text_tokens"] = np.array([i + [0] * (width - len(i)) for i in ids], np.int32)
    ref["text_lengths"] = [len(i) for i in ids]
    ref["text_nll"] = np.zeros([len(ids), width - 1], np.float32)
    for row, row_ids in enumerate(ids):  # each text alone, in segments of max_len
        row_ids = np.array([row_ids], np.int32)
        hidden, _ = _segments(model, row_ids[:, :-1], model.initial_memory(1, PROTOCOL))
        ref["text_nll"][row, :len(row_ids[0]) - 1] = model.nll(hidden, row_ids[:, 1:]).numpy()[0]
    ref["max_len"] = MAX_LEN
    return ref


@pytest.mark.slow  # CI's slow phase: the fast suite stays near 10 minutes on 2 cores
def test_fresh_process_without_txl_tf_matches_python(exported):
    tmp, model, vocab = exported
    rng = np.random.default_rng(0)
    inputs = {"tokens": rng.integers(0, len(vocab), [2, MAX_LEN]).astype(np.int32),
              "targets": rng.integers(0, len(vocab), [2, MAX_LEN]).astype(np.int32),
              "next": rng.integers(0, len(vocab), [2, 3]).astype(np.int32), "next_lengths": np.array([3, 2], np.int32),
              "texts": np.array(TEXTS)}
    np.savez(tmp / "inputs.npz", **inputs)
    (tmp / "loader.py").write_text(LOADER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(tmp / "loader.py"), str(tmp / "saved"), str(tmp / "inputs.npz"),
                           str(tmp / "outputs.npz")], cwd=str(tmp), env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = np.load(tmp / "outputs.npz")
    assert sorted(out["names"].tolist()) == sorted(export.SIGNATURES)
    assert out["state_names"].tolist() == ["keys", "position_keys", "values"]
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
    # keys and values are [n_layer, N, B, M, D] in and out of every signature but generate (which takes prompts
    # and returns tokens) and initial_state (out only)
    assert proc.stdout.count(f"shape: (2, 2, -1, {MEM_LEN}, 3)") == 2 * (2 * len(export.SIGNATURES) - 3)
    # position keys [n_layer, N, M + max_len, D]
    assert proc.stdout.count(f"shape: (2, 2, {MEM_LEN + MAX_LEN}, 3)") == 2 * len(export.SIGNATURES) - 3
