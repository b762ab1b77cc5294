"""The keras-hub model on one Keras backend, loaded from a preset: what tests/test_hub_backends.py compares across
backends.

    python tests/backend_hub.py PRESET OUT_DIR   (KERAS_BACKEND chosen by the caller)

`run(lm)` generates `PROMPTS` with each deterministic keras-hub sampler (greedy, beam, contrastive; greedy with the
model's cached call and with the ring of keys/values where the backend has it) and a random one (top-k: its tokens
only checked to be text), takes one `fit` step on `TEXTS` with plain SGD (the loss before the step, then
`evaluate`'s loss after it) and returns it all as a dict of JSON values; `extras(lm)` adds `score_text`'s figure, LoRA's and int8's. The script
loads PRESET with `keras_hub.models.CausalLM.from_preset`, runs `run`, saves the model with `save_to_preset` to
OUT_DIR/preset, runs `extras` and writes OUT_DIR/result.json (with `backend`).

    python tests/backend_hub.py PRESET OUT_DIR data_parallel    (JAX, with several devices)
    python tests/backend_hub.py PRESET OUT_DIR model_parallel

write `data_parallel`'s or `model_parallel`'s losses instead.
"""

from __future__ import annotations

import json
import os
import sys

PROMPTS = ["hello world", "ab"]
TEXTS = ["hello world, this is a text", "another text, a longer one to cut"]
# (sampler, compile's generate_ring): the ring only decides on TensorFlow (elsewhere the cached call: the same text)
SAMPLERS = (("greedy", False), ("greedy", True), ("beam", None), ("contrastive", None), ("top_k", None))
DETERMINISTIC = ("greedy", "beam", "contrastive")


def run(lm) -> dict:
    import keras
    import keras_hub

    out = {}
    for name, ring in SAMPLERS:
        sampler = keras_hub.samplers.BeamSampler(num_beams=2) if name == "beam" else name
        lm.compile(sampler=sampler, generate_ring=ring)
        out[f"{name}/ring={ring}"] = lm.generate(PROMPTS, max_length=16)
    lm.compile(optimizer=keras.optimizers.SGD(0.5))
    x, y, weights = lm.preprocessor(TEXTS, sequence_length=16)
    out["loss_before"] = float(lm.train_on_batch(x, y, weights))
    out["loss_after"] = float(lm.evaluate(x, y, sample_weight=weights, verbose=0))
    return out


def extras(lm) -> dict:
    """`score_text`'s figure; LoRA's greedy text and one step's loss; int8's greedy text (changes `lm`)."""
    import keras

    out = {}
    x, y, weights = lm.preprocessor(TEXTS, sequence_length=16)
    out["score_text_bpc"] = float(lm.score_text(TEXTS[0]).bpc)
    # LoRA (keras-hub's enable_lora: B starts at zero, so the text is the trained model's) and a step's loss on it;
    # int8 (Keras's quantize of the dense projections): generation runs (its rounding is each backend's own).
    lm.backbone.enable_lora(2)
    lm.compile(sampler="greedy")
    out["lora/greedy"] = lm.generate(PROMPTS, max_length=16)
    lm.compile(optimizer=keras.optimizers.SGD(0.5))
    out["lora/loss_before"] = float(lm.train_on_batch(x, y, weights))
    lm.quantize("int8")
    lm.compile(sampler="greedy")
    out["int8/greedy"] = lm.generate(PROMPTS, max_length=16)
    return out


def fit_losses(lm) -> list:
    """The loss of each of two `fit` epochs (plain SGD) on TEXTS, a batch of 2 rows."""
    import keras

    lm.compile(optimizer=keras.optimizers.SGD(0.5))
    x, y, weights = lm.preprocessor(TEXTS, sequence_length=16)
    return lm.fit(x, y, sample_weight=weights, batch_size=2, epochs=2, shuffle=False, verbose=0).history["loss"]


def data_parallel(preset: str) -> dict:
    """`fit_losses` on one device, then with `keras.distribution.DataParallel` over every device (JAX: the batch's
    rows split between them, the weights replicated)."""
    import jax
    import keras
    import keras_hub

    one = fit_losses(keras_hub.models.CausalLM.from_preset(preset))
    devices = keras.distribution.list_devices("cpu")
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    lm = keras_hub.models.CausalLM.from_preset(preset)
    sharding = lm.backbone.transformer_xl.embedding.trainable_variables[0].value.sharding
    return {"one_device": one, "data_parallel": fit_losses(lm), "devices": len(devices),
            "weights_on": len(sharding.device_set), "jax_devices": jax.device_count()}


def model_parallel(preset: str) -> dict:
    """`fit_losses` on one device, then under `keras.distribution.ModelParallel` with
    `TransformerXLBackbone.get_layout_map` on a (1, N) mesh of every device (the large weights split between them);
    and how a feed-forward kernel and an embedding table were laid out."""
    import keras
    import keras_hub

    from txl_tf.lm.hub import TransformerXLBackbone

    one = fit_losses(keras_hub.models.CausalLM.from_preset(preset))
    devices = keras.distribution.list_devices("cpu")
    mesh = keras.distribution.DeviceMesh((1, len(devices)), ("batch", "model"), devices)
    keras.distribution.set_distribution(keras.distribution.ModelParallel(
        layout_map=TransformerXLBackbone.get_layout_map(mesh), batch_dim_name="batch"))
    lm = keras_hub.models.CausalLM.from_preset(preset)
    weights = {v.path: v for v in lm.backbone.weights}
    specs = {path: [str(axis) for axis in weights[path].value.sharding.spec] for path in (
        "transformer_xl/layer_0/feed_forward/inner/kernel", "transformer_xl/layer_0/feed_forward/outer/kernel",
        "transformer_xl/embedding/table_0", "transformer_xl/layer_0/attention/layer_norm/gamma")}
    return {"one_device": one, "model_parallel": fit_losses(lm), "devices": len(devices), "specs": specs}


def main(preset: str, out_dir: str, mode: str = "run") -> None:
    import keras
    import keras_hub

    import txl_tf.lm.hub  # noqa: F401  (registers the classes)

    if mode == "data_parallel":
        result = data_parallel(preset)
    elif mode == "model_parallel":
        result = model_parallel(preset)
    else:
        lm = keras_hub.models.CausalLM.from_preset(preset)
        result = run(lm)
        lm.save_to_preset(os.path.join(out_dir, "preset"))  # after run's fit step
        result.update(extras(lm))
    result["backend"] = keras.backend.backend()
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
