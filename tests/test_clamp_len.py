"""clamp_len and the encodings that ignore it (issue 52, item 16): each encoding says whether clamping applies
(`Encoding.clamps`), and a clamp_len > 0 for one that ignores it (shaw, al_rfou) is refused in one line naming
the encoding and the value wherever a protocol is made from a user's config: gin (evaluate, train, generate, export),
a preset's config.json, a keras-hub backbone, a sweep's grid, the model itself. The study never clamps them."""

import json
import os
import subprocess
import sys

import gin
import keras
import numpy as np
import pytest
import tensorflow as tf

from txl_tf import TransformerXL, configs, sweep
from txl_tf.base import errors
from txl_tf.base.errors import ConfigError
from txl_tf.configs import EvalConfig, ModelConfig
from txl_tf.lm import presets
from txl_tf.lm.hub import TransformerXLBackbone
from txl_tf.model import encodings
from txl_tf.model.protocol import Protocol
from txl_tf.runs import run_dir
from txl_tf.study import context

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IGNORING = [name for name in encodings.NAMES if not encodings.get(name).clamps]
SMALL = dict(n_token=11, n_layer=1, d_model=8, n_head=2, d_head=4, d_inner=10, dropout=0.0, dropatt=0.0, mem_len=4)


@pytest.fixture(autouse=True)
def _clean_gin():
    yield
    gin.clear_config()


def test_which_encodings_clamp():
    assert {name for name in encodings.NAMES if encodings.get(name).clamps} == {"xl", "vaswani", "alibi", "rope"}
    assert set(IGNORING) == {"shaw", "al_rfou"}
    for name in encodings.NAMES:
        assert encodings.get(name).clamp_problem(-1) is None and encodings.get(name).clamp_problem(0) is None


@pytest.mark.parametrize("name", ["xl", "vaswani", "alibi", "rope"])
def test_a_clamp_changes_what_the_encodings_that_clamp_compute(name):
    """Distances up to memory + segment - 1 = 8 go past a clamp of 2: the outputs move."""
    keras.utils.set_random_seed(3)
    model = TransformerXL(**SMALL, attn_type=name, init_std=0.5)  # weights large enough for positions to count
    tokens = tf.constant(np.random.default_rng(0).integers(0, 11, [2, 5]), tf.int32)
    _, memory = model(tokens)
    plain, _ = model(tokens, memory, protocol=Protocol(4, -1))
    clamped, _ = model(tokens, memory, protocol=Protocol(4, 2))
    assert np.abs(plain.numpy() - clamped.numpy()).max() > 1e-3


@pytest.mark.parametrize("name", IGNORING)
def test_the_model_refuses_a_clamp_its_encoding_ignores(name):
    with pytest.raises(ValueError, match=f"^clamp_len: attn_type '{name}' ignores clamp_len .*so clamp_len=5 would "
                                         "go unused; pass clamp_len=-1$"):
        TransformerXL(**SMALL, attn_type=name, clamp_len=5)
    model = TransformerXL(**SMALL, attn_type=name, max_position=16)
    tokens = tf.zeros([1, 3], tf.int32)
    with pytest.raises(ValueError, match=f"the protocol's clamp_len: attn_type '{name}' ignores clamp_len .*"
                                         "clamp_len=7 would go unused"):
        model(tokens, protocol=Protocol(4, 7))
    with pytest.raises(ValueError, match="clamp_len=7 would go unused"):
        model.initial_cache(1, Protocol(4, 7), max_len=3)
    model(tokens, protocol=Protocol(4, -1))  # unclamped: fine


@pytest.mark.parametrize("name", IGNORING)
def test_gin_configs_refuse_a_clamp_the_encoding_ignores(name):
    with pytest.raises(ConfigError) as raised:
        configs.parse_configs(gin_params=[f"ModelConfig.attn_type = '{name}'", "EvalConfig.clamp_len = 820"])
    assert errors.one_line(raised.value) == (
        f"EvalConfig.clamp_len=820: attn_type '{name}' ignores clamp_len ({encodings.get(name).clamp}), so "
        "clamp_len=820 would go unused; set EvalConfig.clamp_len to -1, or use an attn_type that clamps (xl, "
        "vaswani, rope, alibi)")
    with pytest.raises(ConfigError, match=f"^ModelConfig.clamp_len=64: attn_type '{name}' ignores clamp_len"):
        ModelConfig(attn_type=name, clamp_len=64)
    made = configs.parse_configs(gin_params=[f"ModelConfig.attn_type = '{name}'", "EvalConfig.clamp_len = -1"])
    assert made.eval.clamp_len == -1
    assert configs.parse_configs(gin_params=["EvalConfig.clamp_len = 820"]).eval.clamp_len == 820  # xl clamps


def test_evaluate_of_a_shaw_run_with_a_clamp_is_one_line(tmp_path):
    """The run's config.gin asks for clamp_len 820 at evaluation (e.g. trained from gin/enwik8.gin with shaw):
    one line before any checkpoint or data is read."""
    run = tmp_path / "run"
    run.mkdir()
    (run / run_dir.CONFIG_FILE).write_text("ModelConfig.attn_type = 'shaw'\nEvalConfig.clamp_len = 820\n")
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.run([sys.executable, "-m", "txl_tf.evaluate", f"--model_dir={run}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert [line for line in proc.stderr.splitlines() if "clamp_len" in line] == [
        f"error: EvalConfig.clamp_len=820: attn_type 'shaw' ignores clamp_len ({encodings.get('shaw').clamp}), so "
        "clamp_len=820 would go unused; set EvalConfig.clamp_len to -1, or use an attn_type that clamps (xl, "
        "vaswani, rope, alibi)"], proc.stderr[-3000:]


def test_a_preset_and_a_backbone_with_a_clamp_for_shaw_are_refused(tmp_path):
    model = dict(SMALL, attn_type="shaw")
    (tmp_path / presets.PRESET_CONFIG).write_text(json.dumps(
        {"format": presets.PRESET_FORMAT, "version": presets.PRESET_VERSION, "model": model,
         "eval": {"tgt_len": 4, "mem_len": 4, "clamp_len": 820}}))
    with pytest.raises(ConfigError, match=f"^{tmp_path / presets.PRESET_CONFIG}: EvalConfig.clamp_len=820: attn_type "
                                          "'shaw' ignores clamp_len"):
        presets.read_preset_config(str(tmp_path))
    with pytest.raises(ConfigError, match="^EvalConfig.clamp_len=820: attn_type 'shaw' ignores clamp_len"):
        TransformerXLBackbone(model, {"tgt_len": 4, "mem_len": 4, "clamp_len": 820})
    backbone = TransformerXLBackbone(model, EvalConfig(tgt_len=4, mem_len=4, clamp_len=-1))
    assert backbone.protocol.clamp_len == -1


def test_a_sweep_grid_with_a_clamp_for_shaw_is_refused_before_the_model_loads(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / run_dir.CONFIG_FILE).write_text("ModelConfig.attn_type = 'shaw'\nEvalConfig.clamp_len = -1\n")
    with pytest.raises(ConfigError, match="^--grid clamp_len=400: attn_type 'shaw' ignores clamp_len"):
        sweep.run(model_dir=str(run), grid=sweep.parse_grid(["clamp_len=-1,400"]))


def test_the_study_clamps_only_the_encodings_that_clamp():
    """Each context-study model's `clamped` (the report's) is its encoding's answer, and the scorer asks the model's
    encoding, so no clamp reaches shaw whatever the study's list says."""
    for model in context.MODELS:
        made = configs.parse_configs([f"study/context_{model.name}.gin"])
        assert model.clamped == encodings.get(made.model.attn_type).clamps, model.name
    shaw = TransformerXL(**SMALL, attn_type="shaw", max_position=16)
    claimed = context.Model("shaw", "Shaw et al.", clamped=True)
    assert not context.Scorer("unused", shaw, claimed, context.QUICK).clamped



def test_a_rope_archive_scored_before_rope_clamped_is_refused_in_one_line():
    """Study v4's first rope archives were scored before rope clamped: every memory at clamp -1 only, no cell at the
    training span's clamp, which the study now scores for rope (docs/study_plan.md, section 4). A study that reads
    such an archive stops in one line naming it and what to remove, rather than reporting without the clamp."""
    settings = context.ContextSettings()
    unclamped = {(split, memory, context.UNCLAMPED): None for split in ("valid", "test") for memory in settings.memories}
    rope = next(m for m in context.MODELS if m.name == "rope")
    assert rope.clamped
    paths = ("a/context_rope.json", "a/context_rope.npz")
    with pytest.raises(context.runs.StudyError, match=r"^a/context_rope.json has no clamped cells \(valid/192/256, "
                                                      r"valid/256/256, valid/384/256, \.\.\.\), which the study scores "
                                                      r"for rope; remove a/context_rope.json and a/context_rope.npz"):
        context._check_clamped_cells(rope, unclamped, settings, paths)
    clamped = {(split, memory, settings.train_span): None for split in ("valid", "test") for memory in settings.memories
               if settings.clamp_matters(memory)}
    context._check_clamped_cells(rope, {**unclamped, **clamped}, settings, paths)  # complete: no error
    shaw = next(m for m in context.MODELS if m.name == "shaw")
    context._check_clamped_cells(shaw, unclamped, settings, paths)  # an encoding that does not clamp needs none
