"""A Transformer-XL beside keras-hub's own models in one process (issue 53, item 1), and the presets and `.keras`
files of txl_tf.lm.hub's earlier, subclassed classes.

Keras turns `keras_hub.models.Backbone` (and `Task`) into subclasses of `Functional` when the first functional
keras-hub model is built; a subclassed Transformer-XL built after that failed to construct, save or load. Each
order runs in a process of its own (a subprocess), so the order is real.
"""

import json
import os
import pathlib
import subprocess
import sys

import keras
import keras_hub
import numpy as np
import pytest
from hub_utils import PROMPTS, plain_greedy, tiny_lm

from txl_tf.data.vocab import Vocab

REPO = pathlib.Path(__file__).resolve().parents[1]
LEGACY = pathlib.Path(__file__).resolve().parent / "data" / "legacy_hub"


def tiny_gpt2():
    """A GPT2CausalLM of random weights and a six-token vocabulary, built offline."""
    vocabulary = {"<|endoftext|>": 0, "a": 1, "b": 2, "c": 3, "\u0120": 4, "ab": 5}
    tokenizer = keras_hub.models.GPT2Tokenizer(vocabulary=vocabulary, merges=["a b"])
    preprocessor = keras_hub.models.GPT2CausalLMPreprocessor(tokenizer, sequence_length=8)
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=6, num_layers=1, num_heads=2, hidden_dim=8,
                                             intermediate_dim=16, max_sequence_length=16)
    return keras_hub.models.GPT2CausalLM(backbone, preprocessor)


def greedy(lm, prompts, max_length):
    """Greedy text (the Transformer-XL without XLA: faster to trace in a test)."""
    extra = {"generate_jit_compile": False} if type(lm).__module__.startswith("txl_tf") else {}
    lm.compile(sampler="greedy", **extra)
    return lm.generate(prompts, max_length=max_length)


def gpt2_round_trip(directory):
    gpt2 = tiny_gpt2()
    expected = greedy(gpt2, ["ab c"], 8)
    gpt2.save_to_preset(os.path.join(directory, "gpt2"))
    loaded = keras_hub.models.CausalLM.from_preset(os.path.join(directory, "gpt2"))
    assert type(loaded) is keras_hub.models.GPT2CausalLM
    assert greedy(loaded, ["ab c"], 8) == expected


def transformer_xl_round_trip(directory):
    """Built, saved (a preset, a .keras file), loaded by each of keras-hub's and Keras' loaders: the same text."""
    from txl_tf.lm.hub import TransformerXLBackbone, TransformerXLCausalLM

    lm = tiny_lm()
    expected = greedy(lm, PROMPTS, 24)
    assert [len(text) for text in expected] == [24, 24]
    preset = os.path.join(directory, "txl")
    lm.save_to_preset(preset)
    lm.backbone.save_to_preset(os.path.join(directory, "txl_backbone"))
    lm.save(os.path.join(directory, "txl.keras"))
    loaded = {
        "CausalLM.from_preset": keras_hub.models.CausalLM.from_preset(preset),
        "TransformerXLCausalLM.from_preset": TransformerXLCausalLM.from_preset(preset),
        "keras.saving.load_model": keras.saving.load_model(os.path.join(directory, "txl.keras")),
        "from_config": TransformerXLCausalLM.from_config(lm.get_config()),
    }
    loaded["from_config"].set_weights(lm.get_weights())
    loaded["from_config"].preprocessor = lm.preprocessor  # a config holds no vocabulary (an asset, as keras-hub's)
    for how, other in loaded.items():
        assert type(other) is TransformerXLCausalLM, how
        assert greedy(other, PROMPTS, 24) == expected, how
    for path in (preset, os.path.join(directory, "txl_backbone")):
        backbone = keras_hub.models.Backbone.from_preset(path)
        assert type(backbone) is TransformerXLBackbone
        for a, b in zip(backbone.get_weights(), lm.backbone.get_weights(), strict=True):
            np.testing.assert_array_equal(a, b)


def scenario(order, directory):
    """The subprocess: both models built, saved, loaded and generating, in `order`."""
    if order == "gpt2_first":
        gpt2_round_trip(directory)
        transformer_xl_round_trip(directory)
    else:
        transformer_xl_round_trip(directory)
        gpt2_round_trip(directory)
        transformer_xl_round_trip(os.path.join(directory, "again"))  # and once more after GPT-2 was built
    print("BOTH MODELS OK")


@pytest.mark.parametrize("order", ["gpt2_first", "transformer_xl_first"])
def test_a_transformer_xl_is_built_saved_loaded_and_generates_beside_gpt2_in_one_process(order, tmp_path):
    code = (f"import sys; sys.path.insert(0, {str(REPO / 'tests')!r}); import test_hub_beside_keras_hub as t; "
            f"t.scenario({order!r}, {str(tmp_path)!r})")
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # this checkout's txl_tf, whatever is installed
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "BOTH MODELS OK" in proc.stdout, proc.stderr[-3000:]


def test_presets_and_keras_files_of_the_subclassed_classes_still_load():
    """tests/data/legacy_hub was written by txl_tf.lm.hub's subclassed Backbone and CausalLM (its README): their
    weights load into today's functional classes, which compute the same log-probabilities, and the same greedy
    text under the generation convention of the day it was written (a zero memory every position attends to: plain
    calls give it). Today's generation starts with an empty memory (docs/evaluation.md): its text is that of the
    same plain calls with the memory masked until read."""
    from txl_tf.lm.hub import TransformerXLBackbone, TransformerXLCausalLM

    expected = np.load(LEGACY / "expected.npz")
    text = json.loads((LEGACY / "expected.json").read_text())
    preset = str(LEGACY / "preset")
    for lm in (keras_hub.models.CausalLM.from_preset(preset), keras.saving.load_model(LEGACY / "lm.keras")):
        assert type(lm) is TransformerXLCausalLM
        # Written on an AVX-512 CPU: an AVX2 one rounds float32 differently (up to 6e-5 apart here); wrong weights: ~1
        np.testing.assert_allclose(lm(expected["tokens"]), expected["log_probs"], atol=1e-4, rtol=0)
        lm.compile(sampler="greedy", generate_jit_compile=False)
        vocab = Vocab([10] + list(range(ord("a"), ord("z") + 1)), "char")
        assert plain_greedy(lm, text["prompts"], text["max_length"], vocab, empty_start=False) == text["greedy"]
        assert lm.generate(text["prompts"], max_length=text["max_length"]) == plain_greedy(
            lm, text["prompts"], text["max_length"], vocab)
    backbone = keras_hub.models.Backbone.from_preset(preset)
    assert type(backbone) is TransformerXLBackbone
    np.testing.assert_allclose(backbone.transformer_xl.log_probs(backbone(expected["tokens"])),
                               expected["log_probs"], atol=1e-4, rtol=0)
