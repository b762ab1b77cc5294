"""How a training call runs, never what it computes: the training policy, a value handed to the model's calls.

    policy = TrainingPolicy(kernels=True, recompute=True)
    hidden, memory = model(tokens, memory, training=True, policy=policy)

The architecture (`TransformerXL(...)`, its `get_config`, a preset's config.json) holds only what defines the
function the model computes. Whether a training call runs the fused CPU kernels (`TrainConfig.kernels`,
`txl_tf.model.fused`) or recomputes each block's activations in the backward pass (`TrainConfig.recompute`,
`tf.recompute_grad`) is chosen by the trainer and passed with every call, like the attention `Protocol`; the
precision is Keras's dtype policy of the layers (`TrainConfig.mixed_precision`). A run records all three in its
config.gin (`txl_tf.train`). Inference calls ignore the policy: they always run TensorFlow's ops.
"""

from __future__ import annotations

import dataclasses

# The choices of the training policy's TrainConfig fields, kept here (TensorFlow-free) for txl_tf.configs' rules.
KERNELS = ("tf", "fused")  # TrainConfig.kernels besides AUTO: TensorFlow's ops or txl_tf.model.fused's kernels
RECOMPUTE = ("none", "block")  # TrainConfig.recompute
NONFINITE_MODES = ("stop", "skip")  # TrainConfig.nonfinite: end the host loop at a non-finite step, or skip it
AUTO = "auto"  # TrainConfig.mixed_precision, jit_compile or kernels measured on this machine (txl_tf.training.autotune)


@dataclasses.dataclass(frozen=True)
class TrainingPolicy:
    """Attributes:
      kernels: training calls of float32 or bfloat16 use the fused CPU kernels in every layer's attention,
        feed-forward and dropout (`txl_tf.model.fused.applies`); their dropout masks come from another Philox stream.
      recompute: training calls in a `tf.function` keep for the backward pass only each block's inputs and
        recompute its activations there (`TransformerXLBlock`): outputs, memory and gradients are unchanged.
    """

    kernels: bool = False
    recompute: bool = False

    @classmethod
    def of(cls, kernels: str = "tf", recompute: str = "none") -> TrainingPolicy:
        """The policy of `TrainConfig.kernels` ("tf" or "fused", resolved) and `TrainConfig.recompute`."""
        if recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
        return cls(kernels=kernels == "fused", recompute=recompute == "block")


DEFAULT = TrainingPolicy()
