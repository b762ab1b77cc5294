"""keras-hub's training and scoring idioms on the Transformer-XL CausalLM (issue 53, items 3-5): compile's
metrics and loss, fit/evaluate on texts (each text its own stream), and `score`."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from hub_utils import VOCAB, tiny_lm

from txl_tf.base.errors import ConfigError
from txl_tf.data import pipeline

TEXTS = ["the quick brown fox jumps over the lazy dog", "hello world", "a stream language model", "xyz"]


def token_batch(texts, length=24):
    """(x: {"token_ids", "padding_mask"} [B, length], y, sample_weight) as the preprocessor gives them."""
    ids = np.zeros([len(texts), length + 1], np.int32)
    mask = np.zeros([len(texts), length + 1], np.int32)
    for row, text in enumerate(texts):
        encoded = VOCAB.encode(text)[:length + 1]
        ids[row, :len(encoded)], mask[row, :len(encoded)] = encoded, 1
    return {"token_ids": ids[:, :-1], "padding_mask": mask[:, :-1]}, ids[:, 1:], mask[:, 1:]


def recurrent_nll(lm, ids, targets, segment):
    """Per-token NLL [L] of one text read by plain calls of the model, `segment` tokens a call, the memory carried
    from zeros (the training protocol)."""
    model = lm.backbone.transformer_xl
    memory, nll = model.initial_memory(1), []
    for start in range(0, len(ids), segment):
        hidden, memory = model(np.array([ids[start:start + segment]], np.int32), memory)
        nll.append(model.nll(hidden, np.array([targets[start:start + segment]], np.int32))[0].numpy())
    return np.concatenate(nll)


def test_fit_and_evaluate_take_texts_as_keras_hub_models_do():
    lm = tiny_lm()
    lm.compile(optimizer=keras.optimizers.Adam(1e-2))
    first = lm.evaluate(TEXTS, batch_size=2, verbose=0)
    history = lm.fit(TEXTS, batch_size=2, epochs=3, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    strings = tf.data.Dataset.from_tensor_slices(TEXTS).batch(2)
    lm.fit(strings, epochs=2, verbose=0)
    x, y, sample_weight = token_batch(TEXTS)
    lm.fit(x=x, y=y, sample_weight=sample_weight, batch_size=2, epochs=2, verbose=0)
    lm.fit(strings.map(lm.preprocessor), epochs=1, verbose=0)  # keras-hub's own idiom: a preprocessed dataset
    assert lm.evaluate(TEXTS, batch_size=2, verbose=0) < first  # it learned


def test_a_text_is_read_in_segments_with_its_memory_and_no_memory_passes_between_texts():
    """The loss evaluate() reports for a text (three segments of 4 here, rows of a batch) is the model's own loss
    with the memory carried between the text's segments from zeros, whatever the other row holds: text B's loss
    is the same beside either of two other texts and alone."""
    lm = tiny_lm()
    lm.compile()
    text = TEXTS[1]  # 11 characters: segments of 4, 4 and 3 (after the padding, nothing)
    x, y, sample_weight = token_batch([text])
    ids, targets = x["token_ids"][0][:10], y[0][:10]
    with_memory = recurrent_nll(lm, ids, targets, lm.backbone.segment_len).mean()
    model = lm.backbone.transformer_xl
    alone = np.concatenate([model.nll(model(np.array([ids[s:s + 4]]))[0], np.array([targets[s:s + 4]]))[0]
                            for s in range(0, 10, 4)]).mean()
    assert abs(with_memory - alone) > 1e-3  # the memory matters for these numbers
    np.testing.assert_allclose(lm.evaluate(x, y, sample_weight=sample_weight, verbose=0), with_memory, rtol=1e-5)
    for other in (TEXTS[0], TEXTS[2]):  # row 0: another text, weighted 0; row 1: text B
        x, y, sample_weight = token_batch([other, text])
        sample_weight[0] = 0
        np.testing.assert_allclose(lm.evaluate(x, y, sample_weight=sample_weight, verbose=0), with_memory,
                                   rtol=1e-5)


def test_compile_metrics_are_reported_and_compile_again_works():
    lm = tiny_lm()
    lm.compile(optimizer=keras.optimizers.SGD(0.0), metrics=[keras.metrics.SparseCategoricalAccuracy("acc")],
               weighted_metrics=[keras.metrics.SparseCategoricalCrossentropy(from_logits=True, name="xent")])
    history = lm.fit(TEXTS, batch_size=4, epochs=1, verbose=0).history  # one batch: its token-weighted mean
    assert set(history) == {"loss", "acc", "xent"}, history
    assert 0 <= history["acc"][0] <= 1
    np.testing.assert_allclose(history["xent"], history["loss"], rtol=1e-5)  # the same NLL, from the logits
    results = lm.evaluate(TEXTS, batch_size=2, verbose=0, return_dict=True)
    assert set(results) == {"loss", "acc", "xent"}
    lm.compile()  # and without metrics again
    assert set(lm.fit(TEXTS, batch_size=2, epochs=1, verbose=0).history) == {"loss"}


def test_compile_loss_is_applied_to_the_log_probabilities():
    """keras-hub's own loss (cross-entropy from logits) gives the "auto" loss; a loss scaled by 1000 reports and
    trains with 1000 times it."""
    x, y, _ = token_batch([TEXTS[0], TEXTS[0][::-1]])  # no padding, no weights: Keras' mean is over every token
    losses = {}
    for name, loss in [("auto", "auto"), ("keras", keras.losses.SparseCategoricalCrossentropy(from_logits=True)),
                       ("scaled", lambda y_true, y_pred: 1000.0 * keras.losses.sparse_categorical_crossentropy(
                           y_true, y_pred, from_logits=True))]:
        lm = tiny_lm()
        lm.compile(optimizer=keras.optimizers.SGD(0.0), loss=loss)
        losses[name] = lm.evaluate(x, y, verbose=0)
    np.testing.assert_allclose(losses["keras"], losses["auto"], rtol=1e-5)
    np.testing.assert_allclose(losses["scaled"], 1000 * losses["auto"], rtol=1e-5)


def test_score_has_keras_hubs_signature_and_reads_each_row_as_a_text():
    lm = tiny_lm()
    x, y, _ = token_batch([TEXTS[0], TEXTS[1]])
    log_probs = lm.score(x["token_ids"], x["padding_mask"])  # scoring_mode="logits"
    assert log_probs.shape == (2, 24, len(VOCAB))
    np.testing.assert_allclose(np.exp(log_probs).sum(-1), 1.0, atol=1e-5)
    loss = lm.score(token_ids=x["token_ids"], padding_mask=x["padding_mask"], scoring_mode="loss", target_ids=y)
    assert loss.shape == (2, 24)
    np.testing.assert_allclose(loss, -np.take_along_axis(log_probs.numpy(), y[..., None], -1)[..., 0], atol=1e-5)
    alone, _, _ = token_batch([TEXTS[1]])
    np.testing.assert_allclose(lm.score(alone["token_ids"], alone["padding_mask"])[0, :10], log_probs[1, :10],
                               atol=1e-5)  # row B's log-probabilities, whatever row A holds
    with pytest.raises(ConfigError, match="target_ids"):
        lm.score(x["token_ids"], scoring_mode="loss")
    with pytest.raises(ConfigError, match="scoring_mode"):
        lm.score(x["token_ids"], scoring_mode="probabilities")


def test_a_stream_ordered_corpus_still_carries_the_memory_from_batch_to_batch():
    """(tests/test_hub.py checks the numbers.) The stream's batches carry no padding mask: fit's other path."""
    lm = tiny_lm()
    lm.compile(metrics=[keras.metrics.SparseCategoricalAccuracy("acc")])
    tokens = np.random.default_rng(0).integers(0, len(VOCAB), 2 * 4 * 3 + 1).astype(np.int32)
    stream = pipeline.make_dataset(None, "train", 2, 4, repeat=False, tokens=tokens)
    assert set(lm.fit(stream, epochs=1, verbose=0).history) == {"loss", "acc"}
