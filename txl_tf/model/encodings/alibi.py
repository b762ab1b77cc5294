"""ALiBi (Press et al., 2022) with recurrence: no position weights; each head h adds a fixed penalty linear in
the distance to its scores,

    score(i, j) = q_i.k_j - m_h * (M + i - j),

with the paper's head slopes m_h (a geometric sequence from 2^(-8/N); for N not a power of two, the paper's
interleaving). The penalty [N, 1, L, K] is computed once per call for all layers and added with the causal mask.
"""

from __future__ import annotations

import math

from txl_tf.model import tensor_ops as T
from txl_tf.model.encodings.base import Encoding, Prepared, window_distances


def slopes(n_head: int) -> list:
    """The paper's per-head slopes m_1 .. m_N."""
    def geometric(n):
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_head).is_integer():
        return geometric(n_head)
    closest = 2 ** math.floor(math.log2(n_head))
    return geometric(closest) + slopes(2 * closest)[0::2][: n_head - closest]


class ALiBi(Encoding):
    name = "alibi"
    citation = "Press et al. (2022)"
    clamps = True
    clamp = "distances above clamp_len get the penalty of clamp_len"

    def prepare(self, model, mlen, qlen, protocol, training, cached, kernels=False) -> Prepared:
        distances = T.maximum(window_distances(mlen, qlen, protocol.clamp_len), 0.0)  # [L, K]; the mask blocks j > M + i
        m = T.constant(slopes(model.n_head), T.float32)[:, None, None, None]  # [N, 1, 1, 1]
        return Prepared(score_bias=-m * distances[None, None])  # [N, 1, L, K] float32
