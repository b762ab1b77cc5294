"""The Transformer-XL language model: adaptive embedding, a stack of blocks with memory, adaptive softmax.

Shape glossary:
  B batch, L = qlen segment length, M memory length given to a call, K = M + L key length,
  N heads (n_head), D head width (d_head), d = d_model, V = n_token, n = n_layer.

Memory: `mems` [n, B, M, d] holds, for each layer, the hidden states that entered that layer in earlier
segments. A call returns `new_mems` [n, B, min(mem_len, M + L), d]: per layer the last `mem_len` positions of
concat([mems[i], input of layer i]) with the gradient stopped (layer 0's input is the embedding after dropout).
Starting from `initial_mems` (zeros, the TF original's convention) keeps the length at exactly `mem_len`.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from txl_tf.attention import ATTN_TYPES, attention_bias
from txl_tf.block import TransformerXLBlock
from txl_tf.dropout import Dropout
from txl_tf.embedding import AdaptiveEmbedding, RelativePositionalEncoding
from txl_tf.softmax import AdaptiveSoftmax


def update_memory(memory, hidden, mem_len):
    """Last `mem_len` positions of concat([memory, hidden]) along time, gradient stopped.

    memory: [B, M, d] or None; hidden: [B, L, d]. Returns [B, min(mem_len, M + L), d].
    """
    cat = hidden if memory is None else tf.concat([tf.cast(memory, hidden.dtype), hidden], axis=1)  # [B, K, d]
    start = tf.maximum(tf.shape(cat)[1] - mem_len, 0)
    return tf.stop_gradient(cat[:, start:])


@keras.saving.register_keras_serializable(package="txl_tf")
class TransformerXL(keras.Model):
    """Transformer-XL (Dai et al., 2019) with the TF original's numerics by default.

    Args (names as in the authors' code):
      n_token, n_layer, d_model, n_head, d_head, d_inner: sizes.
      dropout: on the embedding, position encodings, attention / feed-forward outputs and the final hidden.
      dropatt: on the attention probabilities.
      mem_len: memory length kept per layer (0 turns recurrence off).
      d_embed, cutoffs, div_val, tie_projs, proj_same_dim: adaptive embedding / softmax.
      untie_r: one u / v per layer instead of one shared by all layers.
      same_length: every query attends the same number of keys (`same_length_keys`: "tf" = M + 1 keys,
        the TF original; "pytorch" = mem_len keys, the PyTorch original).
      clamp_len: relative distances above it share one encoding (> 0 to enable).
      attn_type: "xl" (default), "shaw", "vaswani", "al_rfou" (paper Tables 5/6 ablations; see attention.py).
      pre_lnorm: LayerNorm before each sub-layer (no final LayerNorm, as in the PyTorch original).
      layer_norm_epsilon: 1e-12 as the TF original (the PyTorch original uses 1e-5).
      init_std / proj_init_std: N(0, std) initialisers of weights / adaptive embedding and softmax projections.
      max_position: table size of the learned positions of "shaw" (relative) and "al_rfou" (absolute).

    `mem_len`, `clamp_len`, `same_length` are plain attributes: change them after loading weights to evaluate with a
    longer memory (a `tf.function` traced before the change must be traced again).

    Call args:
      tokens: [B, L] int.
      mems: [n, B, M, d] or None (no memory).
      training: dropout on/off.

    Returns:
      (hidden [B, L, d] after the final dropout, new_mems [n, B, min(mem_len, M + L), d]), both in the compute
      dtype.
    """

    def __init__(self, n_token, n_layer, d_model, n_head, d_head, d_inner, dropout, dropatt, mem_len,
                 d_embed=None, cutoffs=(), div_val=1, tie_projs=None, proj_same_dim=True, untie_r=False,
                 same_length=False, clamp_len=-1, attn_type="xl", pre_lnorm=False, layer_norm_epsilon=1e-12,
                 init_std=0.02, proj_init_std=0.01, max_position=1024, same_length_keys="tf", **kwargs):
        super().__init__(**kwargs)
        if attn_type not in ATTN_TYPES:
            raise ValueError(f"attn_type must be one of {ATTN_TYPES}, got {attn_type!r}")
        if same_length_keys not in ("tf", "pytorch"):
            raise ValueError(f"same_length_keys must be 'tf' or 'pytorch', got {same_length_keys!r}")
        self.n_token = n_token
        self.n_layer = n_layer
        self.d_model = d_model
        self.n_head = n_head
        self.d_head = d_head
        self.d_inner = d_inner
        self.dropout = dropout
        self.dropatt = dropatt
        self.mem_len = mem_len
        self.d_embed = d_model if d_embed is None else d_embed
        self.cutoffs = tuple(cutoffs)
        self.div_val = div_val
        self.proj_same_dim = proj_same_dim
        self.untie_r = untie_r
        self.same_length = same_length
        self.clamp_len = clamp_len
        self.attn_type = attn_type
        self.pre_lnorm = pre_lnorm
        self.layer_norm_epsilon = layer_norm_epsilon
        self.init_std = init_std
        self.proj_init_std = proj_init_std
        self.max_position = max_position
        self.same_length_keys = same_length_keys

        self.embedding = AdaptiveEmbedding(
            n_token, d_model, d_embed=self.d_embed, cutoffs=self.cutoffs, div_val=div_val,
            proj_same_dim=proj_same_dim, init_std=init_std, proj_init_std=proj_init_std, name="embedding",
        )
        self.softmax = AdaptiveSoftmax(
            n_token, d_model, d_embed=self.d_embed, cutoffs=self.cutoffs, div_val=div_val, tie_projs=tie_projs,
            proj_same_dim=proj_same_dim, init_std=init_std, proj_init_std=proj_init_std, name="softmax",
        )
        self.tie_projs = self.softmax.tie_projs
        self.position_encoding = RelativePositionalEncoding(d_model, name="position_encoding")
        for i in range(n_layer):  # one attribute per layer: tf.train.Checkpoint skips Keras-tracked lists
            block = TransformerXLBlock(
                d_model, n_head, d_head, d_inner, dropout=dropout, dropatt=dropatt, attn_type=attn_type,
                pre_lnorm=pre_lnorm, layer_norm_epsilon=layer_norm_epsilon, max_position=max_position,
                init_std=init_std, name=f"layer_{i}",
            )
            setattr(self, f"layer_{i}", block)
        self.embedding_dropout = Dropout(dropout)
        self.position_dropout = Dropout(dropout)
        self.output_dropout = Dropout(dropout)
        self.build()

    @property
    def blocks(self):
        """The n_layer `TransformerXLBlock`s, bottom first."""
        return [getattr(self, f"layer_{i}") for i in range(self.n_layer)]

    def build(self, input_shape=None):
        if self.built:
            return
        self.embedding.build()
        self.softmax.build()
        for block in self.blocks:
            block.build((None, None, self.d_model))
        if self.attn_type == "xl":
            shape = (self.n_layer, self.n_head, self.d_head) if self.untie_r else (self.n_head, self.d_head)
            init = keras.initializers.RandomNormal(stddev=self.init_std)
            self.r_w_bias = self.add_weight(name="r_w_bias", shape=shape, initializer=init)  # u
            self.r_r_bias = self.add_weight(name="r_r_bias", shape=shape, initializer=init)  # v
        self.built = True

    def initial_mems(self, batch_size):
        """Zero memories [n, B, mem_len, d] in the compute dtype (the TF original's first segment)."""
        return tf.zeros([self.n_layer, batch_size, self.mem_len, self.d_model], self.compute_dtype)

    def _check_mems(self, tokens, mems):
        if mems is None or len(mems.shape) != 4:
            if mems is not None:
                raise ValueError(f"mems must be [n_layer, B, M, d_model], got shape {mems.shape}")
            return
        n, b, _, d = mems.shape
        if (n is not None and n != self.n_layer) or (d is not None and d != self.d_model):
            raise ValueError(
                f"mems shape {mems.shape} does not fit this model: expected [{self.n_layer}, B, M, {self.d_model}]"
            )
        if b is not None and tokens.shape[0] is not None and b != tokens.shape[0]:
            raise ValueError(f"mems batch {b} differs from the tokens batch {tokens.shape[0]}")

    def _biases(self, i):
        """(u, v) [N, D] for layer i (xl only)."""
        if self.attn_type != "xl":
            return None, None
        if self.untie_r:
            return self.r_w_bias[i], self.r_r_bias[i]
        return self.r_w_bias, self.r_r_bias

    def _forward(self, tokens, mems, training, return_probs):
        tokens = tf.convert_to_tensor(tokens)
        if mems is not None:
            mems = tf.cast(tf.convert_to_tensor(mems), self.compute_dtype)
        self._check_mems(tokens, mems)
        qlen = tf.shape(tokens)[1]
        mlen = 0 if mems is None else tf.shape(mems)[2]
        klen = mlen + qlen

        h = self.embedding(tokens)  # [B, L, d]
        pos = None
        if self.attn_type in ("xl", "vaswani"):
            pos = self.position_encoding(klen, clamp_len=self.clamp_len)  # [K, d], descending distance
        if self.attn_type == "vaswani":
            h = h + pos[mlen:]  # absolute sinusoid of the segment's positions
        h = self.embedding_dropout(h, training=training)
        if self.attn_type == "xl":
            pos = self.position_dropout(pos, training=training)
        bias = attention_bias(qlen, mlen, self.same_length, self.same_length_keys, self.mem_len)  # [L, K]

        new_mems, all_probs = [], []
        layer_mems = [None] * self.n_layer if mems is None else tf.unstack(mems, num=self.n_layer)
        for i, block in enumerate(self.blocks):
            mem_i = layer_mems[i]  # [B, M, d]
            new_mems.append(update_memory(mem_i, h, self.mem_len))
            if self.attn_type == "vaswani" and i == 0 and mem_i is not None:
                mem_i = mem_i + pos[:mlen]  # the authors add the positions to the first layer's memory too
            u, v = self._biases(i)
            out = block(h, memory=mem_i, position_encoding=pos, attention_bias=bias, content_bias=u,
                        position_bias=v, return_probs=return_probs, training=training)
            if return_probs:
                out, probs = out
                all_probs.append(probs)
            h = out  # [B, L, d]
        hidden = self.output_dropout(h, training=training)  # [B, L, d]
        new_mems = tf.stack(new_mems)  # [n, B, min(mem_len, K), d]
        if return_probs:
            return hidden, new_mems, tf.stack(all_probs)  # probs [n, B, N, L, K]
        return hidden, new_mems

    def call(self, tokens, mems=None, training=False):
        return self._forward(tokens, mems, training, return_probs=False)

    def call_with_attention(self, tokens, mems=None):
        """Inference pass that also returns attention probabilities [n, B, N, L, K] float32."""
        return self._forward(tokens, mems, training=False, return_probs=True)

    def nll(self, hidden, targets):
        """Per-token negative log-likelihood [B, L] float32 (natural log), in token order."""
        return self.softmax.nll(hidden, targets, self.embedding.tables, self.embedding.projections)

    def log_probs(self, hidden):
        """Log-probabilities [B, L, V] float32."""
        return self.softmax.log_probs(hidden, self.embedding.tables, self.embedding.projections)

    def get_config(self):
        return {
            **super().get_config(),
            "n_token": self.n_token,
            "n_layer": self.n_layer,
            "d_model": self.d_model,
            "n_head": self.n_head,
            "d_head": self.d_head,
            "d_inner": self.d_inner,
            "dropout": self.dropout,
            "dropatt": self.dropatt,
            "mem_len": self.mem_len,
            "d_embed": self.d_embed,
            "cutoffs": list(self.cutoffs),
            "div_val": self.div_val,
            "tie_projs": list(self.tie_projs),
            "proj_same_dim": self.proj_same_dim,
            "untie_r": self.untie_r,
            "same_length": self.same_length,
            "clamp_len": self.clamp_len,
            "attn_type": self.attn_type,
            "pre_lnorm": self.pre_lnorm,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "init_std": self.init_std,
            "proj_init_std": self.proj_init_std,
            "max_position": self.max_position,
            "same_length_keys": self.same_length_keys,
        }
