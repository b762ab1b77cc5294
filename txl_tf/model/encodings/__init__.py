"""The position encodings, one module each, and the registry that names them (`ModelConfig.attn_type`).

    encoding = encodings.get("rope")   # the object the attention, block and model layers ask (see base.Encoding)

Adding an encoding: a module with an `Encoding` subclass, one line in `REGISTRY`, a gin file under `gin/study/`
and its tests (tests/test_encodings.py runs the oracle, incremental = full and gradient checks on every entry of
the registry; tests/test_model.py's cache = memory cases must cover it). The registry names each encoding's class by module and class name, so that reading
the names (the config rules do) imports neither the modules nor TensorFlow.
"""

from __future__ import annotations

import functools
import importlib

REGISTRY = {  # name (ModelConfig.attn_type) -> "module:class"
    "xl": "txl_tf.model.encodings.xl:XL",  # Dai et al. (2019): the paper's relative encoding
    "shaw": "txl_tf.model.encodings.shaw:Shaw",  # Shaw et al. (2018): a learned table per distance
    "vaswani": "txl_tf.model.encodings.vaswani:Vaswani",  # Vaswani et al. (2017): absolute sinusoids on the inputs
    "al_rfou": "txl_tf.model.encodings.al_rfou:AlRfou",  # Al-Rfou et al. (2018): learned absolute positions per layer
    "rope": "txl_tf.model.encodings.rope:RoPE",  # Su et al. (2021): rotary
    "alibi": "txl_tf.model.encodings.alibi:ALiBi",  # Press et al. (2022): a linear distance penalty per head
}
NAMES = tuple(REGISTRY)  # the choices of ModelConfig.attn_type


@functools.cache
def get(name: str):
    """The encoding called `name` (a `txl_tf.model.encodings.base.Encoding`); ValueError naming the choices otherwise."""
    if name not in REGISTRY:
        raise ValueError(f"attn_type must be one of {NAMES}, got {name!r}")
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)()
