"""The vanilla Transformer of Al-Rfou et al. (2018): learned absolute positions [max_position, d] per layer,
added to each layer's memory and inputs (key position p gets row p; positions past the table its last row).

Trained on windows of max_position tokens, row max_position - 1 learns from the window's last prediction alone (no
later query attends to its key), and a trained model predicts worst there: the position a sliding window of
max_position tokens scores (tests/test_vanilla_baseline.py; txl_tf.study.sanity flags such a baseline). The studies
train it with max_position = window - 1, so the window's last two positions share the last row and it learns as a
key too (txl_tf.study.ablation.vanilla_params; docs/study_plan_v2.md)."""

from __future__ import annotations

import keras

from txl_tf.model import tensor_ops as T
from txl_tf.model.encodings.base import Encoding


class AlRfou(Encoding):
    name = "al_rfou"
    citation = "Al-Rfou et al. (2018)"
    absolute = True
    uses_max_position = True
    clamp = "positions from max_position - 1 on share the table's last row (clamp_len does not apply)"

    def build_block(self, block) -> None:
        block.absolute_positions = block.add_weight(
            name="absolute_positions", shape=(block.max_position, block.d_model),
            initializer=keras.initializers.RandomNormal(stddev=block.init_std))

    def weights_per_layer(self, *, d_model: int, width: int, max_position: int) -> int:
        return max_position * d_model

    def block_positions(self, block, qlen, mlen):
        positions = T.minimum(T.arange(mlen + qlen), block.max_position - 1)  # [K]
        table = T.gather(T.cast(block.absolute_positions, block.compute_dtype), positions)  # [K, d]
        return table[:mlen], table[mlen:]
