"""The absolute sinusoid encoding of Vaswani et al. (2017) as the authors' ablation uses it: the sinusoid of each
window position is added to the segment's embeddings and to the first layer's memory; the scores are q.k only.

The authors' window numbers positions by descending distance (row k of R is distance K-1-k), so the segment's
last token gets the sinusoid of 0; clamp_len clamps those numbers as it clamps xl's distances.
"""

from __future__ import annotations

from txl_tf.model.encodings.base import Encoding, Prepared


class Vaswani(Encoding):
    name = "vaswani"
    citation = "Vaswani et al. (2017)"
    absolute = True
    clamps = True
    clamp = "window positions above clamp_len share the sinusoid of clamp_len"

    def prepare(self, model, mlen, qlen, protocol, training, cached, kernels=False) -> Prepared:
        pos = model.position_encoding(klen=mlen + qlen, clamp_len=protocol.clamp_len)  # [K, d]
        return Prepared(inputs=pos[mlen:], memory=pos[:mlen])
