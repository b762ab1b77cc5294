"""Transformer-XL's relative encoding (Dai et al., 2019, section 3.3): the paper's four score terms

    (a) q_i.k_j + (b) q_i.W_R R_{i-j} + (c) u.k_j + (d) v.W_R R_{i-j}

with R the sinusoid of the distance (`txl_tf.model.embedding`), W_R a projection per layer (the attention's `position` Dense) and u, v
(`r_w_bias`, `r_r_bias`) shared by the layers or one per layer (`untie_r`). R is computed once per call for all
layers, with dropout in training; (b) + (d) come from one matmul against R's rows aligned by rel_shift.
"""

from __future__ import annotations

import keras

from txl_tf.model import tensor_ops as T
from txl_tf.model.encodings.base import Encoding, Prepared


class XL(Encoding):
    name = "xl"
    citation = "Dai et al. (2019), section 3.3"
    position_keys_cached = True
    clamps = True
    clamp = "distances above clamp_len share the sinusoid of clamp_len (the authors' clamp_len)"

    def build_model(self, model) -> None:
        shape = (model.n_layer, model.n_head, model.d_head) if model.untie_r else (model.n_head, model.d_head)
        init = keras.initializers.RandomNormal(stddev=model.init_std)
        model.r_w_bias = model.add_weight(name="r_w_bias", shape=shape, initializer=init)  # u
        model.r_r_bias = model.add_weight(name="r_r_bias", shape=shape, initializer=init)  # v

    def build_attention(self, layer) -> None:
        from txl_tf.model.projection import projection

        layer.position = projection("position", layer.n_head * layer.d_head, layer.init_std)  # W_R
        layer.position.build((None, layer.d_model))

    def weights_per_layer(self, *, d_model: int, width: int, max_position: int) -> int:
        return d_model * width  # W_R

    def weights_of_stack(self, *, n_layer: int, width: int, untie_r: bool) -> int:
        return 2 * width * (n_layer if untie_r else 1)  # u, v

    def prepare(self, model, mlen, qlen, protocol, training, cached, kernels=False) -> Prepared:
        if cached:  # the cache holds every layer's W_R R already
            return Prepared()
        pos = model.position_encoding(klen=mlen + qlen, clamp_len=protocol.clamp_len)  # [K, d], descending distance
        return Prepared(encoding=model.position_dropout(pos, training=training, kernels=kernels))

    def cache_encoding(self, model, total, protocol):
        klen = T.constant(total) if T.TENSORFLOW else total  # (static off TensorFlow)
        return model.position_encoding(klen=klen, clamp_len=protocol.clamp_len)  # [P, d], no dropout

    def layer_biases(self, model, index: int):
        if model.untie_r:
            return model.r_w_bias[index], model.r_r_bias[index]
        return model.r_w_bias, model.r_r_bias

    def position_rows(self, layer, klen, position_encoding):
        from txl_tf.model.projection import project

        return project(position_encoding, layer.position, dtype=layer.compute_dtype)  # [K, N*D]: W_R R

    def flops(self, *, batch: int, qlen: int, klen: int, d_model: int, width: int) -> int:
        # W_R R once per segment (shared by the batch), then (b) + (d) against K + 1 rows (rel_shift's zero row)
        return 2 * klen * d_model * width + 2 * batch * qlen * (klen + 1) * width
