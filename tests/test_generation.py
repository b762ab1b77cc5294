"""Generation: deterministic under a seed, greedy equals a step-by-step oracle, memory reused."""

import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from train_utils import REPO_ROOT, prepare_tiny_corpus, run_training, subprocess_env, tiny_params

from txl_tf import generation
from txl_tf.configs import ModelConfig

N_TOKEN = 11
PROMPT = np.array([[1, 4, 2, 7, 3], [5, 0, 9, 9, 6]], np.int32)  # [B=2, P=5]


@pytest.fixture(scope="module")
def model():
    tf.keras.utils.set_random_seed(3)
    return ModelConfig(n_layer=2, d_model=10, n_head=2, d_head=5, d_inner=14, dropout=0.0, dropatt=0.0,
                       mem_len=9).build(N_TOKEN)


def _generate(model, **kwargs):
    args = dict(max_tokens=6, temperature=1.0, top_k=0, seed=0, segment_len=3)
    return generation.generate_from_model(model, PROMPT, **{**args, **kwargs})


def test_same_seed_same_tokens(model):
    first = _generate(model, seed=42, temperature=1.5)
    again = _generate(model, seed=42, temperature=1.5)
    other = _generate(model, seed=43, temperature=1.5)
    np.testing.assert_array_equal(first.tokens, again.tokens)
    assert first.tokens.shape == (2, 6) and first.tokens.dtype == np.int32
    assert not np.array_equal(first.tokens, other.tokens)
    assert first.tokens_per_second > 0


def test_greedy_matches_step_by_step_oracle(model):
    result = _generate(model, temperature=0.0, kv_cache=False)
    # Oracle: plain model calls; the prompt in segments of 3 (zero memory at first, so segmentation matters),
    # then one token per call with memory.
    hidden, mems = model(PROMPT[:, :3], mems=model.initial_mems(2))
    hidden, mems = model(PROMPT[:, 3:], mems=mems)
    expected = []
    for _ in range(6):
        token = np.argmax(model.log_probs(hidden[:, -1:]).numpy()[:, 0], axis=-1).astype(np.int32)
        expected.append(token)
        hidden, mems = model(token[:, None], mems=mems)
    np.testing.assert_array_equal(result.tokens, np.stack(expected, axis=1))
    np.testing.assert_allclose(result.mems.numpy(), mems.numpy(), atol=1e-5)  # memory after every token
    np.testing.assert_array_equal(_generate(model, top_k=1, seed=5).tokens, result.tokens)
    # The cached keys/values path (the default) samples the same tokens.
    np.testing.assert_array_equal(_generate(model, temperature=0.0).tokens, result.tokens)
    sampled = [_generate(model, seed=8, kv_cache=flag).tokens for flag in (True, False)]
    np.testing.assert_array_equal(*sampled)


def test_top_k_restricts_choices():
    logits = tf.math.log(tf.constant([[0.1, 0.5, 0.15, 0.25]] * 64))
    draws = [generation.sample_next(logits, tf.constant([s, 0]), 1.0, 2).numpy() for s in range(8)]
    assert set(np.concatenate(draws).tolist()) == {1, 3}


def test_text_roundtrip_and_errors(model):
    from txl_tf.data.vocab import Vocab
    vocab = Vocab([ord(c) for c in "abcdefghij "], "char")
    text = generation.generate_text(model, vocab, "bad cafe", max_tokens=7, seed=1)
    assert len(text) == 7 and set(text) <= set("abcdefghij ")
    with pytest.raises(ValueError, match="no tokens"):
        generation.generate_text(model, vocab, "", max_tokens=3)
    with pytest.raises(ValueError, match="max_tokens"):
        _generate(model, max_tokens=0)


def test_word_level_cli_separates_the_prompt_from_the_continuation(tmp_path):
    """`python -m txl_tf.generate` prints the prompt and the generated words with a space between them."""
    data_dir = prepare_tiny_corpus(str(tmp_path), "word", n_lines=200)
    model_dir = str(tmp_path / "run")
    run_training(model_dir, tiny_params(data_dir))
    result = subprocess.run([sys.executable, "-m", "txl_tf.generate", f"--model_dir={model_dir}",
                             "--prompt=the memory", "--max_tokens=4", "--seed=3", "--temperature=0"],
                            cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    text = result.stdout.splitlines()[1]
    assert text.startswith("the memory ") and not text.startswith("the memory  "), text
