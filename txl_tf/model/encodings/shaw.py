"""Shaw et al. (2018)'s relative encoding: a learned table of one key vector per distance and head,

    (a) q_i.k_j + (b) q_i.R_hat[i - j]

with `relative_table` [max_position, N, D] per layer; distances from max_position - 1 on share the last row.
"""

from __future__ import annotations

import keras

from txl_tf.model import tensor_ops as T
from txl_tf.model.encodings.base import Encoding


class Shaw(Encoding):
    name = "shaw"
    citation = "Shaw et al. (2018)"
    position_keys_cached = True
    uses_max_position = True
    clamp = "distances from max_position - 1 on share the table's last row (clamp_len does not apply)"

    def build_attention(self, layer) -> None:
        layer.relative_table = layer.add_weight(
            name="relative_table", shape=(layer.max_position, layer.n_head, layer.d_head),
            initializer=keras.initializers.RandomNormal(stddev=layer.init_std))

    def weights_per_layer(self, *, d_model: int, width: int, max_position: int) -> int:
        return max_position * width

    def position_rows(self, layer, klen, position_encoding):
        distances = T.minimum(T.arange(klen - 1, -1, -1), layer.max_position - 1)  # [K], descending
        rows = T.gather(T.cast(layer.relative_table, layer.compute_dtype), distances)  # [K, N, D]
        return T.reshape(rows, [klen, layer.n_head * layer.d_head])  # [K, N*D]

    def flops(self, *, batch: int, qlen: int, klen: int, d_model: int, width: int) -> int:
        return 2 * batch * qlen * (klen + 1) * width  # (b) against K + 1 rows (rel_shift's zero row)
