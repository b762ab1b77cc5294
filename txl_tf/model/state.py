"""The recurrent state of Transformer-XL: the one place that owns its layout.

Shape glossary:
  n layers (n_layer), B batch (rows), M memory length, d = d_model, N heads, D head width,
  P = M + max_len distances covered by a cache's position keys.

The state comes in two forms, each at two levels: the model's (stacked over the layers, what
`TransformerXL.call` takes and returns) and one layer's (what `TransformerXLBlock` and
`RelativeMultiHeadAttention` take and return).

  form     model level                        layer level                         fields
  memory   Memory(hidden)                     LayerMemory(hidden)                 hidden [n, B, M, d] / [B, M, d]
  cache    Cache(keys, values, position_keys) LayerCache(keys, values, position_keys)
                                                 keys, values [n, N, B, M, D] / [N, B, M, D]
                                                 position_keys [n, N, P, D] / [N, P, D], or ()

  memory (training; the authors' semantics): for each layer, the hidden states that entered it in earlier
    segments. Every call projects the whole memory to keys and values again.
  cache (inference): each layer's keys and values of the memory, plus its position keys for every distance
    (W_R R for xl, the learned table for shaw) computed once. Every call projects only its own tokens. The
    absolute-position types (vaswani, al_rfou) have no position keys: `position_keys` is then `()`, an empty nest
    (a None would stop tf.while_loop, which takes no None loop variable).

The layer level has its own types rather than reusing the model's: the batch and time axes sit one axis further
left there, and a value of either level then answers `batch_size`, `mem_len` and `select_rows` by itself; a layer
also refuses a model-level state by its type. `layers()` splits a model-level state into its layers' states and
`from_layers` stacks them back (`updated` keeps a cache's position keys as they were: a call never changes them).

All four are NamedTuples, hence nests: tf.nest, tf.function signatures, tf.while_loop loop variables and the
argument conversion of a Keras call take them like a tuple of tensors and give back the same type.

The exported SavedModel passes the state as named tensors (`named()`, `from_named`): the cache as "keys",
"values" and (xl, shaw) "position_keys", the memory as "mems".
"""

from __future__ import annotations

from typing import Any, NamedTuple

from txl_tf.model import tensor_ops as T


def _has_position_keys(state) -> bool:
    return not isinstance(state.position_keys, tuple)


def _check_rank(name: str, tensor, rank: int, layout: str) -> None:
    if len(tensor.shape) != rank:
        raise ValueError(f"the state's {name} must be {layout}; got shape {tensor.shape}")


def _check_batch(name: str, size, batch) -> None:
    if size is not None and batch is not None and size != batch:
        raise ValueError(f"the state's {name} holds {size} rows but the tokens have {batch}; pass the state of "
                         f"the same rows (initial state of batch {batch}, or select_rows)")


# Every state's first field (`hidden`, or `keys`) carries its batch and time axes.
_batch_size = property(lambda self: T.dim(self[0], self.BATCH_AXIS),
                       doc="B: a Python int when the shape knows it, else a scalar tensor.")
_mem_len = property(lambda self: T.dim(self[0], self.TIME_AXIS),
                    doc="M: a Python int when the shape knows it, else a scalar tensor.")


class LayerMemory(NamedTuple):
    """One layer's hidden-state memory: `hidden` [B, M, d], the states that entered the layer before."""

    hidden: Any

    BATCH_AXIS = 0
    TIME_AXIS = 1

    batch_size = _batch_size
    mem_len = _mem_len

    def select_rows(self, start, stop) -> LayerMemory:
        return LayerMemory(self.hidden[start:stop])


class LayerCache(NamedTuple):
    """One layer's keys/values cache: `keys`, `values` [N, B, M, D], `position_keys` [N, P, D] in descending
    distance (P-1 .. 0), or () for the absolute-position types."""

    keys: Any
    values: Any
    position_keys: Any = ()

    BATCH_AXIS = 1
    TIME_AXIS = 2

    batch_size = _batch_size
    mem_len = _mem_len

    def select_rows(self, start, stop) -> LayerCache:
        return self._replace(keys=self.keys[:, start:stop], values=self.values[:, start:stop])


class Memory(NamedTuple):
    """The model's hidden-state memory: `hidden` [n, B, M, d], per layer the states that entered it before.

    A call returns per layer the last `mem_len` positions of concat([hidden[i], input of layer i]), gradient
    stopped (layer 0's input is the embedding after dropout).
    """

    hidden: Any

    BATCH_AXIS = 1
    TIME_AXIS = 2

    batch_size = _batch_size
    mem_len = _mem_len

    def select_rows(self, start, stop) -> Memory:
        """Rows start .. stop-1 of the batch."""
        return Memory(self.hidden[:, start:stop])

    def where_rows(self, mask, other: Memory) -> Memory:
        """Row b from this state where mask[b] (a [B] bool), else from `other`."""
        return Memory(T.where(T.reshape(mask, [1, -1, 1, 1]), self.hidden, other.hidden))

    def layers(self, num: int | None = None) -> list[LayerMemory]:
        """Each layer's memory, bottom first (`num`: n when the shape does not know it)."""
        return [LayerMemory(hidden) for hidden in T.unstack(self.hidden, num=num)]

    @classmethod
    def from_layers(cls, layers) -> Memory:
        return cls(T.stack([layer.hidden for layer in layers]))

    def updated(self, layers) -> Memory:
        """The state after a call, from the layers' new states."""
        return Memory.from_layers(layers)

    def cast(self, dtype) -> Memory:
        return Memory(T.cast(self.hidden, dtype))

    def check(self, *, n_layer: int, d_model: int, batch=None) -> None:
        """Raises a one-line ValueError if this memory does not fit the model (or `batch` rows)."""
        _check_rank("memory", self.hidden, 4, f"[n_layer, B, M, d_model] = [{n_layer}, B, M, {d_model}]")
        n, b, _, d = self.hidden.shape
        if (n is not None and n != n_layer) or (d is not None and d != d_model):
            raise ValueError(f"memory shape {self.hidden.shape} does not fit this model: expected "
                             f"[{n_layer}, B, M, {d_model}]; make it with model.initial_memory")
        _check_batch("memory", b, batch)

    def named(self) -> dict:
        """{"mems": hidden}: the tensors under their SavedModel signature names."""
        return {"mems": self.hidden}

    def named_batch_sizes(self) -> dict:
        """{signature name: its batch size} of the tensors that have a batch axis."""
        return {"mems": T.shape(self.hidden)[self.BATCH_AXIS]}

    def named_specs(self) -> dict:
        """{signature name: tf.TensorSpec} of this state's tensors, with any batch size."""
        return {"mems": _spec(self.hidden, self.BATCH_AXIS, "mems")}


class Cache(NamedTuple):
    """The model's keys/values cache: `keys`, `values` [n, N, B, M, D] of the memory's positions and, for xl and
    shaw, `position_keys` [n, N, P, D] (each layer's keys of distances P-1 .. 0, clamp_len applied), else ().

    A call projects only its own tokens and keeps the last M keys/values of each row; the position keys do not
    change. Made by `TransformerXL.initial_cache`, for calls of up to P - M tokens.
    """

    keys: Any
    values: Any
    position_keys: Any = ()

    BATCH_AXIS = 2
    TIME_AXIS = 3

    batch_size = _batch_size
    mem_len = _mem_len

    def select_rows(self, start, stop) -> Cache:
        """Rows start .. stop-1 of the batch (the position keys have no batch axis)."""
        return self._replace(keys=self.keys[:, :, start:stop], values=self.values[:, :, start:stop])

    def where_rows(self, mask, other: Cache) -> Cache:
        """Row b from this state where mask[b] (a [B] bool), else from `other` (whose position keys are kept)."""
        mask = T.reshape(mask, [1, 1, -1, 1, 1])
        return other._replace(keys=T.where(mask, self.keys, other.keys),
                              values=T.where(mask, self.values, other.values))

    def layers(self, num: int | None = None) -> list[LayerCache]:
        """Each layer's cache, bottom first (`num`: n when the shape does not know it)."""
        keys, values = T.unstack(self.keys, num=num), T.unstack(self.values, num=num)
        position_keys = (T.unstack(self.position_keys, num=len(keys)) if _has_position_keys(self)
                         else [()] * len(keys))
        return [LayerCache(*parts) for parts in zip(keys, values, position_keys, strict=True)]

    @classmethod
    def from_layers(cls, layers) -> Cache:
        layers = list(layers)
        position_keys = T.stack([layer.position_keys for layer in layers]) if _has_position_keys(layers[0]) else ()
        return cls(T.stack([layer.keys for layer in layers]), T.stack([layer.values for layer in layers]),
                   position_keys)

    def updated(self, layers) -> Cache:
        """The state after a call, from the layers' new states: their keys and values; these position keys."""
        layers = list(layers)
        return self._replace(keys=T.stack([layer.keys for layer in layers]),
                             values=T.stack([layer.values for layer in layers]))

    def cast(self, dtype) -> Cache:
        return T.map_structure(lambda tensor: T.cast(tensor, dtype), self)

    def check(self, *, n_layer: int, mem_len: int, position_keys: bool, batch=None) -> None:
        """Raises a one-line ValueError if this cache does not fit the model, the protocol's `mem_len`, the
        attention type (`position_keys`: xl and shaw need them) or `batch` rows."""
        _check_rank("keys", self.keys, 5, f"[n_layer, N, B, M, D] with n_layer = {n_layer}")
        if self.keys.shape[0] is not None and self.keys.shape[0] != n_layer:
            raise ValueError(f"the cache has {self.keys.shape[0]} layers but the model {n_layer}; make it with "
                             "this model's initial_cache")
        held = self.keys.shape[self.TIME_AXIS]
        if held is not None and held != mem_len:
            raise ValueError(f"the cache holds {held} positions but the protocol's mem_len is {mem_len}; make "
                             "the cache with the same protocol")
        if position_keys != _has_position_keys(self):
            raise ValueError(f"the cache {'lacks' if position_keys else 'has'} position_keys, which this attention "
                             f"type {'needs' if position_keys else 'does not use'}; make it with this model's "
                             "initial_cache")
        _check_batch("cache", self.keys.shape[self.BATCH_AXIS], batch)

    def named(self) -> dict:
        """{"keys", "values"[, "position_keys"]}: the tensors under their SavedModel signature names."""
        return {field: tensor for field, tensor in zip(self._fields, self, strict=True)
                if not isinstance(tensor, tuple)}

    def named_batch_sizes(self) -> dict:
        """{signature name: its batch size} of the tensors that have a batch axis (not the position keys)."""
        return {name: T.shape(getattr(self, name))[self.BATCH_AXIS] for name in ("keys", "values")}

    def named_specs(self) -> dict:
        """{signature name: tf.TensorSpec} of this state's tensors, with any batch size."""
        specs = {name: _spec(getattr(self, name), self.BATCH_AXIS, name) for name in ("keys", "values")}
        if _has_position_keys(self):
            specs["position_keys"] = _spec(self.position_keys, None, "position_keys")
        return specs


State = Memory | Cache
LayerState = LayerMemory | LayerCache


def _spec(tensor, batch_axis: int | None, name: str):
    """The tf.TensorSpec of a SavedModel signature's input (export: TensorFlow only)."""
    import tensorflow as tf

    shape = tensor.shape.as_list()
    if batch_axis is not None:
        shape[batch_axis] = None
    return tf.TensorSpec(shape, tensor.dtype, name=name)


def from_named(named) -> State:
    """The state of named tensors (`named()`, a SavedModel signature's inputs or outputs)."""
    if "mems" in named:
        return Memory(named["mems"])
    if "keys" not in named or "values" not in named:
        raise ValueError(f"named state tensors must be 'mems', or 'keys', 'values'[, 'position_keys']; got "
                         f"{sorted(named)}")
    return Cache(named["keys"], named["values"], named.get("position_keys", ()))


def check_type(state, kinds: tuple, where: str) -> None:
    """Raises a one-line TypeError unless `state` is None or one of `kinds` (state types)."""
    if state is None or isinstance(state, kinds):
        return
    names = " or ".join(kind.__name__ for kind in kinds)
    hint = " (wrap a hidden-state tensor as txl_tf.model.state.Memory(tensor))" if Memory in kinds else ""
    raise TypeError(f"{where} takes the state as None or a txl_tf.model.state {names}; got "
                    f"{type(state).__name__}{hint}")
