"""Cached keys/values and position keys give the model's own numbers, segment after segment."""

import numpy as np
import pytest
import tensorflow as tf

from txl_tf import evaluation, kv_cache
from txl_tf.configs import ModelConfig

SEGMENTS = (4, 4, 3)  # the last one shorter, as at the end of a split


@pytest.mark.parametrize("options", [
    dict(),
    dict(pre_lnorm=True, untie_r=True),
    dict(same_length=True, clamp_len=5),
])
def test_forward_matches_model_call(options):
    tf.keras.utils.set_random_seed(4)
    model = ModelConfig(n_layer=3, d_model=10, n_head=2, d_head=6, d_inner=14, mem_len=7, **options).build(13)
    tokens = np.random.default_rng(1).integers(0, 13, size=[2, sum(SEGMENTS)]).astype(np.int32)
    mems = model.initial_mems(2)
    keys, values = kv_cache.initial_state(model, 2)
    start = 0
    for qlen in SEGMENTS:
        segment = tokens[:, start:start + qlen]
        expected, mems = model(segment, mems=mems)
        hidden, keys, values = kv_cache.forward(model, segment, keys, values, kv_cache.position_keys(model, qlen))
        np.testing.assert_allclose(hidden.numpy(), expected.numpy(), atol=1e-5)
        assert keys.shape == (3, 2, 2, 7, 6) == values.shape
        start += qlen


def test_evaluation_with_cache_matches_golden(fixture_dir):
    from txl_tf import convert

    golden = np.load(fixture_dir / "golden.npz")
    model = convert.from_original_tf(str(fixture_dir / "model.ckpt"), mem_len=7)
    result = evaluation.evaluate_streams(model, golden["tokens"].T, tgt_len=5, mem_len=7, kv_cache=True)
    assert abs(result.loss - np.mean([golden[f"nll_{s}"].mean() for s in range(3)])) < 1e-5


def test_tail_and_token_order_match_uncached():
    tf.keras.utils.set_random_seed(2)
    model = ModelConfig(n_layer=2, d_model=8, n_head=2, d_head=4, d_inner=12, mem_len=5).build(9)
    tokens = np.random.default_rng(3).integers(0, 9, size=40).astype(np.int32)
    args = dict(tgt_len=4, mem_len=6, clamp_len=-1, batch_size=3, return_token_losses=True)
    cached = evaluation.evaluate_tokens(model, tokens, kv_cache=True, **args)
    plain = evaluation.evaluate_tokens(model, tokens, **args)
    np.testing.assert_allclose(cached.token_losses, plain.token_losses, atol=1e-5)
    assert cached.num_tokens == 39


def test_unsupported_attention_is_refused():
    model = ModelConfig(n_layer=1, d_model=8, n_head=2, d_head=4, d_inner=12, mem_len=0,
                        attn_type="vaswani").build(9)
    with pytest.raises(ValueError, match="attn_type='xl' only"):
        kv_cache.CachedScorer(model)


def test_steps_trace_once_per_segment_shape():
    tf.keras.utils.set_random_seed(5)
    model = ModelConfig(n_layer=1, d_model=8, n_head=2, d_head=4, d_inner=12, mem_len=5).build(9)
    tokens = tf.constant(np.random.default_rng(0).integers(0, 9, size=[2, 4]), tf.int32)
    scorer, plain = kv_cache.CachedScorer(model), evaluation.make_score_step(model)
    state, mems = scorer.initial_state(2), model.initial_mems(2)
    for _ in range(4):
        _, state = scorer(tokens, tokens, state)
        _, mems = plain(tokens, tokens, mems)
    _, state = scorer(tokens[:, :3], tokens[:, :3], state)  # a final shorter segment: one more trace
    assert scorer._step.experimental_get_tracing_count() == 2
    assert plain.experimental_get_tracing_count() == 1
