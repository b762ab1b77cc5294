"""TransformerXL: incremental decoding equals one pass, memory semantics, the keys/values cache equals the memory for
every attention type, protocols passed to calls (never set on the model), padded rows, serialization (config,
.keras, tf.train.Checkpoint), mixed precision and XLA."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from txl_tf import TransformerXL
from txl_tf.model import encodings
from txl_tf.model.protocol import Protocol
from txl_tf.model.state import Cache, Memory

V, NL, DM, NH, DH, DI = 23, 2, 12, 2, 5, 17


def make_model(**kw):
    args = dict(n_token=V, n_layer=NL, d_model=DM, n_head=NH, d_head=DH, d_inner=DI, dropout=0.0, dropatt=0.0,
                mem_len=4, max_position=16)
    args.update(kw)
    keras.utils.set_random_seed(7)
    return TransformerXL(**args)


def tokens(b, t, seed=0):
    return tf.constant(np.random.default_rng(seed).integers(0, V, size=(b, t)), tf.int32)


@pytest.mark.parametrize("attn_type", ["xl", "shaw", "al_rfou"])
def test_token_by_token_equals_segment(attn_type):
    """With a memory that covers the segment, feeding one token at a time reproduces one segment pass.

    ("vaswani" cannot: as in the authors' code its absolute positions count back from the last token of each
    call, so a token's position depends on how the text is cut into calls.)
    """
    model = make_model(attn_type=attn_type, untie_r=True, clamp_len=3 if encodings.get(attn_type).clamps else -1)
    x = tokens(2, 6)
    start = model(tokens(2, 3, seed=1))[1]  # a real (non-zero) memory of 3 positions
    full, _ = model(x, start)
    keep_all = model.protocol.replace(mem_len=3 + 6)  # keep everything while decoding
    mems, steps = start, []
    for t in range(6):
        out, mems = model(x[:, t : t + 1], mems, protocol=keep_all)
        steps.append(out)
    np.testing.assert_allclose(tf.concat(steps, 1).numpy(), full.numpy(), atol=1e-5)


def test_segments_with_memory_equal_one_long_pass():
    model = make_model(mem_len=5)
    x = tokens(3, 10)
    long, _ = model(x)
    first, mems = model(x[:, :5])
    second, _ = model(x[:, 5:], mems)
    np.testing.assert_allclose(tf.concat([first, second], 1).numpy(), long.numpy(), atol=1e-5)
    # with a memory shorter than the context the second segment differs
    short = Protocol(mem_len=2)
    _, short_mems = model(x[:, :5], protocol=short)
    assert short_mems.hidden.shape[2] == 2
    assert np.abs(model(x[:, 5:], short_mems, protocol=short)[0].numpy() - second.numpy()).max() > 1e-3


def test_memory_contents_and_shapes():
    model = make_model(mem_len=4, dropout=0.3)
    x = tokens(2, 3)
    mems = model.initial_memory(2)
    assert isinstance(mems, Memory)
    mems = mems.hidden
    assert mems.shape == (NL, 2, 4, DM) and mems.dtype == tf.float32 and not np.any(mems.numpy())
    hidden, new = model(x, Memory(mems))
    assert isinstance(new, Memory)
    new = new.hidden
    assert hidden.shape == (2, 3, DM) and new.shape == (NL, 2, 4, DM)
    np.testing.assert_array_equal(new[0, :, 1:].numpy(), model.embedding(x).numpy())  # layer 0 = embedding
    np.testing.assert_array_equal(new[:, :, :1].numpy(), mems[:, :, 3:].numpy())  # oldest kept: last mem slot
    _, new2 = model(x, Memory(new))
    np.testing.assert_array_equal(new2.hidden[:, :, :1].numpy(), new[:, :, 3:].numpy())
    # longer memories than mem_len are accepted; the result is cut to mem_len
    assert model(x, Memory(tf.zeros([NL, 2, 9, DM])))[1].hidden.shape == (NL, 2, 4, DM)
    # mem_len = 0 turns recurrence off
    model0 = make_model(mem_len=0)
    hidden0, new0 = model0(x, model0.initial_memory(2))
    assert new0.hidden.shape == (NL, 2, 0, DM)
    np.testing.assert_allclose(hidden0.numpy(), model0(x)[0].numpy(), atol=1e-6)


def test_no_gradient_reaches_memory():
    model = make_model()
    x = tokens(2, 3)
    with tf.GradientTape(persistent=True) as tape:
        emb_before = model.embedding.table_0 * 1.0
        _, mems = model(x, training=True)
        hidden, _ = model(x, mems, training=True)
        loss = tf.reduce_sum(model.nll(hidden, x))
        mem_sum = tf.reduce_sum(mems.hidden)
    assert tape.gradient(mem_sum, model.trainable_weights) == [None] * len(model.trainable_weights)
    grads = tape.gradient(loss, model.trainable_weights)
    assert all(g is not None for g in grads)
    del emb_before


def test_bad_mems_rejected():
    model = make_model()
    with pytest.raises(ValueError, match="memory shape"):
        model(tokens(2, 3), Memory(tf.zeros([NL + 1, 2, 4, DM])))
    with pytest.raises(ValueError, match="3 rows but the tokens have 2"):
        model(tokens(2, 3), Memory(tf.zeros([NL, 3, 4, DM])))
    with pytest.raises(TypeError, match="Memory or Cache; got EagerTensor"):
        model(tokens(2, 3), tf.zeros([NL, 2, 4, DM]))  # a bare tensor: wrap it as Memory(tensor)


def test_protocol_is_a_value_passed_to_the_call(tmp_path):
    """Other lengths after loading weights come from a Protocol passed to the call; the model is not changed."""
    model = make_model()
    x = tokens(2, 8)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    before = loaded.get_config()
    protocol = Protocol(mem_len=6, clamp_len=2, same_length=True)
    hidden, mems = loaded(x[:, 4:], loaded(x[:, :4], protocol=protocol)[1], protocol=protocol)
    assert mems.hidden.shape == (NL, 2, 6, DM)
    assert loaded.get_config() == before and loaded.protocol == Protocol(mem_len=4)
    fresh = make_model(mem_len=6, clamp_len=2, same_length=True)
    fresh.set_weights(model.get_weights())
    expected = fresh(x[:, 4:], fresh(x[:, :4])[1])[0]
    np.testing.assert_allclose(hidden.numpy(), expected.numpy(), atol=1e-6)
    assert np.abs(hidden.numpy() - model(x[:, 4:], model(x[:, :4])[1])[0].numpy()).max() > 1e-4


def test_protocol_values_are_checked():
    assert Protocol(np.int64(3)).mem_len == 3 and isinstance(Protocol(np.int64(3)).mem_len, int)
    for bad in (dict(mem_len=-1), dict(mem_len=2.5), dict(mem_len=2, same_length="yes")):
        with pytest.raises(ValueError, match="Protocol"):
            Protocol(**bad)
    with pytest.raises(Exception, match="frozen|cannot assign"):
        Protocol(3).mem_len = 4


CACHE_CASES = [
    dict(attn_type="xl"),
    dict(attn_type="xl", untie_r=True, pre_lnorm=True, cutoffs=(7,), div_val=2),
    dict(attn_type="xl", same_length_keys="pytorch"),
    dict(attn_type="shaw"),
    dict(attn_type="shaw", pre_lnorm=True),
    dict(attn_type="vaswani"),
    dict(attn_type="al_rfou", max_position=9),  # windows of up to 5 + 4 = 9 keys: the table's last row is used
    dict(attn_type="rope", d_head=6),  # rotations need an even head width
    dict(attn_type="rope", d_head=6, pre_lnorm=True),
    dict(attn_type="alibi"),
]


def test_the_cache_cases_cover_every_encoding():
    assert {case["attn_type"] for case in CACHE_CASES} == set(encodings.NAMES)


@pytest.mark.parametrize("kwargs", CACHE_CASES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
@pytest.mark.parametrize("same_length", [False, True])
def test_cache_equals_memory(kwargs, same_length):
    """The keys/values cache and the hidden-state memory give the same outputs, call after call, with segments
    of different lengths (one token included) and a memory that slides."""
    model = make_model(**kwargs)
    protocol = Protocol(mem_len=5, clamp_len=3 if model.encoding.clamps else -1, same_length=same_length)
    mems = model.initial_memory(2, protocol)
    cache = model.initial_cache(2, protocol, max_len=4)
    assert isinstance(cache, Cache) and cache.keys.shape == (NL, NH, 2, 5, kwargs.get("d_head", DH))
    assert ("position_keys" in cache.named()) == (kwargs["attn_type"] in ("xl", "shaw"))
    x = tokens(2, 13, seed=3)
    start = 0
    for length in (4, 1, 3, 1, 4):
        segment = x[:, start:start + length]
        start += length
        from_memory, mems = model(segment, mems, protocol=protocol)
        from_cache, cache = model(segment, cache, protocol=protocol)
        np.testing.assert_allclose(from_cache.numpy(), from_memory.numpy(), atol=2e-5)
    assert cache.keys.shape == (NL, NH, 2, 5, kwargs.get("d_head", DH))


@pytest.mark.parametrize("attn_type", ["xl", "shaw"])
def test_cached_token_by_token_equals_segment(attn_type):
    """With same_length every query sees M + 1 keys, so one token at a time through a cache of M positions
    reproduces one pass of the segment over the same cache (the paper's evaluation setting)."""
    model = make_model(attn_type=attn_type, untie_r=True)
    protocol = Protocol(mem_len=4, clamp_len=-1, same_length=True)
    cache = model.initial_cache(2, protocol, max_len=6)
    _, cache = model(tokens(2, 5, seed=1), cache, protocol=protocol)  # a real (non-zero) memory
    x = tokens(2, 6)
    full, _ = model(x, cache, protocol=protocol)
    steps = []
    for t in range(6):
        out, cache = model(x[:, t:t + 1], cache, protocol=protocol)
        steps.append(out)
    np.testing.assert_allclose(tf.concat(steps, 1).numpy(), full.numpy(), atol=1e-5)


@pytest.mark.parametrize("state", ["cache", "memory"])
def test_padded_rows_leave_the_state_as_their_own_tokens_would(state):
    """Row 1 holds 2 tokens and 3 of padding: its state after the call is the state of its 2 tokens alone."""
    model = make_model(attn_type="xl")
    protocol = Protocol(mem_len=4)
    x = tokens(2, 5, seed=4)
    y = tokens(2, 1, seed=5)

    def initial(batch):
        if state == "cache":
            return model.initial_cache(batch, protocol, max_len=5)
        return model.initial_memory(batch, protocol)

    def run(segment, current, lengths=None):
        return model(segment, current, protocol=protocol, lengths=lengths)

    padded_hidden, padded = run(x, initial(2), lengths=tf.constant([5, 2]))
    alone_hidden, alone = run(x[1:, :2], initial(1))
    np.testing.assert_allclose(padded_hidden[1, :2].numpy(), alone_hidden[0].numpy(), atol=1e-5)
    next_padded, _ = run(y, padded)
    next_alone, _ = run(y[1:], alone)
    np.testing.assert_allclose(next_padded[1].numpy(), next_alone[0].numpy(), atol=1e-5)
    full_row, _ = run(x[:1], initial(1))  # row 0 (all 5 tokens valid) is unaffected
    np.testing.assert_allclose(padded_hidden[0].numpy(), full_row[0].numpy(), atol=1e-5)


def test_cache_misuse_is_refused():
    model = make_model()
    protocol = Protocol(mem_len=4)
    cache = model.initial_cache(1, protocol, max_len=2)
    with pytest.raises(ValueError, match="mem_len"):
        model(tokens(1, 2), cache, protocol=Protocol(mem_len=5))
    with pytest.raises(ValueError, match="inference"):
        model(tokens(1, 2), cache, protocol=protocol, training=True)
    with pytest.raises(ValueError, match="max_len"):  # shapes known when traced: checked then
        model(tokens(1, 3), cache, protocol=protocol)
    with pytest.raises(ValueError, match="lacks position_keys"):
        model(tokens(1, 2), cache._replace(position_keys=()), protocol=protocol)
    absolute = make_model(attn_type="al_rfou", pre_lnorm=True)
    assert not absolute.supports_cache(protocol) and absolute.supports_cache(Protocol(mem_len=0))
    with pytest.raises(ValueError, match="hidden-state memory"):
        absolute.initial_cache(1, protocol, max_len=2)


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(cutoffs=(5, 11), div_val=2, d_embed=8, untie_r=True, tie_projs=(False, True, False)),
    dict(attn_type="al_rfou", mem_len=0, pre_lnorm=True),
    dict(attn_type="shaw", same_length=True, same_length_keys="pytorch"),
])
def test_save_load_and_checkpoint(tmp_path, kwargs):
    model = make_model(**kwargs)
    x = tokens(2, 3)
    expected = model.nll(model(x)[0], x).numpy()
    assert TransformerXL.from_config(model.get_config()).get_config() == model.get_config()
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    np.testing.assert_allclose(loaded.nll(loaded(x)[0], x).numpy(), expected, rtol=1e-6)
    path = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
    other = TransformerXL.from_config(model.get_config())
    tf.train.Checkpoint(model=other).restore(path).assert_existing_objects_matched()
    np.testing.assert_allclose(other.nll(other(x)[0], x).numpy(), expected, rtol=1e-6)


def test_call_with_attention():
    model = make_model(mem_len=4)
    x = tokens(2, 3)
    mems = model(tokens(2, 4, seed=2))[1]
    hidden, new_mems, probs = model.call_with_attention(x, mems)
    assert probs.shape == (NL, 2, NH, 3, 7) and probs.dtype == tf.float32
    np.testing.assert_allclose(probs.numpy().sum(-1), 1.0, atol=1e-6)
    assert np.all(np.triu(probs.numpy()[..., 4:], 1) == 0)  # no attention to future tokens
    ref_hidden, ref_mems = model(x, mems)
    np.testing.assert_allclose(hidden.numpy(), ref_hidden.numpy(), atol=1e-6)
    np.testing.assert_allclose(new_mems.hidden.numpy(), ref_mems.hidden.numpy())


def test_mixed_precision_and_xla():
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        model = make_model(cutoffs=(7,), div_val=2)
    finally:
        keras.config.set_dtype_policy("float32")
    x = tokens(2, 3)
    mems = model.initial_memory(2)
    assert mems.hidden.dtype == tf.bfloat16

    @tf.function(jit_compile=True)
    def step(x, mems):
        with tf.GradientTape() as tape:
            hidden, new_mems = model(x, mems, training=True)
            loss = tf.reduce_mean(model.nll(hidden, x))
        return loss, new_mems, tape.gradient(loss, model.trainable_weights)

    loss, new_mems, grads = step(x, mems)
    assert new_mems.hidden.dtype == tf.bfloat16 and loss.dtype == tf.float32
    assert np.isfinite(loss.numpy()) and all(g is not None for g in grads)
    assert model.log_probs(model(x, mems)[0]).dtype == tf.float32
