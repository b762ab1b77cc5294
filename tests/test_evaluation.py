"""Evaluation loops: golden parity with the authors' TF code, every token scored once, vanilla windows."""

import json
import math

import numpy as np
import pytest
import tensorflow as tf

from txl_tf.configs import ModelConfig
from txl_tf.evaluation import loops as evaluation
from txl_tf.model.protocol import Protocol

TINY = dict(n_layer=2, d_model=12, n_head=3, d_head=4, d_inner=20, dropout=0.0, dropatt=0.0)


def _fixture(fixture_dir):
    from txl_tf import convert

    golden = np.load(fixture_dir / "golden.npz")
    info = json.loads((fixture_dir / "info.json").read_text())["config"]
    model = convert.from_original_tf(str(fixture_dir / "model.ckpt"), mem_len=info["mem_len"])
    return model, golden, info


def _golden_token_losses(golden):
    """Per stream, segments in order: the corpus order of the fixture's 3 streams."""
    nll = np.concatenate([golden[f"nll_{s}"] for s in range(3)], axis=0)  # [15, 3] time-major
    return nll.T.reshape(-1)


def public_attributes(model):
    """The model's public plain attributes and every layer's config: what evaluation must leave as it was."""
    plain = (int, float, bool, str, tuple, type(None))
    return ({k: v for k, v in vars(model).items() if not k.startswith("_") and isinstance(v, plain)},
            model.get_config(), [block.get_config() for block in model.blocks])


@pytest.mark.parametrize("kv_cache", [True, False])
def test_golden_fixture_mean_nll(fixture_dir, kv_cache):
    model, golden, info = _fixture(fixture_dir)
    before = public_attributes(model)
    streams = golden["tokens"].T  # [3, 16]: stream b predicts tokens[1:, b] from tokens[:-1, b]
    protocol = Protocol(info["mem_len"], info["clamp_len"], info["same_length"])
    result = evaluation.evaluate_streams(model, streams, tgt_len=info["tgt_len"], protocol=protocol,
                                         return_token_losses=True, kv_cache=kv_cache)
    assert result.protocol["state"] == ("cache" if kv_cache else "memory")
    expected = np.mean([golden[f"nll_{s}"].mean() for s in range(3)])
    assert result.num_tokens == 45
    assert abs(result.loss - expected) < 1e-5
    np.testing.assert_allclose(result.token_losses, _golden_token_losses(golden), atol=1e-5)
    assert abs(result.bpc - expected / math.log(2)) < 1e-5
    # The original's batching of the same tokens laid out as one corpus gives the same streams.
    corpus = golden["tokens"].T.reshape(-1)
    original = evaluation.evaluate_tokens(model, corpus, tgt_len=5, protocol=Protocol(7), batch_size=3,
                                          layout="original", kv_cache=kv_cache)
    assert abs(original.loss - expected) < 1e-5 and original.num_tokens == 45
    # With other lengths than the model's (a longer memory, clamping) nothing on the model changes.
    evaluation.evaluate_tokens(model, corpus, tgt_len=4, protocol=Protocol(9, 3, True), batch_size=2,
                               kv_cache=kv_cache)
    evaluation.evaluate_vanilla(model, corpus, window=6, batch_size=4, clamp_len=2, max_steps=2)
    assert public_attributes(model) == before


def test_dataset_loop_matches_golden(fixture_dir):
    model, golden, _ = _fixture(fixture_dir)
    tokens = golden["tokens"].T
    segments = [(tokens[:, s:s + 5], tokens[:, s + 1:s + 6]) for s in (0, 5, 10)]
    result = evaluation.evaluate_dataset(model, tf.data.Dataset.from_tensor_slices(
        tuple(np.stack(part) for part in zip(*segments, strict=True))), protocol=Protocol(7, -1, False))
    assert result.protocol["state"] == "cache"
    assert abs(result.loss - np.mean([golden[f"nll_{s}"].mean() for s in range(3)])) < 1e-5


def _tiny_model(n_token, **overrides):
    from txl_tf.model.transformer_xl import TransformerXL

    tf.keras.utils.set_random_seed(11)
    return TransformerXL(**{**ModelConfig(**TINY, mem_len=6).model_kwargs(n_token), **overrides})


def _stream_oracle(model, stream, tgt_len, mems):
    """Plain model calls on one [S + 1] stream (batch 1), memory carried: (nll [S], final mems)."""
    losses = []
    for start in range(0, len(stream) - 1, tgt_len):
        inputs = stream[None, start:min(start + tgt_len, len(stream) - 1)]
        targets = stream[None, start + 1:start + 1 + inputs.shape[1]]
        hidden, mems = model(inputs, mems)
        losses.append(model.nll(hidden, targets).numpy()[0])
    return np.concatenate(losses), mems


@pytest.mark.parametrize("num_tokens", [47, 46])  # with and without leftover predictions for the tail
def test_every_token_scored_once_in_corpus_order(num_tokens):
    tokens = np.random.default_rng(num_tokens).integers(0, 9, size=num_tokens).astype(np.int32)
    model = _tiny_model(9)
    batch, tgt_len = 3, 4
    result = evaluation.evaluate_tokens(model, tokens, tgt_len=tgt_len, protocol=Protocol(6), batch_size=batch,
                                        return_token_losses=True)
    assert result.num_tokens == num_tokens - 1 == result.token_losses.shape[0]
    assert abs(result.loss - result.token_losses.astype(np.float64).mean()) < 1e-6
    # Oracle: stream b predicts tokens b*S+1 .. b*S+S; the tail continues stream B-1 with its memory.
    span = (num_tokens - 1) // batch
    expected, mems = [], None
    for b in range(batch):
        losses, mems = _stream_oracle(model, tokens[b * span:(b + 1) * span + 1], tgt_len, model.initial_memory(1))
        expected.append(losses)
    if (num_tokens - 1) % batch:
        expected.append(_stream_oracle(model, tokens[batch * span:], tgt_len, mems)[0])
    np.testing.assert_allclose(result.token_losses, np.concatenate(expected), atol=1e-5)


def test_max_steps_limits_segments():
    tokens = np.arange(40, dtype=np.int32) % 7
    result = evaluation.evaluate_tokens(_tiny_model(7), tokens, tgt_len=3, protocol=Protocol(6), batch_size=2,
                                        max_steps=2, return_token_losses=True)
    assert result.num_tokens == 2 * 2 * 3 == result.token_losses.shape[0]


def test_vanilla_window_shifted_by_one_token():
    window, num_tokens = 5, 17
    model = _tiny_model(8, attn_type="al_rfou", mem_len=0, max_position=window)
    tokens = np.random.default_rng(5).integers(0, 8, size=num_tokens).astype(np.int32)
    result = evaluation.evaluate_vanilla(model, tokens, window=window, batch_size=4, return_token_losses=True)
    # Oracle: token t is predicted from tokens[max(0, t - window):t], one forward pass each.
    expected = []
    for t in range(1, num_tokens):
        context = tokens[None, max(0, t - window):t]
        hidden, _ = model(context)
        expected.append(model.nll(hidden[:, -1:], tokens[None, t:t + 1]).numpy()[0, 0])
    assert result.num_tokens == num_tokens - 1
    np.testing.assert_allclose(result.token_losses, expected, atol=1e-5)
    assert result.protocol["protocol"] == "vanilla"


def test_bad_inputs_are_named(tmp_path):
    with pytest.raises(ValueError, match="too few"):
        evaluation.corpus_streams(np.arange(3), batch_size=4)
    with pytest.raises(ValueError, match="layout"):
        evaluation.corpus_streams(np.arange(30), batch_size=2, layout="interleaved")
    evaluation.save_token_losses(str(tmp_path / "a" / "nll.txt"), np.array([0.5, 1.25]))
    np.testing.assert_allclose(np.loadtxt(tmp_path / "a" / "nll.txt"), [0.5, 1.25])
