"""The keras-hub model on JAX and PyTorch does what it does on TensorFlow: a preset saved on TensorFlow loads there
and generates the same text with each deterministic keras-hub sampler (and text with a random one); one `fit` step
on text gives TensorFlow's loss before and after it, `score_text` its figure, LoRA its text and loss (int8
generates); and the preset it saves loads on TensorFlow with the same greedy text.

Each backend runs tests/backend_hub.py in its own process (a process has one Keras backend)."""

import json
import os
import subprocess
import sys

import backend_hub
import pytest
from hub_utils import VOCAB, tiny_lm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _under(backend: str, preset: str, out_dir, *mode, **env_vars) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "PYTHONPATH", "XLA_FLAGS")}
    env.update(KERAS_BACKEND=backend, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO, **env_vars)
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tests", "backend_hub.py"), preset, str(out_dir), *mode],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out_dir / "result.json") as f:
        return json.load(f)


@pytest.mark.parametrize("backend, attn_type", [
    ("torch", "xl"),  # ~45 s here, each other ~35-60 s (JAX compiles each generate function)
    pytest.param("jax", "xl", marks=pytest.mark.slow),
    pytest.param("jax", "vaswani", marks=pytest.mark.slow),  # an absolute encoding: generated eagerly off TensorFlow
    pytest.param("torch", "vaswani", marks=pytest.mark.slow),
])
def test_a_preset_generates_and_fits_alike_on_every_backend(tmp_path, backend, attn_type):
    pytest.importorskip(backend)
    import keras_hub

    lm = tiny_lm(attn_type=attn_type, max_position=64, sequence_length=16)
    preset = str(tmp_path / "tf_preset")
    lm.save_to_preset(preset)
    tf_lm = keras_hub.models.CausalLM.from_preset(preset)
    expected = {**backend_hub.run(tf_lm), **backend_hub.extras(tf_lm)}
    (tmp_path / backend).mkdir()
    got = _under(backend, preset, tmp_path / backend)
    assert got.pop("backend") == backend
    assert sorted(got) == sorted(expected)
    for key, texts in expected.items():
        if key.split("/")[0] in backend_hub.DETERMINISTIC:
            assert got[key] == texts, key
        elif key.startswith(("top_k", "int8")):  # another random stream, another rounding: text of the prompts' rows
            assert len(got[key]) == 2 and all(text.startswith(prompt) and len(VOCAB.encode(text)) == 16
                                              for text, prompt in zip(got[key], backend_hub.PROMPTS, strict=True)), key
    assert got["greedy/ring=True"] == got["greedy/ring=False"]
    assert got["lora/greedy"] == expected["lora/greedy"]
    for key in ("loss_before", "loss_after", "score_text_bpc", "lora/loss_before"):
        assert got[key] == pytest.approx(expected[key], abs=1e-5), key
    assert got["loss_after"] < got["loss_before"] - 0.01  # the step did something
    # The preset the other backend saved (weights after its fit step) loads here with its greedy text.
    again = keras_hub.models.CausalLM.from_preset(str(tmp_path / backend / "preset"))
    again.compile(sampler="greedy")
    trained = lm.__class__.from_preset(preset)
    trained.compile(optimizer=__import__("keras").optimizers.SGD(0.5))
    x, y, weights = trained.preprocessor(backend_hub.TEXTS, sequence_length=16)
    trained.train_on_batch(x, y, weights)
    trained.compile(sampler="greedy")
    assert again.generate(backend_hub.PROMPTS, max_length=16) == trained.generate(backend_hub.PROMPTS, max_length=16)


def test_data_parallel_fit_on_two_jax_devices_gives_one_devices_loss(tmp_path):
    """keras.distribution.DataParallel over two virtual CPU devices: each device a row of the batch, the weights on
    both; the two epochs' losses (the second after an SGD step from the all-reduced gradient) equal one device's."""
    pytest.importorskip("jax")
    preset = str(tmp_path / "preset")
    tiny_lm(sequence_length=16).save_to_preset(preset)
    got = _under("jax", preset, tmp_path, "data_parallel", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    assert got["jax_devices"] == got["devices"] == got["weights_on"] == 2
    assert got["one_device"][1] < got["one_device"][0] - 0.01  # the step did something
    assert got["data_parallel"] == pytest.approx(got["one_device"], abs=1e-5)


def test_model_parallel_fit_with_the_layout_map_gives_one_devices_loss(tmp_path):
    """keras.distribution.ModelParallel with TransformerXLBackbone.get_layout_map on a (1, 2) mesh of two virtual
    CPU devices: the feed-forward and attention projections and the embedding tables split between the devices, the
    LayerNorms replicated; the two epochs' losses equal one device's."""
    pytest.importorskip("jax")
    preset = str(tmp_path / "preset")
    tiny_lm(sequence_length=16, cutoffs=(20,), div_val=2).save_to_preset(preset)
    got = _under("jax", preset, tmp_path, "model_parallel", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    assert got["devices"] == 2
    assert got["specs"] == {"transformer_xl/layer_0/feed_forward/inner/kernel": ["None", "model"],
                            "transformer_xl/layer_0/feed_forward/outer/kernel": ["model", "None"],
                            "transformer_xl/embedding/table_0": ["None", "model"],
                            "transformer_xl/layer_0/attention/layer_norm/gamma": ["None"]}
    assert got["one_device"][1] < got["one_device"][0] - 0.01
    assert got["model_parallel"] == pytest.approx(got["one_device"], abs=1e-5)


def test_the_layout_map_refuses_a_mesh_without_its_axes():
    import keras

    from txl_tf.base.errors import ConfigError
    from txl_tf.lm.hub import TransformerXLBackbone

    mesh = keras.distribution.DeviceMesh((1,), ("data",), keras.distribution.list_devices()[:1])
    with pytest.raises(ConfigError, match="the device mesh has no axis 'model'"):
        TransformerXLBackbone.get_layout_map(mesh)
    with pytest.raises(ConfigError, match="takes a keras.distribution.DeviceMesh, not a str"):
        TransformerXLBackbone.get_layout_map("mesh")
