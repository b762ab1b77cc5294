"""txl_tf: Transformer-XL (Dai et al., 2019) in TensorFlow 2 / Keras 3.

Importing the package chooses Keras's TensorFlow backend (unless KERAS_BACKEND is already set) and imports
nothing else: `txl_tf.TransformerXL` (the Keras layer stack) and the keras-hub classes `txl_tf.TransformerXLCausalLM`
(the model with its vocabulary and evaluation protocol: from_preset, generate, score, score_text, stream_text, fit,
save_to_preset), `TransformerXLBackbone`, `TransformerXLCausalLMPreprocessor` and `TransformerXLTokenizer`
(`txl_tf.lm.hub`, one class per name) load TensorFlow on first use, so an entry point can set up its environment
(txl_tf.base.cli) before TensorFlow starts.
"""

import os

from txl_tf.base.version import __version__

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

# TensorFlow's start-up lines (the absl pre-init warning, the oneDNN and CUDA-driver notices) are set aside when
# TensorFlow is first imported after txl_tf, as for the commands (txl_tf.base.cli.quiet_tensorflow; TXL_TF_TF_LOGS=1
# keeps them). Importing cli imports no TensorFlow.
from txl_tf.base import cli as _cli  # noqa: E402, F401

HUB_CLASSES = ("TransformerXLBackbone", "TransformerXLCausalLM", "TransformerXLCausalLMPreprocessor",
               "TransformerXLTokenizer")
__all__ = ["TransformerXL", *HUB_CLASSES, "__version__"]


def __getattr__(name: str):
    if name == "TransformerXL":
        from txl_tf.model.transformer_xl import TransformerXL

        return TransformerXL
    if name in HUB_CLASSES:
        from txl_tf.lm import hub

        return getattr(hub, name)
    raise AttributeError(f"module 'txl_tf' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
