"""Token and position embeddings of Transformer-XL.

Shapes: B batch, L query (segment) length, M memory length, K = M + L key length,
V vocabulary size, E embedding width of a bin, d = d_model.

- `sinusoid_encoding` / `RelativePositionalEncoding`: the sinusoid matrix R of section 3.3, one row per key,
  ordered by DESCENDING distance K-1 .. 0 (Appendix B's Q matrix order), `[sin | cos]` halves concatenated.
- `AdaptiveEmbedding`: the adaptive input representation (Baevski & Auli) with the authors' conventions: bins
  split at `cutoffs`, bin i has width `d_embed // div_val**i` and a projection to `d_model`; the result is
  scaled by sqrt(d_model).
"""

from __future__ import annotations

import math

import keras

from txl_tf.model import tensor_ops as T


def sinusoid_encoding(positions, d_model, dtype=T.float32):
    """Sinusoid encodings of `positions` [P] (float): [P, d_model] = [sin(p * f) | cos(p * f)].

    Frequencies f_k = 1 / 10000**(2k / d_model) for k < d_model / 2 (Vaswani et al., 2017), computed in float32
    and cast to `dtype` at the end.
    """
    if d_model % 2:
        raise ValueError(f"sinusoid encodings need an even d_model, got {d_model}")
    positions = T.cast(positions, T.float32)
    inv_freq = 1.0 / (10000.0 ** (T.arange(0, d_model, 2, dtype=T.float32) / d_model))  # [d/2]
    angles = positions[:, None] * inv_freq[None, :]  # [P, d/2]
    return T.cast(T.concat([T.sin(angles), T.cos(angles)], axis=-1), dtype)  # [P, d]


def relative_distances(klen, clamp_len=-1):
    """Distances K-1, K-2, ..., 0 as float32 [K], clamped at `clamp_len` when `clamp_len > 0`."""
    distances = T.arange(klen - 1, -1, -1.0, dtype=T.float32)  # [K]
    if clamp_len > 0:
        distances = T.minimum(distances, float(clamp_len))
    return distances


@keras.saving.register_keras_serializable(package="txl_tf")
class RelativePositionalEncoding(keras.layers.Layer):
    """The (weight-free) relative position matrix R: row k encodes distance K-1-k (clamped).

    Args:
      d_model: encoding width (even).

    Call args:
      klen: key length K (scalar int tensor; Keras takes only tensors positionally).
      clamp_len: distances above `clamp_len` use `clamp_len` when `clamp_len > 0` (a Python int).

    Returns:
      [K, d_model] in the layer's compute dtype.
    """

    def __init__(self, d_model, **kwargs):
        super().__init__(**kwargs)
        self.d_model = d_model
        self.built = True  # no weights (Keras' quantize() walks every layer and asks each to be built)

    def call(self, klen, clamp_len=-1):
        return sinusoid_encoding(relative_distances(klen, clamp_len), self.d_model, self.compute_dtype)

    def get_config(self):
        return {**super().get_config(), "d_model": self.d_model}


def bin_edges(n_token, cutoffs):
    """[0, *cutoffs, n_token] after checking that the cutoffs increase strictly inside (0, n_token)."""
    edges = [0, *cutoffs, n_token]
    if any(a >= b for a, b in zip(edges[:-1], edges[1:], strict=True)):
        raise ValueError(f"cutoffs {list(cutoffs)} must increase strictly within (0, n_token={n_token})")
    return edges


def bin_widths(d_embed, n_bins, div_val):
    """Embedding width of each bin: d_embed // div_val**i."""
    widths = [d_embed // (div_val**i) for i in range(n_bins)]
    if div_val > 1 and min(widths) < 1:
        raise ValueError(f"d_embed={d_embed} is too small for div_val={div_val} over {n_bins} bins")
    return widths


def has_projection(width, d_model, div_val, proj_same_dim):
    """Whether a bin of `width` is projected to `d_model` (the authors' rule)."""
    if width != d_model:
        return True
    return div_val > 1 and proj_same_dim


@keras.saving.register_keras_serializable(package="txl_tf")
class AdaptiveEmbedding(keras.layers.Layer):
    """Adaptive input embedding with the TF original's variable layout.

    `div_val == 1`: one table [V, d_embed] and, if d_embed != d_model, one projection [d_embed, d_model].
    `div_val > 1`: bin i covers token ids [edges[i], edges[i+1]) with a table [V_i, d_embed // div_val**i] and a
    projection [E_i, d_model] (bin 0 too, unless `proj_same_dim=False` and d_embed == d_model).
    Output = projected embedding * sqrt(d_model).

    Args:
      n_token: vocabulary size V.
      d_embed: width of the first bin (defaults to d_model).
      d_model: model width.
      cutoffs: bin boundaries (token ids), increasing.
      div_val: width divisor between consecutive bins.
      proj_same_dim: project bins whose width already equals d_model (div_val > 1 only).
      init_std / proj_init_std: standard deviations of the tables / projections.

    Call args:
      tokens: [B, L] int token ids.

    Returns:
      [B, L, d_model] in the compute dtype.

    Attributes (for tying the softmax): `tables` (list of [V_i, E_i] variables, one per bin; a single one when
    div_val == 1) and `projections` (list of [E_i, d_model] variables or None).
    """

    def __init__(
        self,
        n_token,
        d_model,
        d_embed=None,
        cutoffs=(),
        div_val=1,
        proj_same_dim=True,
        init_std=0.02,
        proj_init_std=0.01,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.n_token = n_token
        self.d_model = d_model
        self.d_embed = d_model if d_embed is None else d_embed
        self.cutoffs = tuple(cutoffs)
        self.div_val = div_val
        self.proj_same_dim = proj_same_dim
        self.init_std = init_std
        self.proj_init_std = proj_init_std
        self.edges = bin_edges(n_token, self.cutoffs)
        n_tables = 1 if div_val == 1 else len(self.edges) - 1
        self.widths = bin_widths(self.d_embed, n_tables, div_val)

    def build(self, input_shape=None):
        table_init = keras.initializers.RandomNormal(stddev=self.init_std)
        proj_init = keras.initializers.RandomNormal(stddev=self.proj_init_std)
        # One attribute per weight (not a list): tf.train.Checkpoint does not look inside Keras-tracked lists.
        for i, width in enumerate(self.widths):
            rows = self.n_token if self.div_val == 1 else self.edges[i + 1] - self.edges[i]
            setattr(self, f"table_{i}", self.add_weight(name=f"table_{i}", shape=(rows, width), initializer=table_init))
            proj = None
            if has_projection(width, self.d_model, self.div_val, self.proj_same_dim):
                proj = self.add_weight(name=f"proj_{i}", shape=(width, self.d_model), initializer=proj_init)
            setattr(self, f"proj_{i}", proj)
        super().build(input_shape)

    @property
    def tables(self):
        """Embedding tables, one per bin ([V_i, E_i]); a single [V, d_embed] one when div_val == 1."""
        return [getattr(self, f"table_{i}") for i in range(len(self.widths))]

    @property
    def projections(self):
        """Projections [E_i, d_model] per table, None where a bin is not projected."""
        return [getattr(self, f"proj_{i}") for i in range(len(self.widths))]

    def _embed_bin(self, i, ids):
        vectors = T.gather(T.cast(self.tables[i], self.compute_dtype), ids)  # [B, L, E_i]
        if self.projections[i] is not None:
            vectors = T.matmul(vectors, T.cast(self.projections[i], self.compute_dtype))  # [B, L, d]
        return vectors

    def call(self, tokens):
        tokens = T.cast(tokens, T.int32)
        if self.div_val == 1:
            out = self._embed_bin(0, tokens)  # [B, L, d]
        else:
            out = None
            for i in range(len(self.widths)):
                low, high = self.edges[i], self.edges[i + 1]
                in_bin = (tokens >= low) & (tokens < high)  # [B, L]
                ids = T.clip_by_value(tokens - low, 0, high - low - 1)
                part = T.where(in_bin[..., None], self._embed_bin(i, ids), T.zeros((), self.compute_dtype))
                out = part if out is None else out + part
        return out * T.cast(math.sqrt(self.d_model), self.compute_dtype)  # [B, L, d]

    def get_config(self):
        return {
            **super().get_config(),
            "n_token": self.n_token,
            "d_model": self.d_model,
            "d_embed": self.d_embed,
            "cutoffs": list(self.cutoffs),
            "div_val": self.div_val,
            "proj_same_dim": self.proj_same_dim,
            "init_std": self.init_std,
            "proj_init_std": self.proj_init_std,
        }
