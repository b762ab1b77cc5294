"""Rotary position embedding (RoPE, Su et al., 2021) with recurrence: queries and keys are rotated by the angle of
their own window position (query i at M + i, key j at j, the memory's keys at their own positions), so

    score(i, j) = (Rot(M + i) q_i).(Rot(j) k_j) = q_i.Rot(M + i - j) k_j

depends on the distance only. Rotation pairs dimension t with t + D/2 (the half-split layout), frequency
theta_t = 10000^(-2t / D). No position weights; the keys/values cache keeps unrotated keys, rotated with the window
at every call. The rotation table [2, K, D/2] (cos, sin) is computed once per call for all layers.

With `clamp_len` c > 0, a distance above c is scored as c, as xl's clamp_len shares the encoding of c among all
longer distances: score(i, j) = q_i.Rot(-min(M + i - j, c)) k_j. Beyond c that is (Rot(c) q_i).k_j, the query
turned by c against the unrotated key (Su's rectified RoPE, "ReRoPE", 2023): clamped at its training span, a
model that reads further back meets no rotation it did not train with.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from txl_tf.model import tensor_ops as T
from txl_tf.model.encodings.base import Encoding, Prepared, window_distances

BASE = 10000.0


def rotation_table(klen, d_head, dtype=T.float32):
    """[2, K, D/2]: cos and sin of position p * theta_t for the window positions p = 0 .. K-1."""
    inv_freq = 1.0 / (BASE ** (T.arange(0, d_head, 2, dtype=T.float32) / d_head))  # [D/2]
    angles = T.cast(T.arange(klen), T.float32)[:, None] * inv_freq[None, :]  # [K, D/2]
    return T.cast(T.stack([T.cos(angles), T.sin(angles)]), dtype)


def rotate_half(x, cos, sin):
    """Rotates [..., T, D] by the angles of `cos`, `sin` [T, D/2] (dimension t with t + D/2)."""
    first, second = T.split(x, 2, axis=-1)  # [..., T, D/2] each
    return T.concat([first * cos - second * sin, first * sin + second * cos], axis=-1)


class Rotations(NamedTuple):
    """What every layer's attention reads of RoPE in one call (`Prepared.encoding`)."""

    table: Any  # [2, K, D/2]: cos and sin at the window positions 0 .. K-1
    beyond: Any = None  # [L, K] bool: query i's distance to key j is above clamp_len (None: no clamp)
    at_clamp: Any = None  # [2, 1, D/2]: cos and sin of clamp_len * theta_t


class RoPE(Encoding):
    name = "rope"
    citation = "Su et al. (2021)"
    clamps = True
    clamp = "distances above clamp_len are scored as clamp_len (the query turned by clamp_len, the key not)"

    def problem(self, *, d_model: int, d_head: int) -> str | None:
        return f"rope rotates pairs of dimensions: d_head must be even, got {d_head}" if d_head % 2 else None

    def build_attention(self, layer) -> None:
        problem = self.problem(d_model=layer.d_model, d_head=layer.d_head)
        if problem:
            raise ValueError(problem)

    def prepare(self, model, mlen, qlen, protocol, training, cached, kernels=False) -> Prepared:
        table = rotation_table(mlen + qlen, model.d_head, model.compute_dtype)
        if protocol.clamp_len <= 0:
            return Prepared(encoding=Rotations(table))
        at_clamp = rotation_table(protocol.clamp_len + 1, model.d_head, model.compute_dtype)[:, protocol.clamp_len:]
        beyond = window_distances(mlen, qlen) > float(protocol.clamp_len)  # [L, K]
        return Prepared(encoding=Rotations(table, beyond, at_clamp))

    def rotate(self, q, k, position_encoding):
        klen, qlen = T.shape(k)[2], T.shape(q)[2]
        table = position_encoding.table
        cos, sin = T.cast(table[0], q.dtype), T.cast(table[1], q.dtype)  # [K, D/2]
        return rotate_half(q, cos[klen - qlen:], sin[klen - qlen:]), rotate_half(k, cos, sin)

    def clamp_scores(self, score, q, k, position_encoding):
        if position_encoding.beyond is None:
            return score
        at = position_encoding.at_clamp
        cos, sin = T.cast(at[0], q.dtype), T.cast(at[1], q.dtype)  # [1, D/2]
        at_clamp = T.matmul(rotate_half(q, cos, sin), k, transpose_b=True)  # [N, B, L, K]: distance clamp_len
        return T.where(position_encoding.beyond, at_clamp, score)
