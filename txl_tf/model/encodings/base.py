"""What a position encoding is to the model: one object, chosen once by name (`txl_tf.model.encodings.get`).

Shape glossary: B batch, L segment length, M memory length, K = M + L keys, N heads, D head width, d = d_model.
Key j (0 <= j < K) sits at window position j; query i at M + i; their distance is M + i - j.

An encoding answers, for the layers that call it:

  weights        `build_model` (the stack's, e.g. xl's u and v), `build_block` (al_rfou's absolute table) and
                 `build_attention` (xl's W_R, shaw's relative table): created under the names the checkpoints use.
  once per call  `prepare(model, mlen, qlen, protocol, training, cached, kernels)` -> `Prepared`: what every layer shares
                 (the sinusoid matrix R, a rotation table, a per-head distance penalty), computed once.
  the inputs     `embed` (added to the embeddings: vaswani) and `block_positions` (added to a block's memory and
                 inputs: al_rfou).
  the scores     `Prepared.score_bias` (added to q.k: ALiBi's penalty, merged with the causal mask), `rotate`
                 (applied to the queries and keys: RoPE), `clamp_scores` (RoPE's clamp), `position_rows` (the rows
                 r_{i-j} of the relative term (q + v).r, aligned by rel_shift: xl, shaw) and `layer_biases` (xl's u
                 and v).
  the cache      `cache_encoding` and `position_keys_cached`: what the keys/values cache keeps for the encoding
                 besides keys and values (xl's and shaw's position keys for every distance it serves).
  clamping       `clamps`: whether `clamp_len` changes the scores (xl, vaswani, alibi, rope); `clamp`: how distances
                 beyond `clamp_len` (or the learned tables) are treated; `clamp_problem`: why a clamp_len is refused.
  FLOPs          `flops`: the matrix-product FLOPs the encoding adds to one layer's forward pass.

The attention layer holds the encoding and asks it; it never compares names.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from txl_tf.model import tensor_ops as T


class Prepared(NamedTuple):
    """What an encoding computes once per model call for every layer."""

    encoding: Any = None  # passed to every attention call as `position_encoding`
    score_bias: Any = None  # [N, 1, L, K] added to the scores (with the mask)
    inputs: Any = None  # [L, d] added to the embeddings
    memory: Any = None  # [M, d] added to the first layer's memory


class Encoding:
    """The interface (and the neutral answers) of a position encoding; see the module docstring."""

    name = ""
    citation = ""
    position_keys_cached = False  # the keys/values cache keeps position keys [N, P, D] (xl, shaw)
    absolute = False  # positions are added to the inputs, so keys depend on the window (vaswani, al_rfou)
    uses_max_position = False  # a learned table of ModelConfig.max_position rows (shaw, al_rfou)
    clamps = False  # clamp_len changes the scores; where it does not, a clamp_len > 0 is refused (`clamp_problem`)
    clamp = "clamp_len does not apply"

    def problem(self, *, d_model: int, d_head: int) -> str | None:
        """Why the encoding cannot go with these sizes (e.g. "d_head must be even"), or None."""
        return None

    def clamp_problem(self, clamp_len: int) -> str | None:
        """Why `clamp_len` cannot go with this encoding (a clamp > 0 that it ignores), or None."""
        if clamp_len > 0 and not self.clamps:
            return f"attn_type {self.name!r} ignores clamp_len ({self.clamp}), so clamp_len={clamp_len} would go unused"
        return None

    # ---- weights ---------------------------------------------------------------------------------------------
    def build_model(self, model) -> None:
        """Creates the stack's weights of the encoding on `model` (a TransformerXL)."""

    def build_block(self, block) -> None:
        """Creates a block's weights of the encoding on `block` (a TransformerXLBlock)."""

    def build_attention(self, layer) -> None:
        """Creates an attention layer's weights of the encoding on `layer` (a RelativeMultiHeadAttention)."""

    def weights_per_layer(self, *, d_model: int, width: int, max_position: int) -> int:
        """Weights the encoding adds to each layer (width = N * D)."""
        return 0

    def weights_of_stack(self, *, n_layer: int, width: int, untie_r: bool) -> int:
        """Weights the encoding adds to the stack (shared by the layers or one per layer)."""
        return 0

    # ---- once per call ---------------------------------------------------------------------------------------
    def prepare(self, model, mlen, qlen, protocol, training, cached, kernels=False) -> Prepared:
        """What the model's layers share in one call (see `Prepared`); `kernels`: the training policy's fused
        kernels (for a dropout the encoding applies)."""
        return Prepared()

    def layer_biases(self, model, index: int):
        """(content bias u, position bias v) [N, D] of layer `index`, or (None, None)."""
        return None, None

    # ---- a block ---------------------------------------------------------------------------------------------
    def block_positions(self, block, qlen, mlen):
        """(memory positions [M, d], input positions [L, d]) a block adds before its attention, or (None, None)."""
        return None, None

    # ---- an attention layer ----------------------------------------------------------------------------------
    def position_rows(self, layer, klen, position_encoding):
        """The rows r [K, N*D] of the relative term (q + v).r_{i-j} in descending distance (K-1 .. 0), or None.
        A keys/values cache keeps them for every distance it can serve (`position_keys_cached`)."""
        return None

    def cache_encoding(self, model, total, protocol):
        """The `position_encoding` a keys/values cache's position keys are made from (P = `total` distances)."""
        return None

    def rotate(self, q, k, position_encoding):
        """Queries [N, B, L, D] and keys [N, B, K, D] as the scores see them (RoPE rotates them)."""
        return q, k

    def clamp_scores(self, score, q, k, position_encoding):
        """The content scores [N, B, L, K] with the distances above the protocol's clamp_len scored as clamp_len,
        from the queries and keys before `rotate` (RoPE's clamp); the scores as they are elsewhere."""
        return score

    # ---- FLOPs -----------------------------------------------------------------------------------------------
    def flops(self, *, batch: int, qlen: int, klen: int, d_model: int, width: int) -> int:
        """Matrix-product FLOPs the encoding adds to one layer's forward pass (2 per multiply-add)."""
        return 0


def window_distances(mlen, qlen, clamp_len=-1):
    """[L, K] float32 distances M + i - j of query i to key j (negative right of the diagonal), clamped at
    `clamp_len` when `clamp_len > 0`."""
    query = T.cast(T.arange(qlen) + mlen, T.float32)[:, None]  # [L, 1]
    key = T.cast(T.arange(mlen + qlen), T.float32)[None, :]  # [1, K]
    distances = query - key
    if clamp_len > 0:
        distances = T.minimum(distances, float(clamp_len))
    return distances
