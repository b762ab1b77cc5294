"""Adaptive softmax (Grave et al., 2017) tied to `AdaptiveEmbedding`, with the TF original's conventions.

Shape glossary: B batch, L length, V vocabulary, d = d_model, E_i width of bin i, C = len(cutoffs) clusters.

Bins: [0, c_0), [c_0, c_1), ..., [c_{C-1}, V). The head scores the c_0 shortlist tokens plus one column per tail
cluster; tail cluster i (1-based) is head column c_0 + i - 1 (the TF original's order). For a token t in tail
bin i: log p(t) = log p_head(column c_0 + i - 1) + log p_tail_i(t - c_{i-1}).

Logits use the embedding tables (always tied, as in the original) and, per bin, either the embedding's
projection (`tie_projs[i]`) or the softmax's own. Everything is computed densely for every position (static
shapes, XLA-friendly), so the per-token NLL comes back in token order; logits and losses are float32.
"""

from __future__ import annotations

import keras

from txl_tf.model import tensor_ops as T
from txl_tf.model.embedding import bin_edges, bin_widths, has_projection


@keras.saving.register_keras_serializable(package="txl_tf")
class AdaptiveSoftmax(keras.layers.Layer):
    """Owns the output biases, the cluster weights and the untied projections of the adaptive softmax.

    Args:
      n_token: vocabulary size V.
      d_model: width of the hidden states.
      d_embed: width of the first bin (defaults to d_model).
      cutoffs, div_val, proj_same_dim: as `AdaptiveEmbedding` (must match it).
      tie_projs: per bin, whether to reuse the embedding's projection; default: all but the first
        (the authors' `proj_share_all_but_first`), or the only one when there are no cutoffs (as the TF original).
      init_std / proj_init_std: normal initialiser of the cluster weights / own projections; biases start at 0.

    Call args (`call` = `nll`):
      hidden: [B, L, d].
      targets: [B, L] int ids.
      tables: the embedding tables (`AdaptiveEmbedding.tables`).
      projections: the embedding projections (`AdaptiveEmbedding.projections`, entries may be None).

    Returns:
      `nll`: [B, L] float32 negative log-likelihood (natural log) in token order.
      `log_probs`: [B, L, V] float32 log-probabilities.
    """

    def __init__(self, n_token, d_model, d_embed=None, cutoffs=(), div_val=1, tie_projs=None,
                 proj_same_dim=True, init_std=0.02, proj_init_std=0.01, **kwargs):
        super().__init__(**kwargs)
        self.n_token = n_token
        self.d_model = d_model
        self.d_embed = d_model if d_embed is None else d_embed
        self.cutoffs = tuple(cutoffs)
        self.div_val = div_val
        if tie_projs is None:  # without cutoffs the TF original always reuses the embedding projection
            tie_projs = [not self.cutoffs] + [True] * len(self.cutoffs)
        self.tie_projs = tuple(bool(t) for t in tie_projs)
        if len(self.tie_projs) != len(self.cutoffs) + 1:
            raise ValueError(f"tie_projs needs one entry per bin ({len(self.cutoffs) + 1}), got {list(tie_projs)}")
        self.proj_same_dim = proj_same_dim
        self.init_std = init_std
        self.proj_init_std = proj_init_std
        self.edges = bin_edges(n_token, self.cutoffs)
        n_bins = len(self.edges) - 1
        self.widths = bin_widths(self.d_embed, n_bins, div_val) if div_val > 1 else [self.d_embed] * n_bins

    def build(self, input_shape=None):
        self.bias = self.add_weight(name="bias", shape=(self.n_token,), initializer="zeros")
        if self.cutoffs:
            self.cluster_kernel = self.add_weight(
                name="cluster_kernel", shape=(len(self.cutoffs), self.d_embed),
                initializer=keras.initializers.RandomNormal(stddev=self.init_std),
            )
            self.cluster_bias = self.add_weight(name="cluster_bias", shape=(len(self.cutoffs),), initializer="zeros")
        for i, width in enumerate(self.widths):  # one attribute each: checkpoints skip Keras-tracked lists
            proj = None
            if not self.tie_projs[i] and has_projection(width, self.d_model, self.div_val, self.proj_same_dim):
                proj = self.add_weight(
                    name=f"proj_{i}", shape=(width, self.d_model),
                    initializer=keras.initializers.RandomNormal(stddev=self.proj_init_std),
                )
            setattr(self, f"proj_{i}", proj)
        super().build(input_shape)

    @property
    def own_projections(self):
        """The softmax's own (untied) projections [E_i, d_model] per bin, None where tied or absent."""
        return [getattr(self, f"proj_{i}") for i in range(len(self.widths))]

    def _bin_weights(self, i, tables, projections):
        """(table [V_i, E_i], bias [V_i], projection [E_i, d] or None) of bin i, float32."""
        low, high = self.edges[i], self.edges[i + 1]
        if self.div_val == 1:  # tf.slice: the strided slice's gradient is slow on CPU for large tables
            table = T.slice(tables[0], [low, 0], [high - low, -1])
            tied_proj = projections[0]
        else:
            table, tied_proj = tables[i], projections[i]
        proj = tied_proj if self.tie_projs[i] else self.own_projections[i]
        cast = lambda w: None if w is None else T.cast(w, T.float32)  # noqa: E731
        return cast(table), T.cast(self.bias, T.float32)[low:high], cast(proj)

    def _logits(self, hidden, table, bias, proj):
        if proj is not None:
            hidden = T.matmul(hidden, proj, transpose_b=True)  # [B, L, E_i]
        return T.matmul(hidden, table, transpose_b=True) + bias  # [B, L, V_i]

    def _head_logits(self, hidden, tables, projections):
        table, bias, proj = self._bin_weights(0, tables, projections)
        if self.cutoffs:
            table = T.concat([table, T.cast(self.cluster_kernel, T.float32)], 0)  # [c_0 + C, E_0]
            bias = T.concat([bias, T.cast(self.cluster_bias, T.float32)], 0)
        return self._logits(hidden, table, bias, proj)  # [B, L, c_0 + C]

    def nll(self, hidden, targets, tables, projections):
        hidden = T.cast(hidden, T.float32)  # [B, L, d]
        targets = T.cast(targets, T.int32)  # [B, L]
        head_targets = targets
        tail_nll = T.zeros_like(targets, T.float32)
        for i in range(1, len(self.edges) - 1):
            low, high = self.edges[i], self.edges[i + 1]
            in_bin = (targets >= low) & (targets < high)  # [B, L]
            head_targets = T.where(in_bin, self.cutoffs[0] + i - 1, head_targets)  # the cluster's column
            tail_logits = self._logits(hidden, *self._bin_weights(i, tables, projections))  # [B, L, V_i]
            tail = T.sparse_softmax_cross_entropy_with_logits(
                labels=T.clip_by_value(targets - low, 0, high - low - 1), logits=tail_logits
            )  # [B, L]
            tail_nll += T.where(in_bin, tail, 0.0)
        head_logits = self._head_logits(hidden, tables, projections)
        head_nll = T.sparse_softmax_cross_entropy_with_logits(labels=head_targets, logits=head_logits)
        return head_nll + tail_nll  # [B, L]

    def log_probs(self, hidden, tables, projections):
        hidden = T.cast(hidden, T.float32)
        head = T.log_softmax(self._head_logits(hidden, tables, projections))  # [B, L, c_0 + C]
        if not self.cutoffs:
            return head  # [B, L, V]
        parts = [T.split(head, [self.cutoffs[0], len(self.cutoffs)], axis=-1)[0]]
        for i in range(1, len(self.edges) - 1):
            tail = T.log_softmax(self._logits(hidden, *self._bin_weights(i, tables, projections)))
            column = self.cutoffs[0] + i - 1
            parts.append(head[..., column : column + 1] + tail)  # [B, L, V_i]
        return T.concat(parts, axis=-1)  # [B, L, V]

    def call(self, hidden, targets, tables, projections):
        return self.nll(hidden, targets, tables, projections)

    def get_config(self):
        return {
            **super().get_config(),
            "n_token": self.n_token,
            "d_model": self.d_model,
            "d_embed": self.d_embed,
            "cutoffs": list(self.cutoffs),
            "div_val": self.div_val,
            "tie_projs": list(self.tie_projs),
            "proj_same_dim": self.proj_same_dim,
            "init_std": self.init_std,
            "proj_init_std": self.proj_init_std,
        }
