"""txl_tf.lm.hub: Transformer-XL as keras-hub's Backbone, CausalLM, preprocessor and tokenizer (issue 36).

Everything runs through the real keras-hub: its samplers, its generate(), its preset saver and loaders.
"""

import json
import os

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf
from hub_utils import plain_greedy

from txl_tf.base import paths
from txl_tf.base.errors import ConfigError, UserError
from txl_tf.configs import EvalConfig, ModelConfig
from txl_tf.data import pipeline
from txl_tf.data.vocab import Vocab
from txl_tf.lm import hub
from txl_tf.lm.hub import (
    TransformerXLBackbone,
    TransformerXLCausalLM,
    TransformerXLCausalLMPreprocessor,
    TransformerXLTokenizer,
)

VOCAB = Vocab([10] + list(range(32, 127)), "char")
PROMPTS = ["hello world, this is a longer prompt", "ab"]  # 36 tokens (over four 8-token segments) and 2


def make_lm(sequence_length=60, attn_type="xl", seed=3):
    keras.utils.set_random_seed(seed)
    model_config = ModelConfig(n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, dropout=0.0, mem_len=16,
                               n_token=len(VOCAB), attn_type=attn_type)
    eval_config = EvalConfig(tgt_len=8, mem_len=16, clamp_len=-1, same_length=False)
    backbone = TransformerXLBackbone(model_config, eval_config)
    preprocessor = TransformerXLCausalLMPreprocessor(TransformerXLTokenizer(VOCAB), sequence_length=sequence_length)
    return TransformerXLCausalLM(backbone, preprocessor)


def cached_call_log_probs(lm, tokens, lengths):
    """Per row, {index: the log-probs after its token at index} from its prompt's last token on: the model's
    cached call one row at a time, the prompt in the loop's segments, then a token a call (the memory starts
    empty)."""
    model, protocol, segment = lm.backbone.transformer_xl, lm.backbone.protocol, lm.backbone.segment_len
    steps, expected = tokens.shape[1], []
    for row, length in enumerate(lengths):
        state, row_log_probs = model.initial_cache(1, protocol, max_len=segment), {}
        starts = list(range(0, length, segment)) + list(range(length, steps))  # the prompt's segments, then tokens
        for start, end in zip(starts, starts[1:] + [steps], strict=True):
            hidden, state = model(tokens[row:row + 1, start:end], state, protocol=protocol,
                                  memory_lengths=np.array([start], np.int32))
            row_log_probs[end - 1] = model.log_probs(hidden[:, -1:])[0, 0].numpy()
        expected.append(row_log_probs)
    return expected


@pytest.fixture(scope="module")
def lm():
    return make_lm()


@pytest.mark.slow  # ~10 s; the ring test above checks the same step against the cached call in the fast suite
def test_greedy_generation_through_keras_hub_equals_txl_tf_decoding_past_the_memory(lm):
    """60 positions with a memory of 16: the continuation runs past every window; rows of different lengths."""
    lm.compile(sampler="greedy")
    out = lm.generate(PROMPTS, max_length=60)
    assert isinstance(out, list) and all(isinstance(text, str) for text in out)
    assert out == plain_greedy(lm, PROMPTS, 60)
    assert [len(text) for text in out] == [60, 60]


@pytest.mark.parametrize("attn_type", ["shaw", "rope", "alibi", "vaswani"])
def test_other_encodings_generate_as_txl_tf_does(attn_type):
    lm = make_lm(attn_type=attn_type)
    lm.compile(sampler="greedy")
    assert lm.generate(PROMPTS, max_length=40) == plain_greedy(lm, PROMPTS, 40)


@pytest.mark.parametrize(("attn_type", "rows", "lora"), [("xl", 2, False), ("shaw", 2, False), ("xl", 1, True)])
def test_the_ring_of_keys_and_values_gives_the_cached_calls_log_probabilities(attn_type, rows, lora):
    """Token by token past three memories in the ring (`_ring_loop`: position p of a row in slot p mod (M + 1),
    one slot written per token) against the model's cached call one row at a time (the memory's keys/values moved
    each step), after the prompt read in the loop's segments. Two rows: their prompts are shorter and longer than
    the memory, so their kept positions are rolled into the ring differently, and one row goes on reading its
    prompt while the other generates. One row: the projections and the feed-forward as two half-width products
    (`projection.dense_row`), here with LoRA on and its weights drawn (the kernels read with LoRA's update)."""
    lm = make_lm(attn_type=attn_type)
    protocol = lm.backbone.protocol
    if lora:
        lm.backbone.enable_lora(2)
        draw = np.random.default_rng(6)
        for weight in lm.backbone.weights:
            if "lora_kernel" in weight.path:
                weight.assign(draw.normal(0, 0.3, weight.shape).astype(np.float32))
    mem_len = protocol.mem_len
    steps, lengths = 3 * mem_len, [2, mem_len + 3][-rows:]
    tokens = np.random.default_rng(5).integers(0, len(VOCAB), [rows, steps]).astype(np.int32)
    expected = cached_call_log_probs(lm, tokens, lengths)
    _, cache, position_keys = lm._build_cache(tf.constant(tokens), tf.constant(lengths))
    next, cache = lm._ring_loop(cache, position_keys)
    checked = 0
    for index in range(min(lengths), steps + 1):  # the step that reads the token at index - 1
        log_probs, _, cache = next(tf.constant(tokens), cache, tf.constant(index))
        for row in range(rows):
            if index >= lengths[row]:  # the row's prompt is read: the log-probs after its token at index - 1
                np.testing.assert_allclose(log_probs[row], expected[row][index - 1], atol=1e-5)
                checked += 1
    assert checked == rows * steps - sum(lengths) + rows


class _Forced(keras_hub.samplers.Sampler):
    """keras-hub's plain sampler loop that keeps the log-probabilities of every step and draws the given tokens
    (teacher forcing): run eagerly, the loop is Python's and each step calls it once, in order."""

    def __init__(self, tokens, index):
        super().__init__()
        self.tokens, self.index, self.log_probs = tokens, index, []

    def compute_probabilities(self, logits):
        self.log_probs.append(logits.numpy())
        return logits

    def get_next_token(self, probabilities):
        self.index += 1
        return tf.constant(self.tokens[:, self.index - 1])


@pytest.mark.parametrize(("attn_type", "rows", "pieces"), [("xl", 2, 1), ("shaw", 2, 1), ("xl", 1, 9)])
def test_the_block_loop_gives_the_cached_calls_log_probabilities(attn_type, rows, pieces):
    """The ring written once per block of `DECODE_BLOCK` positions (`_block_decode`: the block's steps read the
    ring and a side buffer of their own keys/values), token by token past five memories and three blocks, against
    the model's cached call one row at a time. Two rows: prompts shorter and longer than the memory and the block,
    one row reading its prompt while the other generates; the prompt's end falls mid-block. One row: nine calls,
    each a piece of a few tokens that starts and ends mid-block (the ring flushed at each call's end)."""
    lm = make_lm(attn_type=attn_type)
    protocol = lm.backbone.protocol
    mem_len, block = protocol.mem_len, hub.DECODE_BLOCK
    steps, lengths = 5 * mem_len + 3, [2, block + 5][-rows:]
    tokens = np.random.default_rng(5).integers(0, len(VOCAB), [rows, steps]).astype(np.int32)
    expected = cached_call_log_probs(lm, tokens, lengths)
    mask = np.arange(steps)[None, :] < np.array(lengths)[:, None]
    prompt = tf.constant(np.where(mask, tokens, 0))
    _, cache, position_keys = lm._build_cache(prompt, tf.constant(lengths), lm._ring_protocol(steps))
    ring = lm._to_ring(cache, steps, blocks=True)
    assert ring[0][0].shape[3] == block  # M = 16 positions and the token's own: one block of slots
    first = min(lengths)
    bounds = np.linspace(first, steps, pieces + 1).round().astype(int)
    sampler = _Forced(tokens, first)
    for index, stop in zip(bounds[:-1], bounds[1:], strict=True):
        prompt, ring = lm._block_decode(prompt, tf.constant(mask), ring, position_keys, tf.constant(index),
                                        tf.constant(stop), sampler)
    np.testing.assert_array_equal(prompt, tokens)
    assert len(sampler.log_probs) == steps - first
    checked = 0
    for index, log_probs in zip(range(first, steps), sampler.log_probs, strict=True):
        for row in range(rows):
            if index >= lengths[row]:  # the row's prompt is read: the log-probs after its token at index - 1
                np.testing.assert_allclose(log_probs[row], expected[row][index - 1], atol=1e-5)
                checked += 1
    assert checked == rows * (steps - 1) - sum(lengths) + rows


def test_the_block_loop_ends_where_keras_hubs_loop_ends():
    """Two rows in blocks (`_block_decode`), the stop check of keras-hub's loop: the loop ends once every row has
    made a stop token (the positions after it keep their padding), the tokens before are the per-token ring's in
    keras-hub's own loop (`compile(generate_ring=False)`: the cached call), and what is kept is cut after each row's
    first stop."""
    lm = make_lm()
    lengths, width, pad = [3, 9], 60, 0
    tokens = np.random.default_rng(8).integers(1, len(VOCAB), [2, width]).astype(np.int32)
    mask = np.arange(width)[None, :] < np.array(lengths)[:, None]
    inputs = {"token_ids": tf.constant(np.where(mask, tokens, pad)), "padding_mask": tf.constant(mask)}
    outputs = {}
    for ring in (True, False):
        lm.compile(sampler="greedy", generate_ring=ring)
        full = lm.make_generate_function()(inputs, stop_token_ids=None)["token_ids"].numpy()
        # Each row's 12th new token is a stop (one of them may be made earlier): a row stops and the other goes on.
        stops = [int(full[row, length + 11]) for row, length in enumerate(lengths)]
        stops = [stop for stop in stops if stop != pad]
        ends = [length + next(i for i, token in enumerate(full[row, length:]) if token in stops)
                for row, length in enumerate(lengths)]  # each row's first new stop
        outputs[ring] = (full, stops, ends, lm.make_generate_function()(inputs, stop_token_ids=tuple(stops)))
    (full, stops, ends, stopped), (full_cached, stops_cached, _, stopped_cached) = outputs[True], outputs[False]
    np.testing.assert_array_equal(full, full_cached)
    assert stops == stops_cached and stops and ends[0] != ends[1]  # one row goes on after the other's stop
    last = max(ends)  # the step that made the last row's first stop: the loop ends after it
    np.testing.assert_array_equal(stopped["token_ids"][:, :last + 1], full[:, :last + 1])
    assert (stopped["token_ids"].numpy()[:, last + 1:] == pad).all()
    np.testing.assert_array_equal(stopped["token_ids"], stopped_cached["token_ids"])
    np.testing.assert_array_equal(stopped["padding_mask"], stopped_cached["padding_mask"])
    kept = stopped["padding_mask"].numpy()
    assert [int(kept[row].sum()) for row in range(2)] == [end + 1 for end in ends]


@pytest.mark.parametrize("attn_type", ["xl", "shaw"])
def test_generation_starts_with_an_empty_memory_and_equals_one_pass_over_the_text(attn_type):
    """Generation's memory starts empty (the authors' PyTorch convention, not their TF code's zero memory): while
    the memory holds the whole text, each step's log-probabilities are those of one pass over the text without a
    memory, every position attending to all before it; the prompt read in segments of 8 (a memory of 16). The ring
    at the generation's width (12 positions: 14 slots, the speed of a short text) gives them, the ring of the whole
    memory too (18 slots, those no position has written masked) and the model's cached call; and the ring as
    generation builds it (`generate_step`): the prompt read with a memory of the width's 12 positions
    (`_ring_protocol`), not 16 of which 4 no position ever fills."""
    lm = make_lm(attn_type=attn_type)
    model, protocol = lm.backbone.transformer_xl, lm.backbone.protocol
    width, lengths = 12, [3, 10]
    tokens = np.random.default_rng(7).integers(0, len(VOCAB), [2, width]).astype(np.int32)
    hidden, _ = model(tokens, None, protocol=protocol)  # one segment, no memory
    full = model.log_probs(hidden).numpy()  # [2, 12, V]
    decoders = {}
    for name, ring_width in (("short ring", width), ("whole ring", None)):
        _, cache, position_keys = lm._build_cache(tf.constant(tokens), tf.constant(lengths))
        next, cache = lm._ring_loop(cache, position_keys, ring_width)
        decoders[name] = (next, cache)
    short = lm._ring_protocol(width)
    assert (short.mem_len, lm._ring_protocol(None), lm._ring_protocol(40)) == (width, protocol, protocol)
    hidden_states, cache, position_keys = lm._build_cache(tf.constant(tokens), tf.constant(lengths), short)
    assert cache[0].shape[3] == width  # keys [n, N, B, M, D]: a memory of the width
    np.testing.assert_allclose(hidden_states, lm._build_cache(tf.constant(tokens), tf.constant(lengths))[0], atol=1e-5)
    decoders["as generation builds it"] = lm._ring_loop(cache, position_keys, width)
    assert decoders["short ring"][1][0][0].shape[3] == width + 2  # the slots, then the scratch slot
    assert decoders["as generation builds it"][1][0][0].shape[3] == width + 2
    assert decoders["whole ring"][1][0][0].shape[3] == protocol.mem_len + 2
    _, cache, position_keys = lm._build_cache(tf.constant(tokens), tf.constant(lengths))
    decoders["cached call"] = (lm._cached_next(position_keys), cache)
    for name, (next, cache) in decoders.items():
        checked = 0
        for index in range(min(lengths), width + 1):  # the step that reads the token at index - 1
            log_probs, _, cache = next(tf.constant(tokens), cache, tf.constant(index))
            for row in range(2):
                if index >= lengths[row]:
                    np.testing.assert_allclose(log_probs[row], full[row, index - 1], atol=1e-5, err_msg=name)
                    checked += 1
        assert checked == 2 * width - sum(lengths) + 2, name


def test_one_prompt_decodes_as_txl_tf_does_and_with_its_row_repeated():
    """At batch 1 the ring's step takes its projections as two half-width products (`projection.dense_row`): the
    greedy text of plain calls; beam search repeats the row (two beams), and the step takes the general path."""
    lm = make_lm()
    lm.compile(sampler="greedy")
    assert lm.generate(PROMPTS[:1], max_length=50) == plain_greedy(lm, PROMPTS[:1], 50)
    lm.compile(sampler=keras_hub.samplers.BeamSampler(num_beams=2))
    out = lm.generate(PROMPTS[:1], max_length=50)
    assert out[0].startswith(PROMPTS[0]) and len(out[0]) == 50, out


def test_stream_generate_yields_generates_text_piece_by_piece():
    """The prompt first, then a piece per `chunk` new tokens; joined, `generate`'s text for the same settings and
    seed, greedy and sampled. Bad requests are one line when the call is made, before any piece is read."""
    lm = make_lm()
    for settings in (dict(temperature=0.0, seed=1), dict(temperature=0.9, top_k=5, seed=5)):
        pieces = list(lm.stream_generate("hello wo", max_length=40, chunk=7, **settings))
        assert pieces[0] == "hello wo" and len(pieces) == 1 + 5 and all(len(p) == 7 for p in pieces[1:-1])
        assert "".join(pieces) == lm.generate("hello wo", max_length=40, **settings)
    timed = list(lm.stream_generate("hello wo", max_length=40, temperature=0.0, seed=1))  # pieces sized by time
    assert timed[0] == "hello wo" and "".join(timed) == lm.generate("hello wo", max_length=40, temperature=0.0)
    with pytest.raises(ConfigError, match=r"^stream_generate's chunk=0 must be None \(pieces sized by time\) or a "
                                          r"whole number from 1 to 4096"):
        lm.stream_generate("hello", max_length=20, chunk=0)
    with pytest.raises(ConfigError, match=r"^stream_generate takes one prompt, a str; got list"):
        lm.stream_generate(["hello"], max_length=20)
    with pytest.raises(ConfigError, match=r"^stream_generate's max_length=3 must be above the longest prompt's 5"):
        lm.stream_generate("hello", max_length=3)


@pytest.mark.slow  # ~20 s: six samplers traced; CI's slow phase
def test_every_keras_hub_sampler_runs_with_the_batch_first_memory(lm):
    """Beam and contrastive repeat and gather the cache's rows: the memory has the batch on axis 0."""
    lm.compile(sampler="greedy")
    greedy = lm.generate(PROMPTS, max_length=50)
    lm.compile(sampler=keras_hub.samplers.BeamSampler(num_beams=1))
    assert lm.generate(PROMPTS, max_length=50) == greedy  # one beam is greedy search
    lm.compile(sampler=keras_hub.samplers.TopKSampler(k=1))
    assert lm.generate(PROMPTS, max_length=50) == greedy
    for sampler in ["beam", "contrastive", "top_k", "top_p", "random"]:
        lm.compile(sampler=sampler)
        out = lm.generate(PROMPTS, max_length=50)
        assert [text[:len(prompt)] for text, prompt in zip(out, PROMPTS, strict=True)] == PROMPTS, sampler
        assert all(len(text) == 50 for text in out), (sampler, out)


def test_generate_takes_what_keras_hubs_generate_takes(lm):
    """(In a graph without XLA, as the tests below: XLA, the default, is covered by the tests above.)"""
    lm.compile(sampler="greedy", generate_jit_compile=False)
    full = lm.generate("hello", max_length=20)
    assert isinstance(full, str) and full.startswith("hello") and len(full) == 20
    assert lm.generate(tf.constant("hello"), max_length=20) == full
    assert lm.generate(["hello"], max_length=20) == [full]
    assert lm.generate(tf.data.Dataset.from_tensor_slices(["hello", "hello"]).batch(2), max_length=20) == [full] * 2
    assert lm.generate("hello", max_length=20, strip_prompt=True) == full[5:]
    assert len(lm.generate("hello")) == lm.preprocessor.sequence_length  # the default max_length
    stop = VOCAB.id_of(ord(full[7]))
    stopped = lm.generate("hello", max_length=20, stop_token_ids=[stop])
    assert stopped == full[:full.index(full[7], 5) + 1]  # up to and including the first new stop token


def test_the_backbone_and_the_task_take_a_plain_tensor_of_token_ids(lm):
    """Before, `lm.model(x)` returned (hidden, Memory): the keras-hub classes return what keras-hub's do."""
    tokens = np.array([VOCAB.encode(PROMPTS[0])[:12]], np.int32)
    hidden = lm.backbone(tokens)
    np.testing.assert_allclose(hidden, lm.backbone({"token_ids": tokens, "padding_mask": np.ones_like(tokens)}),
                               atol=1e-6)
    log_probs = lm(tokens)  # [B, L, V] log-probabilities of the next token
    assert log_probs.shape == (1, 12, len(VOCAB))
    np.testing.assert_allclose(np.exp(log_probs).sum(-1), 1.0, atol=1e-5)


def test_a_keras_hub_preset_loads_through_keras_hubs_own_loaders(lm, tmp_path):
    lm.compile(sampler="greedy", generate_jit_compile=False)
    expected = lm.generate(PROMPTS, max_length=40)
    preset = str(tmp_path / "preset")
    lm.save_to_preset(preset)
    config = json.loads((tmp_path / "preset" / "config.json").read_text())
    assert config["registered_name"] == "txl_tf.hub>TransformerXLBackbone"
    assert config["config"]["eval_config"]["tgt_len"] == 8  # the protocol travels with the model
    assert (tmp_path / "preset" / "assets" / "tokenizer" / "vocab.json").is_file()

    loaded = keras_hub.models.CausalLM.from_preset(preset)
    assert type(loaded) is TransformerXLCausalLM
    loaded.compile(sampler="greedy", generate_jit_compile=False)
    assert loaded.generate(PROMPTS, max_length=40) == expected
    backbone = keras_hub.models.Backbone.from_preset(preset)
    assert isinstance(backbone, TransformerXLBackbone) and backbone.eval_config == lm.backbone.eval_config
    tokenizer = keras_hub.tokenizers.Tokenizer.from_preset(preset)
    assert isinstance(tokenizer, TransformerXLTokenizer)
    assert tokenizer.detokenize(tokenizer.tokenize(["abc d"])) == ["abc d"]
    for a, b in zip(backbone.get_weights(), lm.backbone.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)

    with pytest.raises(paths.OutputExistsError, match="overwrite=True"):
        lm.save_to_preset(preset)  # an existing preset is replaced only when asked
    lm.save_to_preset(preset, overwrite=True)
    assert keras_hub.models.CausalLM.from_preset(preset).backbone.eval_config == lm.backbone.eval_config


def test_from_preset_still_loads_txl_tfs_earlier_preset_format(tmp_path):
    from legacy_presets import write_legacy_preset

    lm = make_lm()
    write_legacy_preset(tmp_path / "old", lm.backbone.transformer_xl, VOCAB, lm.backbone.model_config,
                        lm.backbone.eval_config)
    loaded = TransformerXLCausalLM.from_preset(str(tmp_path / "old"), sequence_length=50)
    assert type(loaded) is TransformerXLCausalLM and loaded.preprocessor.sequence_length == 50
    lm.compile(sampler="greedy", generate_jit_compile=False)
    loaded.compile(sampler="greedy", generate_jit_compile=False)
    assert loaded.generate(PROMPTS, max_length=50) == lm.generate(PROMPTS, max_length=50)


def test_saving_a_preset_goes_through_the_path_check(lm, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.txt").write_text("the user's")
    with pytest.raises(paths.PathError, match="empty"):
        lm.save_to_preset("")
    with pytest.raises(paths.PathError):
        lm.save_to_preset(".")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "notes.txt").write_text("keep")
    with pytest.raises(paths.OutputExistsError, match="holds no keras-hub preset written by txl_tf"):
        lm.save_to_preset("folder", overwrite=True)
    (tmp_path / "theirs").mkdir()  # another program's keras-hub preset: same file names, never replaced
    (tmp_path / "theirs" / "config.json").write_text('{"registered_name": "keras_hub>GPT2Backbone"}')
    with pytest.raises(paths.OutputExistsError, match="holds no keras-hub preset written by txl_tf"):
        lm.save_to_preset("theirs", overwrite=True)
    with pytest.raises(paths.OutputExistsError, match="holds no keras-hub preset written by txl_tf"):
        lm.backbone.save_to_preset("theirs", overwrite=True)
    assert (tmp_path / "mine.txt").read_text() == "the user's"
    assert os.listdir(tmp_path / "folder") == ["notes.txt"]
    assert os.listdir(tmp_path / "theirs") == ["config.json"]
    lm.backbone.save_to_preset("backbone_only")
    assert isinstance(keras_hub.models.Backbone.from_preset("backbone_only"), TransformerXLBackbone)


def test_a_preset_file_is_untrusted_input(lm, tmp_path):
    preset = tmp_path / "preset"
    lm.save_to_preset(str(preset))
    (preset / "task.json").write_text("[" * 100_000)  # nesting no parser should follow
    with pytest.raises(UserError, match="task.json"):
        TransformerXLCausalLM.from_preset(str(preset))
    config = json.loads((preset / "config.json").read_text())
    config["config"]["model_config"]["n_layer"] = 1_000_000
    (preset / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"n_layer=1000000"):
        keras_hub.models.Backbone.from_preset(str(preset))  # refused before anything is built


def _stream(rows=2, seg=8, steps=3, seed=0):
    tokens = np.random.default_rng(seed).integers(0, len(VOCAB), size=rows * seg * steps + 1).astype(np.int32)
    return pipeline.make_dataset(None, "train", rows, seg, repeat=False, tokens=tokens)


def test_fit_and_evaluate_carry_the_memory_from_batch_to_batch():
    """With a learning rate of 0 the loss fit reports is the model's own loss with the memory carried (from zeros
    at each epoch), which differs from the loss without it."""
    lm = make_lm()
    model = lm.backbone.transformer_xl
    dataset = _stream()
    memory, carried, alone = model.initial_memory(2), [], []
    for inputs, targets in dataset.as_numpy_iterator():
        hidden, memory = model(inputs, memory)
        carried.append(float(tf.reduce_mean(model.nll(hidden, targets))))
        hidden, _ = model(inputs)
        alone.append(float(tf.reduce_mean(model.nll(hidden, targets))))
    assert abs(np.mean(carried) - np.mean(alone)) > 1e-4  # the memory matters for these numbers
    lm.compile(optimizer=keras.optimizers.SGD(0.0))
    history = lm.fit(dataset, epochs=2, verbose=0, validation_data=dataset)
    np.testing.assert_allclose(history.history["loss"], [np.mean(carried)] * 2, rtol=1e-5)
    np.testing.assert_allclose(history.history["val_loss"], [np.mean(carried)] * 2, rtol=1e-5)
    np.testing.assert_allclose(lm.evaluate(dataset, verbose=0), np.mean(carried), rtol=1e-5)
    assert not any("memory" in weight.path for weight in lm.weights)  # no weight of the model, never saved
    wider = _stream(rows=3)  # another number of rows: a new memory, and the step traced again to read it
    assert np.isfinite(lm.fit(wider, epochs=1, verbose=0).history["loss"][0])
    assert np.isfinite(lm.evaluate(wider, verbose=0))


def test_fit_learns_and_the_custom_trainers_model_is_the_backbones():
    lm = make_lm()
    text = np.array(VOCAB.encode("abcdefgh" * 40), np.int32)
    dataset = pipeline.make_dataset(None, "train", 2, 8, repeat=False, tokens=text)
    lm.compile(optimizer=keras.optimizers.Adam(1e-2))
    losses = lm.fit(dataset, epochs=6, verbose=0).history["loss"]
    assert losses[-1] < 0.5 * losses[0], losses
    assert type(lm.backbone.transformer_xl).__name__ == "TransformerXL"  # what python -m txl_tf.train builds


def test_fit_refuses_a_stream_without_a_fixed_number_of_rows_in_one_line():
    lm = make_lm()
    lm.compile()
    # Token ids [B, L] alone are texts without padding (tests/test_hub_fit.py), not a stream.
    assert np.isfinite(lm.fit(np.zeros([2, 8], np.int32), np.zeros([2, 8], np.int32), verbose=0).history["loss"])
    ragged = tf.data.Dataset.from_tensor_slices((np.zeros([5, 8], np.int32), np.zeros([5, 8], np.int32))).batch(2)
    with pytest.raises(ConfigError, match="drop_remainder=True"):
        lm.fit(ragged)


def test_enable_lora_reaches_the_attentions_projections_and_fit_trains_only_lora():
    """keras-hub's own enable_lora finds the attention's query and value projections (Dense layers); fit() then
    changes the LoRA weights and nothing else."""
    lm = make_lm()
    lm.backbone.enable_lora(4)
    trainable = [weight.path for weight in lm.trainable_weights]
    assert trainable == [f"transformer_xl/layer_{i}/attention/{name}/lora_kernel_{ab}"
                         for i in range(2) for name in ("query", "value") for ab in "ab"], trainable
    before = {weight.path: weight.numpy().copy() for weight in lm.weights}
    lm.compile(optimizer=keras.optimizers.Adam(1e-2))
    lm.fit(_stream(), epochs=1, verbose=0)
    changed = {weight.path for weight in lm.weights if not np.array_equal(before[weight.path], weight.numpy())}
    assert changed == set(trainable), sorted(changed)


@pytest.mark.slow  # ~44 s: quantizes, saves and loads a preset, two XLA generations; CI's slow phase
def test_int8_quantizes_every_projection_and_survives_a_preset(tmp_path):
    lm = make_lm()
    model = lm.backbone.transformer_xl
    tokens = np.array([VOCAB.encode(PROMPTS[0])], np.int32)
    float_log_probs = model.log_probs(model(tokens)[0]).numpy()
    lm.quantize("int8")
    projections = {layer.path.split("/", 2)[-1]: layer.quantization_mode
                   for layer in model._flatten_layers() if isinstance(layer, keras.layers.Dense)}
    assert projections == {f"{where}/{name}": "int8" for where, names in [
        ("attention", ("query", "key", "value", "attention_output", "position")),
        ("feed_forward", ("inner", "outer"))] for name in names}, projections
    quantized_log_probs = model.log_probs(model(tokens)[0]).numpy()
    assert 0 < np.abs(quantized_log_probs - float_log_probs).max() < 0.05  # int8, and close to the float model
    lm.compile(sampler="greedy")
    greedy = lm.generate(PROMPTS, max_length=40)
    lm.save_to_preset(str(tmp_path / "int8"))
    loaded = keras_hub.models.CausalLM.from_preset(str(tmp_path / "int8"))
    assert {layer.quantization_mode for layer in loaded.backbone.transformer_xl._flatten_layers()
            if isinstance(layer, keras.layers.Dense)} == {"int8"}
    loaded.compile(sampler="greedy")
    assert loaded.generate(PROMPTS, max_length=40) == greedy
    np.testing.assert_allclose(
        loaded.backbone.transformer_xl.log_probs(loaded.backbone.transformer_xl(tokens)[0]).numpy(),
        quantized_log_probs, rtol=0, atol=1e-6)


def test_the_authors_golden_checkpoint_through_keras_hubs_from_preset_reproduces_its_nll(tmp_path):
    """Converted (python -m txl_tf.convert's layout), written as a keras-hub preset, loaded by keras-hub's own
    `CausalLM.from_preset`: the authors' per-token NLL within 1e-5 under the protocol the preset carries, and
    `evaluate()` (the memory carried by keras' loop) gives their mean."""
    from golden_utils import FIXTURE_DIR, convert_golden, eval_gin, golden_data

    (tmp_path / "converted").mkdir()
    directory = convert_golden(tmp_path / "converted")
    data_dir, expected_mean = golden_data(tmp_path / "data")
    (tmp_path / "eval.gin").write_text(eval_gin(data_dir))
    TransformerXLCausalLM.from_preset(directory, gin_file=str(tmp_path / "eval.gin")).save_to_preset(
        str(tmp_path / "preset"))
    lm = keras_hub.models.CausalLM.from_preset(str(tmp_path / "preset"))
    assert isinstance(lm, TransformerXLCausalLM)
    golden = np.load(FIXTURE_DIR / "golden.npz")
    tokens = golden["tokens"].T  # [3 streams, 16]
    model, protocol = lm.backbone.transformer_xl, lm.backbone.protocol
    assert (lm.backbone.segment_len, protocol.mem_len) == (5, 7)  # the fixture's protocol, from the preset alone
    memory = model.initial_memory(3, protocol)
    for s in range(3):
        hidden, memory = lm.backbone.call_with_state(tokens[:, 5 * s:5 * s + 5], memory)
        nll = model.nll(hidden, tokens[:, 5 * s + 1:5 * s + 6]).numpy().T  # [L, B] as the fixture
        np.testing.assert_allclose(nll, golden[f"nll_{s}"], atol=1e-5, rtol=0)
    stream = tf.data.Dataset.from_tensor_slices(
        ([tokens[:, 5 * s:5 * s + 5] for s in range(3)], [tokens[:, 5 * s + 1:5 * s + 6] for s in range(3)]))
    lm.compile()
    assert lm.evaluate(stream, verbose=0) == pytest.approx(expected_mean, abs=1e-5)


def test_decoding_three_memories_one_token_at_a_time_gives_the_models_log_probabilities():
    """keras-hub's generate (the ring of keys/values, greedy) for 3 x mem_len tokens after a prompt of two
    segments: the probabilities its sampler saw at each step are the model's own for that text, computed by the
    paper's recurrence (the hidden memory of mem_len positions, one position per call) from the same prompt."""
    lm = make_lm()
    model, protocol = lm.backbone.transformer_xl, lm.backbone.protocol
    seen = []

    class Recording(keras_hub.samplers.GreedySampler):
        def get_next_token(self, probabilities):
            seen.append(probabilities.numpy())
            return super().get_next_token(probabilities)

    lm.compile(sampler=Recording(), run_eagerly=True)  # the loop in Python: the test reads each step's numbers
    assert lm._decodes_in_a_ring()
    prompt = PROMPTS[0][:12]  # a full segment of 8 and 4 more
    text = lm.generate([prompt], max_length=12 + 3 * protocol.mem_len)[0]
    assert len(seen) == 3 * protocol.mem_len and len(text) == 12 + 3 * protocol.mem_len
    ids = np.array([VOCAB.encode(text)], np.int32)
    read = lambda n: np.array([n], np.int32)  # noqa: E731  generation's memory starts empty
    hidden, memory = model(ids[:, :8], model.initial_memory(1, protocol), protocol=protocol, memory_lengths=read(0))
    hidden, memory = model(ids[:, 8:12], memory, protocol=protocol, memory_lengths=read(8))
    for t in range(12, ids.shape[1]):
        np.testing.assert_allclose(np.log(seen[t - 12][0]), model.log_probs(hidden[:, -1:])[0, 0], atol=1e-5)
        hidden, memory = model(ids[:, t:t + 1], memory, protocol=protocol, memory_lengths=read(t))


def test_one_fit_step_is_one_step_of_the_custom_trainer_and_the_next_uses_the_memory():
    """The same model, batch and optimizer (txl_tf's Adam, clipped by the global norm as the trainer clips): one
    fit() step and one step of `txl_tf.training.trainer.Trainer` give the same loss and weights; the second batch's loss
    uses the first batch's memory, as the trainer's does."""
    from train_utils import in_memory_trainer, repeated_batch, tiny_model_config, tiny_train_config

    from txl_tf.training import schedules

    # Weights larger than the default initialisation's: the memory moves the second batch's loss far more than
    # the tolerances (with 0.02 the difference was ~1e-5).
    architecture = dict(init_std=0.5)
    trainer = in_memory_trainer(clip_norm=0.05, model=architecture)  # a clip small enough to act
    model_config, config = tiny_model_config(**architecture), tiny_train_config(clip_norm=0.05)
    inputs, targets = repeated_batch()
    vocab = Vocab(list(range(32, 32 + trainer.n_token)), "char")
    lm = TransformerXLCausalLM.from_parts(trainer.model, model_config, EvalConfig(tgt_len=inputs.shape[1]), vocab)
    lm.compile(optimizer=schedules.make_optimizer(config, global_clipnorm=True))
    fit_model = lm.backbone.transformer_xl
    trainer.start(0)
    losses, weights = [], []
    for _ in range(2):
        stats = trainer.train_loop(1)
        losses.append(stats.nll_sum / stats.tokens)
        weights.append([w.numpy().copy() for w in trainer.model.weights])
    seen = []  # (the loss fit reports after each batch: the running mean, weights after it)

    def record(batch, logs):
        seen.append((logs["loss"], [w.numpy().copy() for w in fit_model.weights]))

    batches = tf.data.Dataset.from_tensors((inputs, targets)).repeat(2)
    lm.fit(batches, epochs=1, verbose=0, callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=record)])
    np.testing.assert_allclose([seen[0][0], 2 * seen[1][0] - seen[0][0]], losses, rtol=1e-5)
    for (_, got), want in zip(seen, weights, strict=True):
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    # The second batch with a zero memory, at the weights after the first step: not what either saw.
    fit_model.set_weights(weights[0])
    zero_memory = float(tf.reduce_mean(fit_model.nll(fit_model(inputs)[0], targets)))
    assert abs(zero_memory - losses[1]) > 1e-2, (zero_memory, losses)
