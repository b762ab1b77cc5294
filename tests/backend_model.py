"""A TransformerXL run on one Keras backend: what tests/test_backends.py compares across backends.

    python tests/backend_model.py IN.npz OUT.npz   (KERAS_BACKEND chosen by the caller)

`run(model, tokens, tgt_len, segments)` feeds `segments` segments of `tgt_len` tokens of `tokens` [B, T] through the
model three ways: with the hidden-state memory (inference and a training call: no dropout in the models tested)
and with the keys/values cache, each from the zero state, and returns each segment's per-token NLL [B, L] and
the memory's hidden states [n, B, M, d] (the memory form's) as NumPy arrays, with `gradients`'s loss and gradients.

For each case CASE of IN.npz the script builds `TransformerXL.from_config` of `CASE/config` (JSON), sets its weights
(`CASE/w/0`, `CASE/w/1`, ... in `get_weights()` order), runs `run` on `CASE/tokens` with `CASE/tgt_len` and
`CASE/segments`, and writes OUT.npz: `CASE/...` as `run` names them, `backend` and `tensorflow_loaded`.
"""

from __future__ import annotations

import json
import sys

import numpy as np


def run(model, tokens, tgt_len: int, segments: int) -> dict:
    import keras

    numpy = keras.ops.convert_to_numpy
    out = {}
    for form in ("memory", "training", "cache"):
        state = (model.initial_cache(tokens.shape[0], max_len=tgt_len) if form == "cache"
                 else model.initial_memory(tokens.shape[0]))
        for s in range(segments):
            inputs = tokens[:, s * tgt_len:(s + 1) * tgt_len]
            targets = tokens[:, s * tgt_len + 1:(s + 1) * tgt_len + 1]
            hidden, state = model(inputs, state, training=form == "training")
            out[f"{form}/nll_{s}"] = np.asarray(numpy(model.nll(hidden, targets)))
            if form != "cache":
                out[f"{form}/memory_{s}"] = np.asarray(numpy(state.hidden))
    out.update(gradients(model, tokens, tgt_len))
    return out


def gradients(model, tokens, tgt_len: int) -> dict:
    """The loss and its gradient for each trainable weight (`grad/i`, in `trainable_variables` order) of a
    training call on the second segment of `tokens`, the first one's memory carried: TensorFlow's GradientTape,
    PyTorch's autograd, or JAX's value_and_grad over the weights in a `keras.StatelessScope` (a weight the loss does
    not reach has a zero gradient, as TensorFlow's tape gives None for it and JAX zeros)."""
    import keras

    numpy = keras.ops.convert_to_numpy
    _, memory = model(tokens[:, :tgt_len], model.initial_memory(tokens.shape[0]), training=True)
    inputs, targets = tokens[:, tgt_len:2 * tgt_len], tokens[:, tgt_len + 1:2 * tgt_len + 1]
    variables = model.trainable_variables
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            hidden, _ = model(inputs, memory, training=True)
            loss = tf.reduce_mean(model.nll(hidden, targets))
        grads = tape.gradient(loss, variables)
    elif keras.backend.backend() == "torch":
        import torch

        hidden, _ = model(inputs, memory, training=True)
        loss = keras.ops.mean(model.nll(hidden, targets))
        grads = torch.autograd.grad(loss, [v.value for v in variables], allow_unused=True)
        grads = [keras.ops.zeros_like(v.value) if g is None else g for v, g in zip(variables, grads, strict=True)]
    else:
        import jax

        def loss_of(values):
            with keras.StatelessScope(state_mapping=list(zip(variables, values, strict=True))):
                hidden, _ = model(inputs, memory, training=True)
                return keras.ops.mean(model.nll(hidden, targets))

        loss, grads = jax.value_and_grad(loss_of)([v.value for v in variables])
    return {"loss": np.asarray(numpy(loss)), **{f"grad/{i}": np.asarray(numpy(g)) for i, g in enumerate(grads)}}


def build(config: dict, weights: list, tokens):
    from txl_tf.model.transformer_xl import TransformerXL

    model = TransformerXL.from_config(config)
    model(tokens[:, :1], model.initial_memory(tokens.shape[0]))  # builds every weight
    model.set_weights(weights)
    return model


def main(source: str, target: str) -> None:
    import keras

    out = {}
    with np.load(source) as f:
        for case in sorted({key.split("/")[0] for key in f.files}):
            given = {key[len(case) + 1:]: f[key] for key in f.files if key.startswith(f"{case}/")}
            tokens = given["tokens"]
            weights = [given[f"w/{i}"] for i in range(sum(k.startswith("w/") for k in given))]
            model = build(json.loads(str(given["config"])), weights, tokens)
            results = run(model, tokens, int(given["tgt_len"]), int(given["segments"]))
            out.update({f"{case}/{key}": value for key, value in results.items()})
    np.savez(target, backend=np.array(keras.backend.backend()),
             tensorflow_loaded=np.array("tensorflow" in sys.modules), **out)


if __name__ == "__main__":
    main(*sys.argv[1:])
