"""The SavedModel's signatures check what a client sends: each bad argument fails with an InvalidArgumentError that
names it (on a GPU as on a CPU), before the ops that would fail in TensorFlow's words or answer silently."""

import numpy as np
import pytest
import tensorflow as tf

from txl_tf import export
from txl_tf.configs import ModelConfig
from txl_tf.data.vocab import Vocab  # the in-graph tokenizer (score_text)
from txl_tf.model.protocol import Protocol

MEM_LEN, MAX_LEN = 6, 4
TOKENS = np.array([[1, 2, 3]], np.int32)  # [B=1, L=3]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The signatures of a tiny exported model, loaded back, and its vocabulary size."""
    tmp = tmp_path_factory.mktemp("signatures")
    vocab = Vocab([ord(c) for c in "abcdefghij "], "char")
    vocab.save(str(tmp / "vocab.json"))
    tf.keras.utils.set_random_seed(9)
    model = ModelConfig(n_layer=2, d_model=8, n_head=2, d_head=3, d_inner=10, mem_len=MEM_LEN).build(len(vocab))
    export.export_model(model, str(tmp / "saved"), protocol=Protocol(MEM_LEN, 4, same_length=True),
                        max_len=MAX_LEN, vocab=vocab, vocab_file=str(tmp / "vocab.json"))
    return tf.saved_model.load(str(tmp / "saved")).signatures, len(vocab)


def _state(signatures, batch_size):
    return dict(signatures["initial_state"](batch_size=tf.constant(batch_size)))


def _next_token_logits(signatures, tokens=TOKENS, lengths=(3,), batch_size=1):
    return signatures["next_token_logits"](tokens=tf.constant(tokens, tf.int32),
                                           lengths=tf.constant(lengths, tf.int32), **_state(signatures, batch_size))


def _generate(signatures, token_ids=TOKENS, padding_mask=None, **settings):
    """The generate signature on `token_ids` [B, T] (default: all prompt, then 2 slots to fill)."""
    if padding_mask is None:
        token_ids = np.concatenate([token_ids, np.zeros([len(token_ids), 2], np.int32)], axis=1)
        padding_mask = (np.arange(token_ids.shape[1]) < token_ids.shape[1] - 2).astype(np.int32)[None].repeat(
            len(token_ids), 0)
    args = {**dict(seed=0, temperature=1.0, top_k=0, top_p=1.0), **settings}
    args = {name: tf.constant(value, tf.float32 if name in ("temperature", "top_p") else tf.int32)
            for name, value in args.items()}
    return signatures["generate"](token_ids=tf.constant(token_ids, tf.int32),
                                  padding_mask=tf.constant(padding_mask, tf.int32), **args)


def _refused(match):
    return pytest.raises(tf.errors.InvalidArgumentError, match=match)


# ---- D13: next_token_logits with a length outside [1, L] ---------------------------------------------------
@pytest.mark.parametrize("lengths", [[0], [-5], [4]])
def test_next_token_logits_refuses_lengths_outside_one_to_l(served, lengths):
    """Lengths 0 and -5 gave the logits of the (padding) first position; 4 > L failed in a gather."""
    signatures, n_token = served
    assert _next_token_logits(signatures, lengths=[1])["logits"].shape == (1, n_token)  # both ends of [1, L]
    assert _next_token_logits(signatures, lengths=[3])["logits"].shape == (1, n_token)
    with _refused(r"lengths: the count of each row must be in \[1, L\]"):
        _next_token_logits(signatures, lengths=lengths)


def test_next_token_logits_refuses_lengths_of_another_batch(served):
    with _refused(r"lengths: one count per row of tokens"):
        _next_token_logits(served[0], lengths=[3, 3])


# ---- D14: generate's settings -----------------------------------------------------------------------------
@pytest.mark.parametrize("setting,value,match", [
    ("top_p", 0.0, r"top_p must be in \(0, 1\]"), ("top_p", -1.0, r"top_p must be in \(0, 1\]"),
    ("top_p", float("nan"), r"top_p must be in \(0, 1\]"), ("top_p", 1.5, r"top_p must be in \(0, 1\]"),
    ("temperature", float("nan"), "temperature must be finite and >= 0"),
    ("temperature", float("inf"), "temperature must be finite and >= 0"),
    ("temperature", -1.0, "temperature must be finite and >= 0"),
    ("top_k", -3, "top_k must be between 0 .* and the vocabulary size"),
    ("top_k", 12, "top_k must be between 0 .* and the vocabulary size")])
def test_generate_refuses_settings_outside_their_ranges(served, setting, value, match):
    with _refused(match):
        _generate(served[0], **{setting: value})


def test_generate_takes_the_ends_of_each_range_and_refuses_prompts_it_cannot_read(served):
    signatures, n_token = served
    logits = _next_token_logits(signatures)["logits"].numpy()
    greedy = _generate(signatures, temperature=0.0)["token_ids"].numpy()  # 0: greedy
    assert greedy.shape == (1, 5) and (greedy[:, :3] == TOKENS).all() and greedy[0, 3] == np.argmax(logits[0])
    for settings in (dict(top_k=n_token), dict(top_k=0, top_p=1.0), dict(top_p=1e-6), dict(top_k=1)):
        tokens = _generate(signatures, **settings)["token_ids"].numpy()
        assert tokens.shape == (1, 5) and ((0 <= tokens) & (tokens < n_token)).all()
    ids = np.array([[1, 2, 3, 0]], np.int32)
    with _refused("padding_mask: every row needs a prompt of >= 1 token"):
        _generate(signatures, token_ids=ids, padding_mask=np.zeros([1, 4], np.int32))
    with _refused("padding_mask: 1 over the prompt of each row, then 0 for right padding"):  # left padding
        _generate(signatures, token_ids=ids, padding_mask=np.array([[0, 1, 1, 0]], np.int32))
    with _refused("padding_mask: must have the shape of token_ids"):
        _generate(signatures, token_ids=ids, padding_mask=np.ones([1, 3], np.int32))
    with _refused(r"token_ids: every token id must be in \[0, n_token\) = \[0, 11\)"):
        _generate(signatures, token_ids=np.array([[1, 11, 3, 0]], np.int32),
                  padding_mask=np.array([[1, 1, 1, 0]], np.int32))


# ---- D15: score_text of texts under two tokens -------------------------------------------------------------
def test_score_text_says_it_needs_two_tokens(served):
    """The check ran beside the ops that fail on fewer than two tokens, not before them: which error came first
    was up to the executor ("Requires start <= limit", "All except the first dimension ...")."""
    signatures, _ = served
    assert signatures["score_text"](text=tf.constant(["ab"]), **_state(signatures, 1))["nll"].shape == (1, 1)
    for texts in ([""], ["a"], ["a", "b"], ["", "a"]):
        with _refused("score_text needs texts of at least two tokens"):
            signatures["score_text"](text=tf.constant(texts), **_state(signatures, len(texts)))


# ---- ids outside the vocabulary, shapes and the state's batch ----------------------------------------------
@pytest.mark.parametrize("bad_id", [-1, 11, 99])
def test_token_ids_outside_the_vocabulary_are_refused_by_name(served, bad_id):
    """A CPU gather refused them in its own words; a GPU's gives zeros (and its loss NaN) silently."""
    signatures, n_token = served
    assert n_token == 11
    tokens = np.array([[1, bad_id, 3]], np.int32)
    with _refused(r"tokens: every token id must be in \[0, n_token\) = \[0, 11\)"):
        _next_token_logits(signatures, tokens=tokens)
    with _refused(r"tokens: every token id must be in \[0, n_token\)"):
        signatures["score"](tokens=tf.constant(tokens), targets=tf.constant(TOKENS), **_state(signatures, 1))
    with _refused(r"targets: every token id must be in \[0, n_token\)"):
        signatures["score"](tokens=tf.constant(TOKENS), targets=tf.constant(tokens), **_state(signatures, 1))


def test_score_refuses_targets_of_another_shape(served):
    signatures, _ = served
    with _refused("targets: must have the shape of tokens"):
        signatures["score"](tokens=tf.constant(TOKENS), targets=tf.constant([[1, 2, 3, 4]]), **_state(signatures, 1))


@pytest.mark.parametrize("signature", ["next_token_logits", "score", "score_text"])
def test_a_state_of_another_batch_size_is_refused_by_name(served, signature):
    """A state for 2 rows with 1 row of input failed in the model's concat (ConcatOp : Dimension 1 ...)."""
    signatures, _ = served
    calls = {
        "next_token_logits": lambda: _next_token_logits(signatures, batch_size=2),
        "score": lambda: signatures["score"](tokens=tf.constant(TOKENS), targets=tf.constant(TOKENS),
                                             **_state(signatures, 2)),
        "score_text": lambda: signatures["score_text"](text=tf.constant(["abc"]), **_state(signatures, 2)),
    }
    first = "text" if signature == "score_text" else "tokens"
    with _refused(f"state (keys|values): its batch axis must match the batch size of {first}"):
        calls[signature]()
