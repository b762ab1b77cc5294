"""The Transformer-XL language model: adaptive embedding, a stack of blocks with memory, adaptive softmax.

Shape glossary:
  B batch, L = qlen segment length, M memory length given to a call, K = M + L key length,
  N heads (n_head), D head width (d_head), d = d_model, V = n_token, n = n_layer.

The recurrent state goes in and comes out of every call as one value of `txl_tf.model.state` (which owns its layout),
in one of two forms:
  `Memory` (training; the authors' semantics): `hidden` [n, B, M, d] holds, for each layer, the hidden states that
    entered that layer in earlier segments. A call returns a `Memory` of [n, B, min(mem_len, M + L), d]: per layer
    the last `mem_len` positions of concat([hidden[i], input of layer i]) with the gradient stopped (layer 0's input
    is the embedding after dropout). Starting from `initial_memory` (zeros, the TF original's convention) keeps
    the length at exactly `mem_len`.
  `Cache` (inference): `initial_cache`'s keys and values of the memory per layer [n, N, B, M, D] and the position
    keys; each call projects only its own tokens. Same outputs as the memory.
The attention lengths of a call (mem_len, clamp_len, same_length) are a `Protocol` value passed to it; without
one the model's own (training) lengths apply.
"""

from __future__ import annotations

import keras

from txl_tf.model import encodings
from txl_tf.model import tensor_ops as T
from txl_tf.model.attention import attention_bias, memory_mask
from txl_tf.model.block import TransformerXLBlock
from txl_tf.model.dropout import Dropout
from txl_tf.model.embedding import AdaptiveEmbedding, RelativePositionalEncoding
from txl_tf.model.policy import DEFAULT
from txl_tf.model.protocol import Protocol
from txl_tf.model.softmax import AdaptiveSoftmax
from txl_tf.model.state import Cache, Memory, check_type


def _check_clamp(encoding, clamp_len: int, what: str) -> None:
    """ValueError when `clamp_len` > 0 goes to an encoding that ignores it (`Encoding.clamp_problem`)."""
    problem = encoding.clamp_problem(clamp_len)
    if problem:
        raise ValueError(f"{what}: {problem}; pass clamp_len=-1")


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
      attn_type: the position encoding, a name of `txl_tf.model.encodings.REGISTRY`: "xl" (default), "shaw", "vaswani",
        "al_rfou" (the paper's Tables 5/6 ablations), "rope", "alibi"; resolved once into `self.encoding`.
      pre_lnorm: LayerNorm before each sub-layer (no final LayerNorm, as in the PyTorch original).
      layer_norm_epsilon: 1e-12 as the TF original (the PyTorch original uses 1e-5).
      init_std / proj_init_std: N(0, std) initialisers of weights / adaptive embedding and softmax projections.
      max_position: table size of the learned positions of "shaw" (relative) and "al_rfou" (absolute).

    These arguments are the architecture: `get_config` holds them and nothing else (no precision, no kernels, no
    recomputation). How a training call runs is the trainer's `TrainingPolicy` (`txl_tf.model.policy`), passed to the
    call; the precision is the Keras dtype policy the layers are built under.

    `mem_len`, `clamp_len`, `same_length` are the training lengths (`protocol`); evaluate with others by passing
    a `Protocol` to the call, never by changing them.

    Call args:
      tokens: [B, L] int.
      state: a `txl_tf.model.state.Memory` (hidden [n, B, M, d], any M), a `Cache` from `initial_cache` (inference
        only), or None (no memory, M = 0).
      protocol: the attention lengths of this call (default: `self.protocol`).
      lengths: optional [B] int32 tokens per row (the rest is padding and does not enter the state).
      training: dropout on/off.
      policy: a `txl_tf.model.policy.TrainingPolicy` for training calls (the fused CPU kernels, recomputation of each
        block's activations); None: TensorFlow's ops, no recomputation. Outputs, memory and gradients do not
        depend on it (the kernels' dropout masks come from another stream).

    Returns:
      (hidden [B, L, d] after the final dropout, new state) with the new state of the type given: a `Memory` of
      [n, B, min(mem_len, M + L), d] (also for None) or the updated `Cache`, in the compute dtype.
    """

    def __init__(self, n_token, n_layer, d_model, n_head, d_head, d_inner, dropout, dropatt, mem_len,
                 d_embed=None, cutoffs=(), div_val=1, tie_projs=None, proj_same_dim=True, untie_r=False,
                 same_length=False, clamp_len=-1, attn_type="xl", pre_lnorm=False, layer_norm_epsilon=1e-12,
                 init_std=0.02, proj_init_std=0.01, max_position=1024, same_length_keys="tf", **kwargs):
        super().__init__(**kwargs)
        self.encoding = encodings.get(attn_type)
        _check_clamp(self.encoding, clamp_len, "clamp_len")
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
        self.encoding.build_model(self)  # xl: u and v
        self.built = True

    @property
    def protocol(self) -> Protocol:
        """The attention lengths the model was built (and trains) with."""
        return Protocol(self.mem_len, self.clamp_len, self.same_length)

    def initial_memory(self, batch_size, protocol: Protocol | None = None) -> Memory:
        """A zero `Memory` [n, B, mem_len, d] in the compute dtype (the TF original's first segment)."""
        mem_len = (protocol or self.protocol).mem_len
        return Memory(T.zeros([self.n_layer, batch_size, mem_len, self.d_model], self.compute_dtype))

    def supports_cache(self, protocol: Protocol | None = None) -> bool:
        """Whether the keys/values cache can carry this model's state (see `initial_cache`)."""
        return not (self.pre_lnorm and self.encoding.absolute and (protocol or self.protocol).mem_len > 0)

    def initial_cache(self, batch_size, protocol: Protocol | None = None, *, max_len: int) -> Cache:
        """The keys/values cache of a zero memory, for calls with segments of up to `max_len` tokens.

        Returns a `txl_tf.model.state.Cache`: keys, values [n, N, B, M, D] (M = protocol.mem_len) and, for the encodings
        with position rows (xl, shaw), position_keys [n, N, P, D] (P = M + max_len): each layer's position keys for
        every distance, computed here once (clamp_len applied) instead of at every call. In the compute dtype.

        Not available (ValueError) for pre_lnorm with an absolute encoding ("vaswani", "al_rfou") and a memory:
        there the keys are LayerNorm(memory + window positions), which depend on where a memory position sits in
        the window.
        """
        protocol = protocol or self.protocol
        _check_clamp(self.encoding, protocol.clamp_len, "the protocol's clamp_len")
        if not self.supports_cache(protocol):
            raise ValueError(f"a keys/values cache cannot carry pre_lnorm attn_type={self.attn_type!r} with a "
                             "memory; use the hidden-state memory (initial_memory)")
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1; got {max_len}")
        position = self.encoding.cache_encoding(self, protocol.mem_len + max_len, protocol)  # xl: R [P, d]
        return Cache.from_layers(block.initial_cache(batch_size, protocol.mem_len, max_len, position)
                                 for block in self.blocks)

    def _checked_state(self, tokens, state, protocol):
        """`state` in the compute dtype, after its checks against this model, the protocol and the tokens."""
        check_type(state, (Memory, Cache), "TransformerXL")
        if state is None:
            return None
        batch = tokens.shape[0]
        if isinstance(state, Cache):
            state.check(n_layer=self.n_layer, mem_len=protocol.mem_len,
                        position_keys=self.encoding.position_keys_cached, batch=batch)
        else:
            state = Memory(T.convert_to_tensor(state.hidden))
            state.check(n_layer=self.n_layer, d_model=self.d_model, batch=batch)
        return state.cast(self.compute_dtype)

    def _layer_states(self, state):
        """Each layer's state (`LayerMemory` / `LayerCache`), or None per layer without a state."""
        return [None] * self.n_layer if state is None else state.layers(self.n_layer)

    def _forward(self, tokens, state, protocol, lengths, training, return_probs, policy=None, memory_lengths=None):
        protocol = protocol or self.protocol
        _check_clamp(self.encoding, protocol.clamp_len, "the protocol's clamp_len")
        policy = policy or DEFAULT
        tokens = T.convert_to_tensor(tokens)
        state = self._checked_state(tokens, state, protocol)
        cached = isinstance(state, Cache)
        mlen = 0 if state is None else state.mem_len
        qlen = T.shape(tokens)[1]

        h = self.embedding(tokens)  # [B, L, d]
        prepared = self.encoding.prepare(self, mlen, qlen, protocol, training, cached, policy.kernels)  # all layers
        if prepared.inputs is not None:
            h = h + prepared.inputs  # vaswani: the absolute sinusoid of the segment's positions
        h = self.embedding_dropout(h, training=training, kernels=policy.kernels)
        bias = attention_bias(qlen, mlen, protocol.same_length, self.same_length_keys, protocol.mem_len)  # [L, K]
        if prepared.score_bias is not None:
            bias = bias + prepared.score_bias  # alibi: [N, 1, L, K]
        if memory_lengths is not None and state is not None:
            bias = bias + memory_mask(memory_lengths, mlen, qlen)  # [1, B, L, K] or [N, B, L, K]

        new_states, all_probs = [], []
        for i, (block, layer_state) in enumerate(zip(self.blocks, self._layer_states(state), strict=True)):
            # The authors add the positions to the first layer's memory too (vaswani).
            memory_positions = prepared.memory if i == 0 and state is not None else None
            u, v = self.encoding.layer_biases(self, i)  # xl: u, v [N, D]
            out = block(h, layer_state, mem_len=protocol.mem_len, lengths=lengths, position_encoding=prepared.encoding,
                        memory_positions=memory_positions, attention_bias=bias, content_bias=u, position_bias=v,
                        return_probs=return_probs, training=training, policy=policy)
            h = out[0]  # [B, L, d]
            new_states.append(out[1])
            if return_probs:
                all_probs.append(out[2])
        hidden = self.output_dropout(h, training=training, kernels=policy.kernels)  # [B, L, d]
        # A cache's position keys pass through; a memory is [n, B, min(mem_len, K), d].
        new_state = Memory.from_layers(new_states) if state is None else state.updated(new_states)
        if return_probs:
            return hidden, new_state, T.stack(all_probs)  # probs [n, B, N, L, K]
        return hidden, new_state

    def call(self, tokens, state=None, protocol=None, lengths=None, training=False, policy=None,
             memory_lengths=None):
        """(hidden [B, L, d], new state) of a segment after `state`; `lengths` [B]: each row's tokens (the rest is
        padding, kept out of the state); `memory_lengths` [B]: how many of the memory's positions (its last ones)
        row b has seen, the others masked (a memory that starts empty; None: every position attends, the TF
        original's zero memory)."""
        return self._forward(tokens, state, protocol, lengths, training, return_probs=False, policy=policy,
                             memory_lengths=memory_lengths)

    def compute_output_spec(self, tokens, state=None, protocol=None, lengths=None, training=False, policy=None,
                            memory_lengths=None):
        """The (hidden, new state) a symbolic call gives (a functional model's graph, `TransformerXLBackbone`),
        worked out from the shapes instead of tracing the call: JAX's shape tracing takes no `Protocol` argument and
        no symbolic length through the layers' static shapes. hidden [B, L, d_model] in the compute dtype; the new
        state as the call returns it (a memory's kept positions unknown)."""
        batch, length = tokens.shape[0], tokens.shape[1]
        hidden = keras.KerasTensor((batch, length, self.d_model), self.compute_dtype)
        if isinstance(state, Cache):
            return hidden, state
        return hidden, Memory(keras.KerasTensor((self.n_layer, batch, None, self.d_model), self.compute_dtype))

    def call_with_attention(self, tokens, state=None, protocol=None):
        """Inference pass that also returns attention probabilities [n, B, N, L, K] float32: (hidden, new state,
        probs)."""
        return self._forward(tokens, state, protocol, None, training=False, return_probs=True)

    def nll(self, hidden, targets):
        """Per-token negative log-likelihood [B, L] float32 (natural log), in token order."""
        return self.softmax.nll(hidden, targets, self.embedding.tables, self.embedding.projections)

    def log_probs(self, hidden):
        """Log-probabilities [B, L, V] float32."""
        return self.softmax.log_probs(hidden, self.embedding.tables, self.embedding.projections)

    def get_config(self):
        """The architecture: the constructor's arguments, without the precision (a training policy: Keras's
        dtype policy of whoever builds the model)."""
        base = {key: value for key, value in super().get_config().items() if key != "dtype"}
        return {
            **base,
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
