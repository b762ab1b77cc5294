"""The position encodings as plug-ins (txl_tf.model.encodings): RoPE and ALiBi against slow oracles written from their
papers' equations, looping over (i, j); and, for every encoding of the registry, incremental decoding equals one
pass, no gradient reaches the memory, and the parameter counts of the study's gin files agree (the keys/values
cache equals the memory for every encoding in tests/test_model.py)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from txl_tf import TransformerXL
from txl_tf.model import encodings
from txl_tf.model.attention import RelativeMultiHeadAttention, attention_bias
from txl_tf.model.encodings import alibi, rope
from txl_tf.model.protocol import Protocol
from txl_tf.model.state import LayerMemory, Memory

B, L, M, N, D, DM = 2, 3, 5, 4, 6, 12  # pairwise distinct but N: 4 heads exercise ALiBi's slopes 1/4 .. 1/256
ALL = encodings.NAMES


def _np_layer_norm(x, eps):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps)


def _rotation(delta, d):
    """The d x d matrix R(delta) of RoPE in the half-split layout: dimension t and t + d/2 turn by delta*theta_t."""
    theta = 1.0 / 10000 ** (np.arange(0, d, 2) / d)
    out = np.zeros([d, d])
    for t, angle in enumerate(delta * theta):
        c, s = np.cos(angle), np.sin(angle)
        out[t, t], out[t, t + d // 2], out[t + d // 2, t], out[t + d // 2, t + d // 2] = c, -s, s, c
    return out


def _rope_score(q_i, k_j, n, query_pos, key_pos, clamp_len):
    """Su et al., eq. 14 with the window positions: q_i^T R(j - (M + i)) k_j; with clamp_len c > 0 a distance
    M + i - j above c is scored as c, q_i^T R(-c) k_j (xl's clamp_len, as Su's rectified RoPE)."""
    dist = query_pos - key_pos
    return q_i @ _rotation(-(min(dist, clamp_len) if clamp_len > 0 else dist), D) @ k_j / np.sqrt(D)


def _alibi_score(q_i, k_j, n, query_pos, key_pos, clamp_len):
    """Press et al., section 3: q_i.k_j - m_n (M + i - j), the distance clamped at clamp_len when set."""
    dist = query_pos - key_pos
    return q_i @ k_j / np.sqrt(D) - alibi.slopes(N)[n] * (min(dist, clamp_len) if clamp_len > 0 else dist)


SCORES = {"rope": _rope_score, "alibi": _alibi_score}  # each encoding's score from its paper's equation


def oracle(name, h, mem, w, clamp_len, same_length, eps=1e-12):
    """Slow loop over (b, n, i, j) of the encoding's score (`SCORES`), then softmax, values, W_o and LayerNorm."""
    cat = np.concatenate([mem, h], axis=1)
    nq, nm = h.shape[1], mem.shape[1]
    out = np.zeros_like(h)
    for b in range(h.shape[0]):
        heads = []
        for n in range(N):
            sl = slice(n * D, (n + 1) * D)
            att = np.zeros([nq, D])
            for i in range(nq):
                q_i = h[b, i] @ w["q"][:, sl]
                scores, values = [], []
                for j in range(nm + nq):
                    dist = nm + i - j
                    if dist < 0 or (same_length and dist > nm):
                        continue
                    scores.append(SCORES[name](q_i, cat[b, j] @ w["k"][:, sl], n, nm + i, j, clamp_len))
                    values.append(cat[b, j] @ w["v"][:, sl])
                p = np.exp(np.array(scores) - max(scores))
                att[i] = (p / p.sum()) @ np.array(values)
            heads.append(att)
        out[b] = _np_layer_norm(h[b] + np.concatenate(heads, -1) @ w["o"], eps)
    return out


@pytest.mark.parametrize("name,clamp_len,same_length", [
    (name, clamp_len, same_length) for name in sorted(SCORES)
    for clamp_len, same_length in [(-1, False), (3, False), (-1, True)]
    if clamp_len <= 0 or encodings.get(name).clamps])  # an encoding that ignores clamp_len refuses one
@pytest.mark.parametrize("state", ["memory", "cache"])
def test_matches_the_papers_equation(name, state, clamp_len, same_length):
    rng = np.random.default_rng(0)
    layer = RelativeMultiHeadAttention(DM, N, D, attn_type=name)
    layer.build()
    w = {k: rng.normal(0, 0.3, s).astype(np.float32) for k, s in
         dict(q=(DM, N * D), k=(DM, N * D), v=(DM, N * D), o=(N * D, DM)).items()}
    for sub, key in [("query", "q"), ("key", "k"), ("value", "v"), ("attention_output", "o")]:
        getattr(layer, sub).kernel.assign(w[key])
    h = rng.normal(size=(B, L, DM)).astype(np.float32)
    mem = rng.normal(size=(B, M, DM)).astype(np.float32)
    protocol = Protocol(M, clamp_len, same_length)
    encoding = encodings.get(name)

    def extras(mlen, qlen, same):
        prepared = encoding.prepare(layer, mlen, qlen, protocol, False, state == "cache")  # sizes from the layer
        bias = attention_bias(qlen, mlen, same)
        return dict(position_encoding=prepared.encoding,
                    attention_bias=bias if prepared.score_bias is None else bias + prepared.score_bias)

    if state == "memory":
        out, _ = layer(h, LayerMemory(mem), **extras(M, L, same_length))
    else:  # a zero cache of M positions fed `mem` as one segment keeps exactly mem's keys and values
        cache = layer.initial_cache(B, M, M)
        _, cache = layer(mem, cache, **extras(M, M, False))
        out, _ = layer(h, cache, **extras(M, L, same_length))
    np.testing.assert_allclose(out.numpy(), oracle(name, h, mem, w, clamp_len, same_length), atol=1e-5)


def test_rope_scores_depend_on_the_distance_only():
    rng = np.random.default_rng(1)
    q, k = (tf.constant(rng.normal(size=(1, 1, 1, D)), tf.float32) for _ in range(2))
    table = rope.rotation_table(40, D)
    scores = []
    for shift in (0, 17, 33):  # the same distance 3 at three window positions
        rotated_q = rope.rotate_half(q, table[0][shift + 3:shift + 4], table[1][shift + 3:shift + 4])
        rotated_k = rope.rotate_half(k, table[0][shift:shift + 1], table[1][shift:shift + 1])
        scores.append(float(tf.reduce_sum(rotated_q * rotated_k)))
    np.testing.assert_allclose(scores, scores[0], rtol=1e-5)


def test_alibi_slopes_are_the_papers():
    assert alibi.slopes(8) == [2.0 ** -(i + 1) for i in range(8)]
    np.testing.assert_allclose(alibi.slopes(4), [2.0 ** -(2 * (i + 1)) for i in range(4)])
    six = alibi.slopes(6)  # not a power of two: the 4-head slopes, then every other 8-head slope
    np.testing.assert_allclose(six, alibi.slopes(4) + alibi.slopes(8)[0::2][:2])


# ---- every encoding of the registry, through the model -----------------------------------------------------------
V, NL = 23, 2


def make_model(attn_type, **kw):
    args = dict(n_token=V, n_layer=NL, d_model=DM, n_head=2, d_head=D, d_inner=17, dropout=0.0, dropatt=0.0,
                mem_len=4, max_position=16, attn_type=attn_type)
    args.update(kw)
    keras.utils.set_random_seed(7)
    return TransformerXL(**args)


def tokens(b, t, seed=0):
    return tf.constant(np.random.default_rng(seed).integers(0, V, size=(b, t)), tf.int32)


@pytest.mark.parametrize("attn_type", [name for name in ALL if name != "vaswani"])
def test_token_by_token_equals_one_segment(attn_type):
    """(vaswani cannot: as in the authors' code its positions count back from each call's last token.)"""
    model = make_model(attn_type, untie_r=True, clamp_len=3 if encodings.get(attn_type).clamps else -1)
    x = tokens(2, 6)
    start = model(tokens(2, 3, seed=1))[1]
    full, _ = model(x, start)
    keep_all = model.protocol.replace(mem_len=3 + 6)
    state, steps = start, []
    for t in range(6):
        out, state = model(x[:, t:t + 1], state, protocol=keep_all)
        steps.append(out)
    np.testing.assert_allclose(tf.concat(steps, 1).numpy(), full.numpy(), atol=1e-5)


@pytest.mark.parametrize("attn_type", ALL)
def test_no_gradient_reaches_the_memory(attn_type):
    model = make_model(attn_type)
    x = tokens(2, 3)
    with tf.GradientTape(persistent=True) as tape:
        _, memory = model(x, training=True)
        hidden, _ = model(x, memory, training=True)
        loss = tf.reduce_sum(model.nll(hidden, x))
        total = tf.reduce_sum(memory.hidden)
    assert tape.gradient(total, model.trainable_weights) == [None] * len(model.trainable_weights)
    assert all(g is not None for g in tape.gradient(loss, model.trainable_weights))
    assert isinstance(memory, Memory)


def test_rope_needs_an_even_head_width():
    from txl_tf.base.errors import ConfigError
    from txl_tf.configs import ModelConfig

    with pytest.raises(ValueError, match="d_head must be even"):
        make_model("rope", d_head=5)
    with pytest.raises(ConfigError, match="ModelConfig.attn_type='rope': rope rotates pairs of dimensions: d_head "
                       "must be even, got 5; change ModelConfig.d_head"):
        ModelConfig(attn_type="rope", d_head=5)


def test_the_study_models_have_the_same_parameter_count():
    """Every encoding has a context-study model (gin/study/context_<name>.gin, al_rfou's without memory) within
    the study's 5% of Transformer-XL's parameter count; RoPE and ALiBi have no position weights, so their gin files
    widen d_inner to match, as the vaswani ablation does."""
    import gin

    from txl_tf import configs
    from txl_tf.runs import loading

    counts = {}
    for name in ALL:
        if name == "vaswani":  # an ablation-only encoding (gin/study/ablation_vaswani.gin)
            continue
        configs.parse_configs([f"study/context_{name}.gin"], [])
        model = loading.build_model(configs.ModelConfig(), 200)
        assert model.attn_type == name
        counts[name] = sum(int(np.prod(v.shape)) for v in model.weights)
        gin.clear_config()
    for name, count in counts.items():
        assert abs(count / counts["xl"] - 1) <= 0.05, (name, counts)
