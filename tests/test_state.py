"""txl_tf.model.state: row selection, the per-layer split and stack, validation in one line, and the state as a nest
(tf.nest, tf.function, tf.while_loop, the SavedModel's named tensors), on the states a real model makes."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from txl_tf import TransformerXL
from txl_tf.model.attention import RelativeMultiHeadAttention
from txl_tf.model.protocol import Protocol
from txl_tf.model.state import Cache, LayerCache, LayerMemory, Memory, check_type, from_named

V, NL, DM, NH, DH, B, M = 19, 3, 8, 2, 3, 4, 5


def make_model(attn_type="xl"):
    keras.utils.set_random_seed(3)
    return TransformerXL(n_token=V, n_layer=NL, d_model=DM, n_head=NH, d_head=DH, d_inner=11, dropout=0.0,
                         dropatt=0.0, mem_len=M, attn_type=attn_type, max_position=16)


def tokens(b, t, seed=0):
    return tf.constant(np.random.default_rng(seed).integers(0, V, size=(b, t)), tf.int32)


def filled(model, state, seed=1):
    """A state after a real call (not zeros), so rows and layers differ."""
    return model(tokens(B, 3, seed), state, protocol=Protocol(M))[1]


def states(model):
    return {"memory": filled(model, model.initial_memory(B)),
            "cache": filled(model, model.initial_cache(B, Protocol(M), max_len=3))}


def test_layout_of_the_two_forms():
    model = make_model()
    memory, cache = states(model).values()
    assert memory.hidden.shape == (NL, B, M, DM) and memory.batch_size == B and memory.mem_len == M
    assert cache.keys.shape == cache.values.shape == (NL, NH, B, M, DH)
    assert cache.position_keys.shape == (NL, NH, M + 3, DH)
    assert cache.batch_size == B and cache.mem_len == M
    assert Memory.BATCH_AXIS == 1 and Cache.BATCH_AXIS == 2 and LayerMemory.BATCH_AXIS == 0
    assert LayerCache.BATCH_AXIS == 1


@pytest.mark.parametrize("form", ["memory", "cache"])
def test_select_rows_is_the_state_of_those_rows(form):
    """The selected rows continue as those rows would in the whole batch."""
    model = make_model()
    state = states(model)[form]
    x = tokens(B, 3, seed=2)
    whole, _ = model(x, state, protocol=Protocol(M))
    rows, new = model(x[1:3], state.select_rows(1, 3), protocol=Protocol(M))
    assert type(new) is type(state) and new.batch_size == 2
    np.testing.assert_allclose(rows.numpy(), whole[1:3].numpy(), atol=1e-6)
    if form == "cache":  # the position keys have no batch axis: kept whole
        assert state.select_rows(1, 3).position_keys is state.position_keys


@pytest.mark.parametrize("attn_type", ["xl", "vaswani"])
@pytest.mark.parametrize("form", ["memory", "cache"])
def test_layers_round_trip(form, attn_type):
    state = states(make_model(attn_type))[form]
    layers = state.layers()
    assert len(layers) == NL and all(type(layer) is (LayerMemory if form == "memory" else LayerCache)
                                     for layer in layers)
    assert layers[1].batch_size == B and layers[1].mem_len == M
    back = type(state).from_layers(layers)
    assert type(back) is type(state)
    tf.nest.map_structure(lambda a, b: np.testing.assert_array_equal(a.numpy(), b.numpy()), back, state)
    if form == "cache":
        assert (attn_type == "vaswani") == isinstance(back.position_keys, tuple)  # absolute: no position keys
        updated = state.updated(layers)
        assert updated.position_keys is state.position_keys  # a call never changes them: not stacked again


def test_where_rows_takes_each_row_from_one_state():
    model = make_model()
    for state in states(model).values():
        other = filled(model, state, seed=5)
        mixed = state.where_rows(tf.constant([True, False, False, True]), other)
        for row, source in enumerate([state, other, other, state]):
            tf.nest.map_structure(lambda a, b: np.testing.assert_array_equal(a.numpy(), b.numpy()),
                                  mixed.select_rows(row, row + 1), source.select_rows(row, row + 1))


def test_states_are_nests():
    """tf.nest, tf.function (argument, result and signature) and tf.while_loop take a state as a tuple of tensors
    and give back its type; a cache without position keys is two tensors (() is an empty nest)."""
    model = make_model("vaswani")
    memory, cache = states(model).values()
    assert len(tf.nest.flatten(cache)) == 2 and cache.position_keys == ()
    assert len(tf.nest.flatten(states(make_model())["cache"])) == 3
    rebuilt = tf.nest.pack_sequence_as(memory, tf.nest.flatten(memory))
    assert type(rebuilt) is Memory

    @tf.function
    def twice(state):
        for _ in tf.range(2):  # a tf.while_loop with the state as a loop variable
            state = tf.nest.map_structure(lambda t: t * 2.0, state)
        return state

    for state in (memory, cache):
        out = twice(state)
        assert type(out) is type(state)
        tf.nest.map_structure(lambda a, b: np.testing.assert_allclose(a.numpy(), 4 * b.numpy()), out, state)
    specs = tf.nest.map_structure(lambda t: tf.TensorSpec([None] * len(t.shape), t.dtype), cache)
    traced = twice.get_concrete_function(specs)
    assert type(traced.structured_outputs) is Cache


@pytest.mark.parametrize("attn_type", ["xl", "vaswani"])
def test_named_tensors_round_trip(attn_type):
    memory, cache = states(make_model(attn_type)).values()
    assert list(memory.named()) == ["mems"]
    expected = ["keys", "values", "position_keys"] if attn_type == "xl" else ["keys", "values"]
    assert list(cache.named()) == expected and list(cache.named_specs()) == expected
    for state in (memory, cache):
        back = from_named(state.named())
        assert type(back) is type(state)
        tf.nest.map_structure(lambda a, b: np.testing.assert_array_equal(a.numpy(), b.numpy()), back, state)
        for name, spec in state.named_specs().items():  # any batch size; the position keys have none
            shape = spec.shape.as_list()
            assert spec.name == name and (None in shape) == (name != "position_keys")
        assert {name: int(size) for name, size in state.named_batch_sizes().items()} == {
            name: B for name in state.named() if name != "position_keys"}
    with pytest.raises(ValueError, match="'mems', or 'keys', 'values'"):
        from_named({"hidden": memory.hidden})


def test_misfits_are_refused_in_one_line():
    model = make_model()
    memory, cache = states(model).values()
    refusals = [
        (lambda: memory.check(n_layer=NL + 1, d_model=DM), "does not fit this model"),
        (lambda: Memory(memory.hidden[0]).check(n_layer=NL, d_model=DM), "must be \\[n_layer, B, M, d_model\\]"),
        (lambda: memory.check(n_layer=NL, d_model=DM, batch=B + 1), f"holds {B} rows but the tokens have {B + 1}"),
        (lambda: cache.check(n_layer=NL, mem_len=M + 1, position_keys=True), "protocol's mem_len"),
        (lambda: cache.check(n_layer=NL - 1, mem_len=M, position_keys=True), f"cache has {NL} layers"),
        (lambda: cache.check(n_layer=NL, mem_len=M, position_keys=False), "has position_keys"),
        (lambda: cache._replace(position_keys=()).check(n_layer=NL, mem_len=M, position_keys=True),
         "lacks position_keys"),
        (lambda: cache.check(n_layer=NL, mem_len=M, position_keys=True, batch=1), f"holds {B} rows"),
    ]
    for refuse, match in refusals:
        with pytest.raises(ValueError, match=match) as error:
            refuse()
        assert "\n" not in str(error.value)
    cache.check(n_layer=NL, mem_len=M, position_keys=True, batch=B)  # fits
    with pytest.raises(TypeError, match="Memory or Cache; got dict"):
        check_type({"keys": cache.keys}, (Memory, Cache), "TransformerXL")
    layer = RelativeMultiHeadAttention(DM, NH, DH)
    with pytest.raises(TypeError, match="LayerMemory or LayerCache; got Memory"):  # a model-level state
        layer(tf.zeros([B, 2, DM]), memory)
