"""The training path chosen by measurement (TrainConfig "auto"): the candidates, a real measurement on this CPU
that picks the fastest and is cached, the trainer's initial weights unchanged by measuring, the choice recorded in
config.gin and kept by a resumed run, and oneDNN's setting measured in child processes."""

import json
import os

import numpy as np
import pytest
from train_utils import prepare_tiny_corpus, tiny_params, tiny_trainer

from txl_tf import autotune, train
from txl_tf.autotune import TrainPath
from txl_tf.configs import TrainConfig

TINY_MODEL = dict(n_token=11, n_layer=1, d_model=16, n_head=2, d_head=8, d_inner=24, dropout=0.1, dropatt=0.0,
                  mem_len=6)


@pytest.fixture(scope="module")
def char_data(tmp_path_factory):
    return prepare_tiny_corpus(str(tmp_path_factory.mktemp("data")), "char")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TXL_TF_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / autotune.CHOICES_FILE


def test_cpu_flags_are_the_first_cpus(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: test CPU\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n\n"
                       "processor\t: 1\nflags\t\t: fpu\n")
    assert autotune.cpu_flags(str(cpuinfo)) == {"fpu", "sse2", "avx2", "avx512f", "avx512_bf16"}  # the first line
    assert autotune.cpu_flags(str(tmp_path / "missing")) == set()


def test_candidates_cover_the_auto_fields_only():
    every = autotune.candidates(TrainConfig())
    assert set(every) == {TrainPath(p, j, "tf") for p in (False, True) for j in (False, True)} | {
        TrainPath(False, False, "fused"), TrainPath(True, False, "fused")}  # no fused kernels under XLA
    assert autotune.candidates(TrainConfig(), fused_why="no compiler") == [
        TrainPath(p, j, "tf") for p in (False, True) for j in (False, True)]
    assert autotune.candidates(TrainConfig(mixed_precision=True, kernels="tf")) == [
        TrainPath(True, False, "tf"), TrainPath(True, True, "tf")]
    assert autotune.candidates(TrainConfig(), accelerators=["GPU"]) == [
        TrainPath(True, False, "tf"), TrainPath(True, True, "tf")]
    assert autotune.candidates(TrainConfig(), accelerators=["TPU"]) == [TrainPath(True, False, "tf")]
    assert autotune.candidates(TrainConfig(mixed_precision=False, jit_compile=False, kernels="fused")) == [
        TrainPath(False, False, "fused")]
    assert autotune.auto_fields(TrainConfig(jit_compile=False)) == ("mixed_precision", "kernels")


def test_a_resume_keeps_the_recorded_path_of_auto_fields_only():
    command = TrainConfig(jit_compile=True)  # mixed_precision and kernels "auto"
    saved = TrainConfig(mixed_precision=True, jit_compile=False, kernels="tf")
    kept = autotune.with_recorded_path(command, saved)
    assert (kept.mixed_precision, kept.jit_compile, kept.kernels) == (True, True, "tf")
    assert autotune.with_recorded_path(command, None) is command
    assert autotune.with_recorded_path(command, TrainConfig()).mixed_precision == "auto"  # nothing recorded


def test_choose_times_each_candidate_picks_the_fastest_and_caches_it(cache):
    config = TrainConfig(tgt_len=5, kernels="tf")
    lines = []
    path, table = autotune.choose(TINY_MODEL, config, 2, log=lines.append, steps=1)
    assert len(table) == 4 and all(rate > 0 for rate in table.values())
    assert table[path.describe()] == max(table.values())
    assert lines[0].startswith("choosing the training path (auto): timing 4 candidates at batch 2 x 5 tokens")
    assert lines[-1].startswith(f"training path (auto): {path.describe()} (")
    entry, = json.loads(cache.read_text()).values()
    assert entry["choice"] == path.bindings() and entry["tokens_per_second"] == table

    again = []
    assert autotune.choose(TINY_MODEL, config, 2, log=again.append)[0] == path
    assert again == [f"training path (auto, measured earlier on this machine; {cache}): {path.describe()}"]
    other = []  # another batch is another measurement
    autotune.choose(TINY_MODEL, config, 4, log=other.append, steps=1)
    assert other[0].startswith("choosing the training path (auto)")


def test_a_measured_trainer_starts_from_the_weights_of_the_same_path_set_explicitly(char_data, cache):
    measured = tiny_trainer(char_data, mixed_precision="auto", jit_compile="auto")
    assert len(measured.path_measured) == 4
    path = measured.path
    assert measured.model.dtype_policy.name == ("mixed_bfloat16" if path.mixed_precision else "float32")
    explicit = tiny_trainer(char_data, **path.bindings())
    assert explicit.path_measured == {}
    for a, b in zip(measured.model.weights, explicit.model.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=a.path)
    measured.start(0)
    assert measured.train_loop(1).loss > 0


@pytest.mark.slow  # ~17 s: three in-process training runs, one of them timing its candidates
def test_a_run_records_the_measured_path_and_a_resume_keeps_it(char_data, cache, tmp_path, capsys):
    model_dir = str(tmp_path / "run")
    auto = {"TrainConfig.mixed_precision": "'auto'", "TrainConfig.jit_compile": "'auto'",
            "TrainConfig.kernels": "'tf'", "TrainConfig.train_steps": 2, "TrainConfig.checkpoint_every": 2}
    train.run(["gin/sample.gin"], tiny_params(char_data, **auto), model_dir)
    first = capsys.readouterr().out
    assert "choosing the training path (auto): timing 4 candidates" in first
    recorded = open(os.path.join(model_dir, "config.gin")).read().rstrip().splitlines()
    assert recorded[-3].startswith("# The path this run trained on (") and "tokens/s" in recorded[-3]
    assert recorded[-2] in ("TrainConfig.mixed_precision = True", "TrainConfig.mixed_precision = False")
    assert recorded[-1] in ("TrainConfig.jit_compile = True", "TrainConfig.jit_compile = False")

    os.remove(autotune.cache_file())  # the resume must not need the cache: config.gin says the path
    train.run(["gin/sample.gin"], tiny_params(char_data, **{**auto, "TrainConfig.train_steps": 4}), model_dir)
    second = capsys.readouterr().out
    assert "resumed from" in second and "training path (auto)" not in second, second
    assert "TrainConfig.train_steps: 2 -> 4" in second and "no longer bit for bit" not in second
    assert "TrainConfig.mixed_precision" not in second and "TrainConfig.jit_compile" not in second
    assert open(os.path.join(model_dir, "config.gin")).read().rstrip().splitlines()[-2:] == recorded[-2:]

    flipped = recorded[-1].endswith("False")  # a command that sets another XLA choice: one line says so
    train.run(["gin/sample.gin"], tiny_params(char_data, **{**auto, "TrainConfig.train_steps": 6,
                                                            "TrainConfig.jit_compile": flipped}), model_dir)
    assert capsys.readouterr().out.count("no longer bit for bit those of an uninterrupted run") == 1


def test_onednn_is_measured_once_and_a_users_setting_is_left_alone(cache, monkeypatch):
    monkeypatch.delenv(autotune.ONEDNN_ENV, raising=False)
    lines = []
    try:
        value = autotune.choose_onednn(lines.append)
        assert value in ("0", "1") and os.environ[autotune.ONEDNN_ENV] == value
        assert lines[0].startswith("measuring TensorFlow's matmul with oneDNN off and on")
        assert lines[1].startswith(f"oneDNN {'on' if value == '1' else 'off'}: square-matmul peak ")
        entry, = json.loads(cache.read_text()).values()
        assert entry["choice"] == value and set(entry["gflops"]) == {"0", "1"}
        assert entry["gflops"][value] >= max(entry["gflops"].values())
        del os.environ[autotune.ONEDNN_ENV]
        again = []
        assert autotune.choose_onednn(again.append) == value and again == []  # the cached choice
    finally:
        os.environ.pop(autotune.ONEDNN_ENV, None)
    monkeypatch.setenv(autotune.ONEDNN_ENV, "0")
    assert autotune.choose_onednn(lines.append) is None and os.environ[autotune.ONEDNN_ENV] == "0"
