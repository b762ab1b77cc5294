"""Presets of txl_tf's earlier format (config.json with "format": "txl_tf.preset", model.weights.h5, vocab.json),
written here for the tests that show they still load: the package itself writes only keras-hub's presets."""

import dataclasses
import json
import os

from txl_tf.configs import architecture
from txl_tf.lm.presets import (
    PRESET_CONFIG,
    PRESET_FORMAT,
    PRESET_VERSION,
    PRESET_VOCAB,
    PRESET_WEIGHTS,
)


def write_legacy_preset(directory, model, vocab, model_config, eval_config) -> str:
    """Writes an earlier-format preset of a built `TransformerXL` into the new folder `directory`; returns it."""
    directory = os.fspath(directory)
    os.makedirs(directory)
    config = {"format": PRESET_FORMAT, "version": PRESET_VERSION, "model": dataclasses.asdict(model_config),
              "eval": dataclasses.asdict(eval_config), "architecture": architecture(model)}
    with open(os.path.join(directory, PRESET_CONFIG), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    model.save_weights(os.path.join(directory, PRESET_WEIGHTS))
    vocab.save(os.path.join(directory, PRESET_VOCAB))
    return directory
