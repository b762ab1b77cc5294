"""txl_tf: Transformer-XL (Dai et al., 2019) in TensorFlow 2 / Keras 3."""

__version__ = "0.1.0"

from txl_tf.model import TransformerXL  # noqa: E402

__all__ = ["TransformerXL"]
