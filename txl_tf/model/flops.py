"""Model FLOPs of Transformer-XL and the matmul peak of this machine, for model FLOPs utilisation (MFU).

Only matrix products are counted, 2 FLOPs per multiply-add, as `txl_tf.TransformerXL` executes them (the
masked half of the L x K score matrices and every bin of the adaptive embedding/softmax are computed densely).
Notation: B batch, L tgt_len, M mem_len, K = M + L, d = d_model, H = n_head * d_head, F = d_inner,
V = n_token, E_i = width of adaptive bin i, V_i its size, C = number of tail clusters.

Forward pass of one segment:
  per layer:  q projection             2 * B * L * d * H
              k, v projections         2 * B * K * d * 2H   (memory keys/values are re-projected every segment)
              scores (a)+(c)           2 * B * L * K * H
              the position encoding's  `Encoding.flops` (txl_tf.model.encodings), for xl:
                position keys W_R R    2 * K * d * H        (once per segment, shared by the batch)
                scores (b)+(d)         2 * B * L * (K + 1) * H  (R gets a zero row: rel_shift's pad column)
              (shaw: (b) only; vaswani, al_rfou, rope and alibi: none, their positions are additions,
              rotations or a bias)
              probabilities x values   2 * B * L * K * H
              output projection        2 * B * L * H * d
              feed-forward             2 * 2 * B * L * d * F
  embedding:  projections              2 * B * L * E_i * d   for every projected bin (one table if div_val = 1)
  softmax:    head                     2 * B * L * (d * E_0 if projected) + 2 * B * L * E_0 * (V_0 + C)
              tails                    2 * B * L * (d * E_i + E_i * V_i)
Training = 3 x forward (the backward pass costs twice the forward). These are model FLOPs, as MFU usually counts
them: a training step skips two input gradients nothing uses, that of the constant R in W_R R (2 * K * d * H per
layer) and that of the memory's rows in the k, v projections (2 * B * M * d * 2H per layer, about 3% of the enwik8
base step: `RelativeMultiHeadAttention`'s `_dense_after_memory`), and the count keeps both.

MFU = achieved model FLOP/s / the best FLOP/s of a square matmul measured here in the run's precision
(`measure_matmul_peak`): a fair ceiling for this machine, not a vendor number.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Optional


def _adaptive_bins(n_token: int, d_model: int, d_embed: Optional[int], cutoffs: Sequence[int], div_val: int,
                   proj_same_dim: bool) -> list:
    """(rows V_i, width E_i, projected?) per bin, as the model builds them."""
    d_embed = d_model if d_embed is None else d_embed
    edges = [0, *cutoffs, n_token]
    bins = []
    for i in range(len(edges) - 1):
        rows = edges[i + 1] - edges[i]
        if div_val == 1:
            width, projected = d_embed, d_embed != d_model
        else:
            width = d_embed // div_val**i
            projected = width != d_model or proj_same_dim
        bins.append((rows, width, projected))
    return bins


def forward_flops_per_segment(*, n_layer: int, d_model: int, n_head: int, d_head: int, d_inner: int,
                              n_token: int, tgt_len: int, mem_len: int, batch_size: int = 1,
                              d_embed: Optional[int] = None, cutoffs: Sequence[int] = (), div_val: int = 1,
                              proj_same_dim: bool = True, attn_type: str = "xl", **_unused) -> int:
    """Matmul FLOPs of one forward pass over a [batch_size, tgt_len] segment with `mem_len` memory."""
    from txl_tf.model import encodings

    b, q, k = batch_size, tgt_len, mem_len + tgt_len
    width = n_head * d_head
    per_layer = (
        2 * b * q * d_model * width  # q
        + 2 * b * k * d_model * 2 * width  # k, v of memory + segment
        + 2 * b * q * k * width  # AC
        + encodings.get(attn_type).flops(batch=b, qlen=q, klen=k, d_model=d_model, width=width)  # xl: W_R R, BD
        + 2 * b * q * k * width  # probs @ v
        + 2 * b * q * width * d_model  # output projection
        + 2 * 2 * b * q * d_model * d_inner  # feed-forward
    )
    bins = _adaptive_bins(n_token, d_model, d_embed, cutoffs, div_val, proj_same_dim)
    embedded = bins[:1] if div_val == 1 else bins  # div_val == 1: one table, at most one projection
    embedding = sum(2 * b * q * width_i * d_model for _, width_i, projected in embedded if projected)
    softmax = 0
    if div_val == 1:  # one table sliced by bin: the head and the tails share d_embed (and one projection)
        rows0, width0, projected = bins[0][0], bins[0][1], bins[0][2]
        heads = [rows0 + len(cutoffs)] + [rows for rows, _, _ in bins[1:]]
        softmax += sum(2 * b * q * width0 * rows for rows in heads)
        softmax += len(bins) * 2 * b * q * d_model * width0 if projected else 0
    else:
        for i, (rows, width_i, projected) in enumerate(bins):
            rows = rows + len(cutoffs) if i == 0 else rows
            softmax += 2 * b * q * width_i * rows + (2 * b * q * d_model * width_i if projected else 0)
    return n_layer * per_layer + embedding + softmax


def model_flops_per_token(*, training: bool = True, **arch) -> float:
    """Matmul FLOPs per predicted token (training: 3 x forward). Arguments as `forward_flops_per_segment`."""
    forward = forward_flops_per_segment(**arch)
    tokens = arch.get("batch_size", 1) * arch["tgt_len"]
    return (3 if training else 1) * forward / tokens


def config_flops_per_token(model_config, n_token: int, *, tgt_len: int, batch_size: int,
                           mem_len: Optional[int] = None, training: bool = True) -> float:
    """`model_flops_per_token` for a `ModelConfig` (its mem_len unless given)."""
    return model_flops_per_token(
        training=training, n_layer=model_config.n_layer, d_model=model_config.d_model,
        n_head=model_config.n_head, d_head=model_config.d_head, d_inner=model_config.d_inner, n_token=n_token,
        tgt_len=tgt_len, mem_len=model_config.mem_len if mem_len is None else mem_len, batch_size=batch_size,
        d_embed=model_config.d_embed, cutoffs=tuple(model_config.cutoffs), div_val=model_config.div_val,
        proj_same_dim=model_config.proj_same_dim, attn_type=model_config.attn_type,
    )


def measure_matmul_peak(dtype="float32", size: int = 2048, repeats: int = 10, jit_compile: bool = False,
                        device: Optional[str] = None) -> float:
    """Best FLOP/s of a [size, size] x [size, size] matmul in a `tf.function` (2 * size**3 FLOPs per product).

    Two products per call (the second consumes the first) keep the call overhead small relative to the work.
    """
    import tensorflow as tf  # (the FLOP counts above need no TensorFlow: they serve every backend)

    dtype = tf.as_dtype(dtype)
    with tf.device(device) if device else contextlib.nullcontext():
        a = tf.cast(tf.random.stateless_normal([size, size], seed=[1, 2]) / size**0.5, dtype)

        @tf.function(jit_compile=jit_compile)
        def product(x):
            y = tf.matmul(x, x)
            return tf.reduce_sum(tf.cast(tf.matmul(y, x)[:1, :1], tf.float32))

        product(a).numpy()  # trace and warm up
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            product(a).numpy()
            best = min(best, time.perf_counter() - start)
    return 2 * 2 * size**3 / best


def utilisation_line(tokens_per_second: float, flops_per_token: float, peak: float, precision: str) -> str:
    """One line: tokens/s, achieved GFLOP/s and MFU against `peak` (FLOP/s)."""
    achieved = tokens_per_second * flops_per_token
    return (f"throughput {tokens_per_second:,.0f} tokens/s x {flops_per_token / 1e6:.1f} MFLOP/token = "
            f"{achieved / 1e9:.1f} GFLOP/s; MFU {achieved / peak:.1%} of the measured {precision} matmul peak "
            f"({peak / 1e9:.0f} GFLOP/s)")
