"""The keras-hub model on one Keras backend, loaded from a preset: what tests/test_hub_backends.py compares across
backends.

    python tests/backend_hub.py PRESET OUT_DIR   (KERAS_BACKEND chosen by the caller)

`run(lm)` generates `PROMPTS` with each deterministic keras-hub sampler (greedy, beam, contrastive; greedy with the
model's cached call and with the ring of keys/values where the backend has it) and a random one (top-k: its tokens
only checked to be text), takes one `fit` step on `TEXTS` with plain SGD (the loss before the step, then `evaluate`'s loss after it)
and returns it all as a dict of JSON values. The script loads PRESET with `keras_hub.models.CausalLM.from_preset`,
runs `run`, saves the model with `save_to_preset` to OUT_DIR/preset and writes OUT_DIR/result.json (with `backend`).
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


def main(preset: str, out_dir: str) -> None:
    import keras
    import keras_hub

    import txl_tf.lm.hub  # noqa: F401  (registers the classes)

    lm = keras_hub.models.CausalLM.from_preset(preset)
    result = run(lm)
    lm.save_to_preset(os.path.join(out_dir, "preset"))
    result["backend"] = keras.backend.backend()
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
