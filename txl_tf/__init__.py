"""txl_tf: Transformer-XL (Dai et al., 2019) in TensorFlow 2 / Keras 3.

Importing the package chooses Keras's TensorFlow backend (unless KERAS_BACKEND is already set) and imports
nothing else: `txl_tf.TransformerXL` loads TensorFlow on first use, so an entry point can set up its
environment (txl_tf.cli) before TensorFlow starts.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

__version__ = "0.1.0"

__all__ = ["TransformerXL"]


def __getattr__(name: str):
    if name == "TransformerXL":
        from txl_tf.model import TransformerXL

        return TransformerXL
    raise AttributeError(f"module 'txl_tf' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
