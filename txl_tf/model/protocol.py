"""The attention protocol: how far back a call of the model looks, as one immutable value.

A `TransformerXL` is built with the lengths it trains with (`mem_len`, `clamp_len`, `same_length`); its
`protocol` property returns them as a `Protocol`. Evaluation, generation, attention maps and export take a
`Protocol` of their own (usually from `EvalConfig`) and hand it to every call of the model: nothing is set on the
model for a while, so a traced function, a SavedModel or a second thread never sees lengths that were meant for
another caller.

The evaluation's other choices (`EvalConfig.protocol`, `layout`, `compute_dtype`) are named here too, TensorFlow-free,
so that txl_tf.configs checks a binding against the lists txl_tf.evaluation.loops and txl_tf.evaluate act on.
"""

from __future__ import annotations

import dataclasses
import numbers

PROTOCOLS = ("xl", "vanilla")  # EvalConfig.protocol: segments + memory, or the vanilla model's sliding window
LAYOUTS = ("corpus", "original")  # EvalConfig.layout: every token scored once, or the authors' batching
COMPUTE_DTYPES = ("float32", "mixed_bfloat16")  # EvalConfig.compute_dtype: the Keras dtype policy of the layers


@dataclasses.dataclass(frozen=True)
class Protocol:
    """Attention lengths of one use of a model.

    Attributes:
      mem_len: positions of memory (hidden states or cached keys/values) kept per layer; 0 turns recurrence off.
      clamp_len: relative distances above it share one encoding (xl); <= 0 keeps every distance apart.
      same_length: every query attends the same number of keys (the model's `same_length_keys` says how many).
    """

    mem_len: int
    clamp_len: int = -1
    same_length: bool = False

    def __post_init__(self):
        for name in ("mem_len", "clamp_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(f"Protocol.{name} must be an int; got {value!r}")
            object.__setattr__(self, name, int(value))  # NumPy integers become plain ints (hashable, printable)
        if self.mem_len < 0:
            raise ValueError(f"Protocol.mem_len must be >= 0; got {self.mem_len}")
        if not isinstance(self.same_length, (bool, numbers.Integral)) or self.same_length not in (0, 1):
            raise ValueError(f"Protocol.same_length must be True or False; got {self.same_length!r}")
        object.__setattr__(self, "same_length", bool(self.same_length))

    def replace(self, **changes) -> Protocol:
        """A copy with some fields changed (the value itself never changes)."""
        return dataclasses.replace(self, **changes)

    def for_generation(self) -> Protocol:
        """The protocol of generation and of keras-hub's `score`: these lengths, every token seeing the whole memory
        (no same_length). The one place that derives it (`EvalConfig.generation_protocol`, `txl_tf.lm.generation`,
        the keras-hub classes)."""
        return self.replace(same_length=False)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
