"""The model's leaf layers run on one Keras backend: what tests/test_backends.py compares across backends.

    python tests/backend_layers.py IN.npz OUT.npz   (KERAS_BACKEND chosen by the caller)

`run(inputs, weights)` builds the layers (the adaptive embedding and softmax with cutoffs and div_val 2, the
projections, the sinusoid and window encodings, RoPE's rotation, ALiBi's bias, dropout), sets `weights` where given
(names as `run` returns them) and returns (outputs, weights) as NumPy arrays. The script does that with IN.npz's
inputs and weights and writes OUT.npz with `backend` and `tensorflow_loaded` (whether anything imported
TensorFlow) besides the outputs.
"""

from __future__ import annotations

import sys

import numpy as np

N_TOKEN, D_MODEL, CUTOFFS = 50, 16, (10, 30)


def inputs() -> dict:
    rng = np.random.default_rng(0)
    return dict(tokens=rng.integers(0, N_TOKEN, (2, 7)).astype(np.int32),
                targets=rng.integers(0, N_TOKEN, (2, 7)).astype(np.int32),
                hidden=rng.standard_normal((2, 7, D_MODEL)).astype(np.float32),
                heads=rng.standard_normal((2, 3, 7, 8)).astype(np.float32))


def run(given: dict, weights: dict | None = None) -> tuple[dict, dict]:
    import keras

    from txl_tf.model import embedding, projection
    from txl_tf.model import tensor_ops as T
    from txl_tf.model.dropout import Dropout
    from txl_tf.model.encodings import alibi, rope
    from txl_tf.model.encodings.base import window_distances
    from txl_tf.model.softmax import AdaptiveSoftmax

    if weights is None:  # (keras.utils.set_random_seed imports TensorFlow wherever it is installed)
        keras.utils.set_random_seed(0)
    layers = dict(
        embed1=embedding.AdaptiveEmbedding(N_TOKEN, D_MODEL, d_embed=12),
        embed2=embedding.AdaptiveEmbedding(N_TOKEN, D_MODEL, cutoffs=CUTOFFS, div_val=2),
        softmax1=AdaptiveSoftmax(N_TOKEN, D_MODEL, d_embed=12),
        softmax2=AdaptiveSoftmax(N_TOKEN, D_MODEL, cutoffs=CUTOFFS, div_val=2),
        query=projection.projection("query", 10, 0.02),
        value=projection.projection("value", 10, 0.02),
    )
    tokens, hidden = given["tokens"], given["hidden"]
    for name in ("embed1", "embed2"):
        layers[name](tokens)
    for name in ("softmax1", "softmax2"):
        layers[name].build()
    for name in ("query", "value"):
        layers[name].build((None, D_MODEL))
    if weights is not None:
        for name, layer in layers.items():
            layer.set_weights([weights[f"{name}/{i}"] for i in range(len(layer.weights))])
    out = {}
    for i in (1, 2):
        embed, softmax = layers[f"embed{i}"], layers[f"softmax{i}"]
        out[f"embed{i}"] = embed(tokens)
        out[f"nll{i}"] = softmax.nll(hidden, given["targets"], embed.tables, embed.projections)
        out[f"log_probs{i}"] = softmax.log_probs(hidden, embed.tables, embed.projections)
    query, value = layers["query"], layers["value"]
    out["project"] = projection.project(hidden, query, value)
    split = projection.halves(query, value, dtype="float32")
    out["dense_row"] = projection.dense_row(hidden[:1, :1], split)
    out["relative"] = embedding.RelativePositionalEncoding(D_MODEL)(T.constant(9), clamp_len=6)
    out["window"] = window_distances(3, 4, clamp_len=5)
    table = rope.rotation_table(9, 8)
    out["rotation"] = table
    out["rotate_half"] = rope.rotate_half(T.cast(given["heads"], "float32"), table[0][:7], table[1][:7])
    out["alibi_slopes"] = np.asarray(alibi.slopes(6), np.float32)
    dropout = Dropout(0.3, seed=5)
    ones = np.ones((64, 1024), np.float32)
    seed, _, _ = dropout.draw()
    first, again = dropout(ones, training=True, seed=seed), dropout(ones, training=True, seed=seed)
    out["dropout_kept"] = np.mean(np.asarray(keras.ops.convert_to_numpy(first)) > 0, keepdims=True)
    out["dropout_values"] = np.unique(np.asarray(keras.ops.convert_to_numpy(first)))
    out["dropout_same_seed"] = np.array([np.array_equal(keras.ops.convert_to_numpy(first),
                                                        keras.ops.convert_to_numpy(again))])
    out = {k: np.asarray(keras.ops.convert_to_numpy(v)) for k, v in out.items()}
    weights = {f"{name}/{i}": np.asarray(keras.ops.convert_to_numpy(w)) for name, layer in layers.items()
               for i, w in enumerate(layer.weights)}
    return out, weights


def main(source: str, target: str) -> None:
    import keras

    with np.load(source) as f:
        given = {k[len("in/"):]: f[k] for k in f.files if k.startswith("in/")}
        weights = {k[len("w/"):]: f[k] for k in f.files if k.startswith("w/")}
    out, _ = run(given, weights)
    np.savez(target, backend=np.array(keras.backend.backend()),
             tensorflow_loaded=np.array("tensorflow" in sys.modules), **out)


if __name__ == "__main__":
    main(*sys.argv[1:])
