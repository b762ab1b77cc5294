"""Converter: parity with the authors' TF code on the golden fixture, CLI, and clear mismatch errors."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from train_utils import REPO_ROOT, make_run, subprocess_env

from txl_tf import TransformerXL, convert
from txl_tf.base import errors
from txl_tf.model import fused
from txl_tf.model.policy import TrainingPolicy

SEGMENTS = 3


def _golden(fixture_dir):
    golden = np.load(fixture_dir / "golden.npz")
    info = json.loads((fixture_dir / "info.json").read_text())["config"]
    return golden, info


def _run_segments(model, golden, tgt_len, training=False, policy=None):
    """Per-segment (nll [L, B], [mem_i [M, B, d]]) time-major like the fixture, starting from zero memory."""
    tokens = golden["tokens"].T  # [B, T] batch-major
    mems = model.initial_memory(tokens.shape[0])
    outputs = []
    for s in range(SEGMENTS):
        inputs = tokens[:, s * tgt_len : (s + 1) * tgt_len]
        targets = tokens[:, s * tgt_len + 1 : (s + 1) * tgt_len + 1]
        hidden, mems = model(inputs, mems, training=training, policy=policy)
        nll = model.nll(hidden, targets).numpy().T  # [L, B]
        outputs.append((nll, [np.transpose(m, (1, 0, 2)) for m in mems.hidden.numpy()]))
    return outputs


# training=True: the pass of a training step (no dropout in this model); with the fused kernels' policy
# (TrainConfig.kernels="fused") it runs the fused CPU kernels (txl_tf/model/fused.py) in place of TensorFlow's ops, and
# must meet the authors' numbers as closely, with the same model (the kernels are not part of the architecture).
@pytest.mark.parametrize("training, fused_kernels", [(False, False), (True, False), (True, True)])
def test_parity_with_original_tf(fixture_dir, training, fused_kernels):
    if fused_kernels and fused.unavailable():
        pytest.skip(f"the fused CPU kernels cannot run here: {fused.unavailable()}")
    golden, info = _golden(fixture_dir)
    model = convert.from_original_tf(str(fixture_dir / "model.ckpt"), mem_len=info["mem_len"])
    assert (model.n_layer, model.d_model, model.n_head, model.d_head, model.d_inner, model.n_token) == (
        info["n_layer"], info["d_model"], info["n_head"], info["d_head"], info["d_inner"], info["n_token"])
    assert model.dropout == 0 and model.dropatt == 0
    policy = TrainingPolicy(kernels=fused_kernels)
    for s, (nll, mems) in enumerate(_run_segments(model, golden, info["tgt_len"], training, policy)):
        np.testing.assert_allclose(nll, golden[f"nll_{s}"], atol=1e-5, rtol=0)
        for i, mem in enumerate(mems):
            np.testing.assert_allclose(mem, golden[f"mem_{s}_{i}"], atol=1e-5, rtol=0)


# The configuration of the golden fixture's checkpoint (shared/fixtures/): n_layer=3, d_model=16, n_head=2, d_head=8, d_inner=32,
# cutoffs=[20, 60], div_val=2, n_token=120, untie_r, tie_projs=[F, T, T].
ADAPTIVE_SHAPES = {
    "r_w_bias": [3, 2, 8], "r_r_bias": [3, 2, 8],
    **{f"adaptive_embed/cutoff_{i}/lookup_table": s for i, s in enumerate([[20, 16], [40, 8], [60, 4]])},
    **{f"adaptive_embed/cutoff_{i}/proj_W": s for i, s in enumerate([[16, 16], [8, 16], [4, 16]])},
    "adaptive_softmax/cutoff_0/b": [20], "adaptive_softmax/cutoff_0/proj": [16, 16],
    "adaptive_softmax/cutoff_0/cluster_W": [2, 16], "adaptive_softmax/cutoff_0/cluster_b": [2],
    "adaptive_softmax/cutoff_1/b": [40], "adaptive_softmax/cutoff_2/b": [60],
    **{f"layer_{i}/{name}": shape for i in range(3) for name, shape in [
        ("rel_attn/qkv/kernel", [16, 48]), ("rel_attn/r/kernel", [16, 16]), ("rel_attn/o/kernel", [16, 16]),
        ("rel_attn/LayerNorm/gamma", [16]), ("rel_attn/LayerNorm/beta", [16]),
        ("ff/layer_1/kernel", [16, 32]), ("ff/layer_1/bias", [32]), ("ff/layer_2/kernel", [32, 16]),
        ("ff/layer_2/bias", [16]), ("ff/LayerNorm/gamma", [16]), ("ff/LayerNorm/beta", [16])]},
}


def write_original_checkpoint(prefix, shapes, extra=None):
    """A checkpoint with the original code's variable names (plus optimizer slots it also wrote)."""
    rng = np.random.default_rng(0)
    values = {"transformer/" + n: rng.normal(size=s).astype(np.float32) for n, s in shapes.items()}
    values["transformer/layer_0/ff/layer_1/kernel/Adam"] = np.zeros([16, 32], np.float32)
    values["global_step"] = np.array(7, np.int64)
    values.update(extra or {})
    names = sorted(values)
    tf.raw_ops.SaveV2(prefix=str(prefix), tensor_names=names, shape_and_slices=[""] * len(names),
                      tensors=[values[n] for n in names])
    return values


def test_adaptive_checkpoint_inferred_and_loaded(tmp_path):
    values = write_original_checkpoint(tmp_path / "model.ckpt", ADAPTIVE_SHAPES)
    model = convert.from_original_tf(str(tmp_path / "model.ckpt"), mem_len=5)
    config = model.get_config()
    expected = dict(n_layer=3, d_model=16, n_head=2, d_head=8, d_inner=32, n_token=120, d_embed=16,
                    cutoffs=[20, 60], div_val=2, untie_r=True, tie_projs=[False, True, True], mem_len=5)
    assert {k: config[k] for k in expected} == expected
    get = lambda name: values["transformer/" + name]  # noqa: E731
    np.testing.assert_array_equal(model.softmax.bias.numpy(), np.concatenate(
        [get(f"adaptive_softmax/cutoff_{i}/b") for i in range(3)]))
    np.testing.assert_array_equal(model.r_r_bias.numpy(), get("r_r_bias"))
    attention = model.blocks[2].attention
    np.testing.assert_array_equal(np.concatenate([attention.query.kernel.numpy(), attention.key.kernel.numpy(),
                                                  attention.value.kernel.numpy()], axis=1),
                                  get("layer_2/rel_attn/qkv/kernel"))
    np.testing.assert_array_equal(attention.position.kernel.numpy(), get("layer_2/rel_attn/r/kernel"))
    np.testing.assert_array_equal(model.blocks[1].feed_forward.outer.bias.numpy(), get("layer_1/ff/layer_2/bias"))
    np.testing.assert_array_equal(model.embedding.tables[2].numpy(), get("adaptive_embed/cutoff_2/lookup_table"))
    np.testing.assert_array_equal(model.softmax.own_projections[0].numpy(), get("adaptive_softmax/cutoff_0/proj"))
    np.testing.assert_array_equal(model.softmax.cluster_kernel.numpy(), get("adaptive_softmax/cutoff_0/cluster_W"))
    x = tf.constant([[0, 19, 20, 59, 60, 119]])
    np.testing.assert_allclose(np.exp(model.log_probs(model(x)[0]).numpy()).sum(-1), 1.0, atol=1e-5)


def test_mismatches_name_the_variable(tmp_path):
    prefix = tmp_path / "model.ckpt"
    write_original_checkpoint(prefix, ADAPTIVE_SHAPES)
    with pytest.raises(convert.OriginalCheckpointError,
                       match=r"transformer/layer_0/ff/layer_1/kernel has shape \[16, 32\].*expects \[16, 64\]"):
        convert.from_original_tf(str(prefix), d_inner=64)
    with pytest.raises(convert.OriginalCheckpointError, match=r"missing variables \['transformer/adaptive_softmax/cutoff_1/proj'\]"):
        convert.from_original_tf(str(prefix), tie_projs=(False, False, True))
    missing = {k: v for k, v in ADAPTIVE_SHAPES.items() if k != "layer_1/rel_attn/o/kernel"}
    write_original_checkpoint(tmp_path / "missing.ckpt", missing)
    with pytest.raises(convert.OriginalCheckpointError, match="missing variables.*layer_1/rel_attn/o/kernel"):
        convert.from_original_tf(str(tmp_path / "missing.ckpt"))
    write_original_checkpoint(tmp_path / "extra.ckpt", ADAPTIVE_SHAPES, {"transformer/layer_0/extra": np.ones(3)})
    with pytest.raises(convert.OriginalCheckpointError, match="unexpected variables.*layer_0/extra"):
        convert.from_original_tf(str(tmp_path / "extra.ckpt"))
    write_original_checkpoint(tmp_path / "outside.ckpt", ADAPTIVE_SHAPES, {"other/w": np.ones(3)})
    with pytest.raises(convert.OriginalCheckpointError, match="unknown variables.*other/w"):
        convert.from_original_tf(str(tmp_path / "outside.ckpt"))


def test_command_line_writes_native_checkpoint(fixture_dir, tmp_path):
    golden, info = _golden(fixture_dir)
    gin_file = tmp_path / "model.gin"
    gin_file.write_text(f"ModelConfig.n_layer = 2\nModelConfig.d_model = 16\nModelConfig.n_head = 2\n"
                        f"ModelConfig.d_head = 8\nModelConfig.d_inner = 32\nModelConfig.mem_len = {info['mem_len']}\n")
    out = tmp_path / "converted"
    result = subprocess.run(
        [sys.executable, "-m", "txl_tf.convert", f"--checkpoint={fixture_dir / 'model.ckpt'}",
         f"--output_dir={out}", f"--gin_file={gin_file}"],
        capture_output=True, text=True, check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    kwargs = json.loads((out / "model_config.json").read_text())
    assert kwargs["n_token"] == 50 and kwargs["mem_len"] == info["mem_len"]
    assert "ModelConfig.mem_len = 7" in (out / "model.gin").read_text()
    model = TransformerXL(**kwargs)
    tf.train.Checkpoint(model=model).restore(tf.train.latest_checkpoint(str(out))).assert_existing_objects_matched()
    nll, _ = _run_segments(model, golden, info["tgt_len"])[0]
    np.testing.assert_allclose(nll, golden["nll_0"], atol=1e-5)


def test_a_file_that_is_not_an_original_checkpoint_is_one_line(tmp_path):
    """This project's own checkpoint, a file of random bytes and a text file named .index: one line naming the file
    and what to do (a UserError; the command prints it and exits with status 2), not a traceback."""
    make_run(tmp_path / "run", [0.0])  # a txl_tf checkpoint: run/ckpt-10
    (tmp_path / "garbage.ckpt").write_bytes(bytes(np.random.default_rng(0).integers(0, 256, 3000, np.uint8)))
    (tmp_path / "text.index").write_text("just some text\n")
    cases = {
        str(tmp_path / "run" / "ckpt-10"): "is a txl_tf checkpoint, not one of the authors' TF code",
        str(tmp_path / "garbage.ckpt"): "cannot be read as a TensorFlow checkpoint",
        str(tmp_path / "text"): "cannot be read as a TensorFlow checkpoint",
    }
    for prefix, expected in cases.items():
        with pytest.raises(errors.UserError) as raised:
            convert.from_original_tf(prefix)
        line = errors.one_line(raised.value)
        assert line.startswith(f"--checkpoint={prefix}") and expected in line, line
    result = subprocess.run([sys.executable, "-m", "txl_tf.convert", f"--checkpoint={tmp_path / 'text'}",
                             f"--output_dir={tmp_path / 'out'}"], cwd=REPO_ROOT, env=subprocess_env(),
                            capture_output=True, text=True, timeout=300)
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert not os.path.exists(tmp_path / "out")
