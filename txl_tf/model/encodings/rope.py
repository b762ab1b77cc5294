"""Rotary position embedding (RoPE, Su et al., 2021) with recurrence: queries and keys are rotated by the angle of
their own window position (query i at M + i, key j at j, the memory's keys at their own positions), so

    score(i, j) = (Rot(M + i) q_i).(Rot(j) k_j) = q_i.Rot(M + i - j) k_j

depends on the distance only. Rotation pairs dimension t with t + D/2 (the half-split layout), frequency
theta_t = 10000^(-2t / D). No position weights; the keys/values cache keeps unrotated keys, rotated with the window
at every call. The rotation table [2, K, D/2] (cos, sin) is computed once per call for all layers.
"""

from __future__ import annotations

from txl_tf.model import tensor_ops as T
from txl_tf.model.encodings.base import Encoding, Prepared

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


class RoPE(Encoding):
    name = "rope"
    citation = "Su et al. (2021)"
    clamp = "none: a rotation is exact at every distance (clamp_len does not apply)"

    def problem(self, *, d_model: int, d_head: int) -> str | None:
        return f"rope rotates pairs of dimensions: d_head must be even, got {d_head}" if d_head % 2 else None

    def build_attention(self, layer) -> None:
        problem = self.problem(d_model=layer.d_model, d_head=layer.d_head)
        if problem:
            raise ValueError(problem)

    def prepare(self, model, mlen, qlen, protocol, training, cached, kernels=False) -> Prepared:
        return Prepared(encoding=rotation_table(mlen + qlen, model.d_head, model.compute_dtype))

    def rotate(self, q, k, position_encoding):
        klen, qlen = T.shape(k)[2], T.shape(q)[2]
        cos, sin = T.cast(position_encoding[0], q.dtype), T.cast(position_encoding[1], q.dtype)  # [K, D/2]
        return rotate_half(q, cos[klen - qlen:], sin[klen - qlen:]), rotate_half(k, cos, sin)
