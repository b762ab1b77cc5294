"""Converter: parity with the authors' TF code on the golden fixture, CLI, and clear mismatch errors."""

import json

import numpy as np

from txl_tf import convert

SEGMENTS = 3


def _golden(fixture_dir):
    golden = np.load(fixture_dir / "golden.npz")
    info = json.loads((fixture_dir / "info.json").read_text())["config"]
    return golden, info


def _run_segments(model, golden, tgt_len):
    """Per-segment (nll [L, B], [mem_i [M, B, d]]) time-major like the fixture, starting from zero memory."""
    tokens = golden["tokens"].T  # [B, T] batch-major
    mems = model.initial_mems(tokens.shape[0])
    outputs = []
    for s in range(SEGMENTS):
        inputs = tokens[:, s * tgt_len : (s + 1) * tgt_len]
        targets = tokens[:, s * tgt_len + 1 : (s + 1) * tgt_len + 1]
        hidden, mems = model(inputs, mems)
        nll = model.nll(hidden, targets).numpy().T  # [L, B]
        outputs.append((nll, [np.transpose(m, (1, 0, 2)) for m in mems.numpy()]))
    return outputs


def test_parity_with_original_tf(fixture_dir):
    golden, info = _golden(fixture_dir)
    model = convert.from_original_tf(str(fixture_dir / "model.ckpt"), mem_len=info["mem_len"])
    assert (model.n_layer, model.d_model, model.n_head, model.d_head, model.d_inner, model.n_token) == (
        info["n_layer"], info["d_model"], info["n_head"], info["d_head"], info["d_inner"], info["n_token"])
    for s, (nll, mems) in enumerate(_run_segments(model, golden, info["tgt_len"])):
        np.testing.assert_allclose(nll, golden[f"nll_{s}"], atol=1e-5, rtol=0)
        for i, mem in enumerate(mems):
            np.testing.assert_allclose(mem, golden[f"mem_{s}_{i}"], atol=1e-5, rtol=0)
