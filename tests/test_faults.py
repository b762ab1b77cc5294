"""A run is never lost and every bad input gets one clear line (issue 9): one test per defect, real checkpoints,
real TFRecords, real subprocesses where the exit status and the printed line are the point."""

import filecmp
import os
import shutil
import subprocess
import sys

import gin
import numpy as np
import pytest
import tensorflow as tf
from train_utils import REPO_ROOT, prepare_tiny_corpus, subprocess_env, tiny_params

from txl_tf import train
from txl_tf.base import errors
from txl_tf.configs import ModelConfig, TrainConfig
from txl_tf.data import corpora, records
from txl_tf.data import prepare as prep
from txl_tf.data.sources import SourceError
from txl_tf.model.protocol import Protocol
from txl_tf.runs import loading, run_dir


@pytest.fixture(scope="module")
def char_data(tmp_path_factory):
    return prepare_tiny_corpus(str(tmp_path_factory.mktemp("data")), "char")


@pytest.fixture(autouse=True)
def _clear_gin():
    yield
    gin.clear_config()


def _train(model_dir, data, **overrides) -> None:
    settings = {"TrainConfig.checkpoint_every": 2, "TrainConfig.keep_checkpoints": 3, **overrides}
    train.run(["gin/sample.gin"], tiny_params(data, **settings), str(model_dir))


def _files(directory, step):
    return sorted(f for f in os.listdir(directory) if f.startswith(f"ckpt-{step}."))


def _snapshot(directory, steps, into):
    os.makedirs(into)
    for step in steps:
        for name in _files(directory, step):
            shutil.copy2(os.path.join(directory, name), os.path.join(into, name))
    return sorted(os.listdir(into))


def _unchanged(directory, copies):
    names = sorted(os.listdir(copies))
    match, mismatch, missing = filecmp.cmpfiles(directory, copies, names, shallow=False)
    return match == names and not mismatch and not missing


# ---- defect 1: a missing latest checkpoint silently discarded the run ----------------------------------------
def test_missing_latest_checkpoint_resumes_from_the_previous_one_and_keeps_older_files(char_data, tmp_path,
                                                                                         capsys):
    run = tmp_path / "run"
    _train(run, char_data)  # ckpt-2, ckpt-4, ckpt-6
    kept = _snapshot(run, (2, 4), tmp_path / "copies")
    for name in _files(run, 6):
        os.remove(run / name)
    capsys.readouterr()
    _train(run, char_data, **{"TrainConfig.train_steps": 12})  # saves 6..12: keep_checkpoints=3 would prune 2, 4
    out = capsys.readouterr().out
    assert f"resumed from {run / 'ckpt-4'} at step 4" in out and "skipped ckpt-6" in out, out
    assert "TrainConfig.train_steps: 6 -> 12" in out
    assert _unchanged(run, tmp_path / "copies"), kept
    assert tf.train.latest_checkpoint(str(run)).endswith("ckpt-12")


def test_missing_state_file_still_resumes_from_the_newest_checkpoint(char_data, tmp_path, capsys):
    run = tmp_path / "run"
    _train(run, char_data, **{"TrainConfig.train_steps": 4})
    os.remove(run / "checkpoint")
    capsys.readouterr()
    _train(run, char_data, **{"TrainConfig.train_steps": 6})
    assert f"resumed from {run / 'ckpt-4'} at step 4" in capsys.readouterr().out
    assert _files(run, 2)  # the checkpoint of the first invocation is not pruned by the second


# ---- defect 2: a corrupt latest checkpoint gave a raw DataLossError / IndexError, no fallback ---------------
def _data_file(run, step):
    return run / [f for f in _files(run, step) if ".data-" in f][0]


@pytest.mark.parametrize("damage", ["flip", pytest.param("truncate", marks=pytest.mark.slow)])  # ~7 s each
def test_corrupt_latest_checkpoint_falls_back_in_train_and_evaluate(char_data, tmp_path, capsys, damage):
    run = tmp_path / "run"
    _train(run, char_data)
    data = _data_file(run, 6)
    content = bytearray(data.read_bytes())
    if damage == "flip":  # every byte of the middle (the model's weights among them, which evaluate reads)
        for i in range(len(content) // 10, len(content) * 9 // 10):
            content[i] ^= 0xFF
    else:
        content = content[: len(content) // 2]
    data.write_bytes(bytes(content))
    model, _, prefix = loading.load_model(str(run))  # evaluate, export and generate load through this
    err = capsys.readouterr().err
    assert prefix.endswith("ckpt-4") and "skipped ckpt-6" in err and data.name in err, err
    _train(run, char_data, **{"TrainConfig.train_steps": 8})
    out = capsys.readouterr().out
    assert "resumed from" in out and "ckpt-4 at step 4" in out and data.name in out, out
    assert (run / run_dir.SET_ASIDE_DIR).is_dir() and not _files(run, 6) == []  # set aside, then saved again
    assert any(data.name in files for _, _, files in os.walk(run / run_dir.SET_ASIDE_DIR))


def test_no_intact_checkpoint_stops_with_one_line_and_changes_nothing(char_data, tmp_path):
    run = tmp_path / "run"
    _train(run, char_data, **{"TrainConfig.train_steps": 4})
    for step in (2, 4):
        _data_file(run, step).write_bytes(b"broken")
    before = {name: (run / name).read_bytes() for name in os.listdir(run) if (run / name).is_file()}
    with pytest.raises(run_dir.RunDirError) as raised:
        _train(run, char_data, **{"TrainConfig.train_steps": 6})
    message = errors.one_line(raised.value)
    assert "ckpt-4, ckpt-2" in message and "none restores intact" in message and "nothing was changed" in message
    assert before == {name: (run / name).read_bytes() for name in os.listdir(run) if (run / name).is_file()}


# ---- defect 3: prepare --overwrite deleted a directory that is not a prepared dataset -----------------------
def test_prepare_overwrite_never_replaces_a_folder_that_is_not_a_dataset(tmp_path):
    source = tmp_path / "corpus.txt"
    source.write_text("some text to prepare\n" * 100)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("precious")
    settings = corpora.PrepareSettings(source=str(source), cache_dir=str(tmp_path))
    for overwrite in (False, True):
        with pytest.raises(FileExistsError) as raised:
            prep.prepare("text", str(mine), settings, overwrite=overwrite)
        assert "pass --overwrite" not in str(raised.value) and "not a prepared dataset" in str(raised.value)
    assert (mine / "thesis.tex").read_text() == "precious"
    prep.prepare("text", str(tmp_path / "data"), settings)
    prep.prepare("text", str(tmp_path / "data"), settings, overwrite=True)  # a dataset is replaced


# ---- defect 4: misspelt bindings were ignored by evaluate, export and generate -----------------------------
def test_misspelt_bindings_are_rejected_by_every_entry_point(char_data, tmp_path):
    run = tmp_path / "run"
    _train(run, char_data, **{"TrainConfig.train_steps": 2})
    for binding, word in (("EvalConfg.mem_len = 384", "EvalConfg"), ("EvalConfig.mem_lenn = 384", "mem_lenn")):
        with pytest.raises(errors.ConfigError, match=word):
            run_dir.read_configs(str(run), gin_params=[binding])
        with pytest.raises(errors.ConfigError, match=word):
            loading.load_model(str(run), gin_params=[binding])
    assert run_dir.read_configs(str(run), gin_params=["EvalConfig.mem_len = 384"]).eval.mem_len == 384


# ---- defect 5: wrong types and ranges failed late ---------------------------------------------------------
@pytest.mark.parametrize("binding, expected", [
    ("ModelConfig.n_layer = 'two'", "ModelConfig.n_layer='two' must be int"),
    ("TrainConfig.train_steps = 10.5", "TrainConfig.train_steps=10.5 must be int"),
    ("ModelConfig.n_head = 0", r"ModelConfig.n_head=0 must be in \[1, 2147483647\]"),
])
def test_bad_types_and_ranges_stop_before_anything_is_written(char_data, tmp_path, binding, expected):
    with pytest.raises(errors.ConfigError, match=expected):
        train.run(["gin/sample.gin"], tiny_params(char_data) + [binding], str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_every_config_field_is_checked():
    with pytest.raises(errors.ConfigError, match=r"ModelConfig.cutoffs=\[3, 2\] must be ascending"):
        ModelConfig(cutoffs=[3, 2])
    with pytest.raises(errors.ConfigError, match="TrainConfig.mixed_precision='yes' must be True, False or 'auto'"):
        TrainConfig(mixed_precision="yes")
    with pytest.raises(errors.ConfigError, match="TrainConfig.jit_compile='xla' must be True, False or 'auto'"):
        TrainConfig(jit_compile="xla")
    with pytest.raises(errors.ConfigError, match=r"TrainConfig.keep_checkpoints=0 must be in \[1, 2147483647\]"):
        TrainConfig(keep_checkpoints=0)


def test_an_architecture_change_in_a_run_directory_is_refused_with_both_values(char_data, tmp_path):
    run = tmp_path / "run"
    _train(run, char_data, **{"TrainConfig.train_steps": 2})
    config = (run / "config.gin").read_text()
    with pytest.raises(errors.ConfigError, match=r"ModelConfig.n_layer=2 .* gives 3"):
        _train(run, char_data, **{"TrainConfig.train_steps": 4, "ModelConfig.n_layer": 3})
    assert (run / "config.gin").read_text() == config


# ---- defect 6: generate's settings and export's directory --------------------------------------------------
def test_generate_settings_are_checked_against_the_vocabulary(char_data):
    from txl_tf.data.pipeline import load_vocab
    from txl_tf.lm.generation import check_settings

    vocab = load_vocab(char_data)
    good = dict(max_tokens=5, temperature=0.0, top_k=len(vocab))
    assert check_settings(vocab, ["the ", "a"], **good) == [vocab.encode("the "), vocab.encode("a")]
    assert check_settings(vocab, "the ", **good) == [vocab.encode("the ")]  # one prompt
    for bad, match in ((dict(temperature=-0.5), "temperature=-0.5 must be >= 0"),
                       (dict(top_k=-1), "top_k=-1 must be between 0"), (dict(top_k=len(vocab) + 1), "top_k"),
                       (dict(max_tokens=0), "max_tokens=0 must be >= 1")):
        with pytest.raises(errors.ConfigError, match=match):
            check_settings(vocab, "the ", **{**good, **bad})
    with pytest.raises(errors.ConfigError, match="outside the char-level vocabulary"):
        check_settings(vocab, "the Ω", **good)


def test_generate_cli_checks_before_loading_the_model(char_data, tmp_path):
    run = tmp_path / "run"
    _train(run, char_data, **{"TrainConfig.train_steps": 2})
    _data_file(run, 2).write_bytes(b"broken")  # loading the model would fail: the setting is reported first
    result = subprocess.run([sys.executable, "-m", "txl_tf.generate", f"--model_dir={run}", "--temperature=-1"],
                            cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: --temperature=-1.0 must be >= 0")
    assert "Traceback" not in result.stderr


@pytest.mark.slow  # ~15 s: three exports; CI's slow phase
def test_export_refuses_an_existing_directory_unless_it_holds_an_export_and_overwrite(tmp_path):
    from txl_tf.export import check_export_dir, export_model, write_export

    model = ModelConfig(n_layer=1, d_model=8, n_head=2, d_head=4, d_inner=8, mem_len=3).build(11)
    model(tf.zeros([1, 2], tf.int32))
    target = tmp_path / "export"
    check_export_dir(str(target), overwrite=False)  # absent: fine
    write_export(lambda d: export_model(model, d, protocol=Protocol(3), max_len=2), str(target))
    with pytest.raises(FileExistsError, match="pass --overwrite"):
        check_export_dir(str(target), overwrite=False)
    check_export_dir(str(target), overwrite=True)
    write_export(lambda d: export_model(model, d, protocol=Protocol(3), max_len=2), str(target), overwrite=True)
    assert (target / "saved_model.pb").exists() and not [p for p in os.listdir(tmp_path) if ".tmp-" in p]
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="never replaced, with or without --overwrite"):
        check_export_dir(str(other), overwrite=True)


# ---- defect 7: prepare's UTF-8 errors, tiny corpora, corrupted shards, stale temporary directories --------
def test_word_level_utf8_error_names_file_and_line(tmp_path):
    source = tmp_path / "corpus.txt"
    source.write_bytes(b"good line\n" * 30 + b"caf\xe9 latin-1\n" + b"more\n" * 10)
    with pytest.raises(SourceError, match=rf"{source} line 31 is not UTF-8"):
        prep.prepare("text", str(tmp_path / "d"), corpora.PrepareSettings(source=str(source), level="word",
                                                                   cache_dir=str(tmp_path)))


def test_a_50_byte_corpus_is_rejected(tmp_path):
    source = tmp_path / "tiny.txt"
    source.write_bytes(b"0123456789" * 5)
    with pytest.raises(SourceError, match="only 50 bytes, too few"):
        prep.prepare("text", str(tmp_path / "d"), corpora.PrepareSettings(source=str(source), cache_dir=str(tmp_path)))
    assert not (tmp_path / "d").exists()


def test_rerun_on_a_corrupted_shard_is_not_already_prepared(tmp_path, capsys):
    data = prepare_tiny_corpus(str(tmp_path), "char")
    shard = os.path.join(data, sorted(f for f in os.listdir(data) if f.startswith("train-"))[0])
    with open(shard, "r+b") as f:
        f.seek(200)
        byte = f.read(1)
        f.seek(200)
        f.write(bytes([byte[0] ^ 0xFF]))
    capsys.readouterr()
    with pytest.raises(records.DataError, match=f"{data} is prepared but damaged: TFRecord shard {shard}"):
        prepare_tiny_corpus(str(tmp_path), "char")
    assert "already prepared" not in capsys.readouterr().out


def test_directories_of_killed_prepares_are_removed_by_the_next_run(tmp_path):
    """Only staging folders carrying txl_tf's marker are removed, and only when their writer is gone: a user's
    folder of the same name pattern stays (tests/test_staging.py covers every kill point)."""
    import json
    import socket

    from txl_tf.base import staging

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()

    def staging_folder(name, pid):
        path = tmp_path / name
        path.mkdir()
        (path / "train-00000-of-00001.tfrecord").write_bytes(b"half written")
        (path / staging.MARKER).write_text(json.dumps({"pid": pid, "host": socket.gethostname(),
                                                       "target": "tiny_char"}))
        return path

    stale = [staging_folder(f"tiny_char.tmp-{dead.pid}-abc123", dead.pid),
             staging_folder(f"tiny_char.old-{dead.pid}-zz", dead.pid)]
    alive = staging_folder(f"tiny_char.tmp-{os.getppid()}-live", os.getppid())  # a preparation still running
    users = tmp_path / "tiny_char.tmp-k2j3h4"  # no marker: a user's folder
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    prepare_tiny_corpus(str(tmp_path), "char")
    assert not any(path.exists() for path in stale) and alive.exists()
    assert (users / "notes.txt").read_text() == "mine"


# ---- defect 8: tracebacks for expected errors; non-TTY progress as one endless line -----------------------
@pytest.mark.slow  # ~8-16 s of subprocesses; CI runs it in its slow phase
def test_expected_errors_print_one_line_and_exit_2(char_data, tmp_path):
    run = tmp_path / "run"
    _train(run, char_data, **{"TrainConfig.train_steps": 2})
    commands = {
        "evaluate": ["-m", "txl_tf.evaluate", f"--model_dir={run}", "--gin_param=EvalConfg.mem_len=384"],
        "train": ["-m", "txl_tf.train", "--gin_file=gin/sample.gin", f"--model_dir={tmp_path / 'new'}",
                  "--gin_param=ModelConfig.n_layer='two'"],
        "prepare": ["-m", "txl_tf.data.prepare", "--dataset=text", f"--data_dir={tmp_path / 'd'}",
                    f"--source={tmp_path / 'missing.txt'}"],
        "flags": ["-m", "txl_tf.evaluate", "--no_such_flag=1"],
    }
    for name, args in commands.items():
        result = subprocess.run([sys.executable, *args], cwd=REPO_ROOT, env=subprocess_env(), capture_output=True,
                                text=True, timeout=120)
        lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, (name, result.stderr)


def test_progress_without_a_terminal_prints_plain_lines(tmp_path):
    import io

    from txl_tf.data.progress import Progress

    stream = io.StringIO()
    progress = Progress("evaluating", 1000, unit="segments", stream=stream, interval=0.0)
    for _ in range(1000):
        progress.update(1, "loss 1.0000")
    progress.close()
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue() and len(lines) == 1001 and max(map(len, lines)) < 200
    assert lines[-1].startswith("evaluating: [") and "loss 1.0000" in lines[-1]


def test_evaluation_progress_is_not_a_keras_progbar_when_piped(char_data, capfd):
    from txl_tf.evaluation import loops as evaluation

    model = ModelConfig(n_layer=1, d_model=8, n_head=2, d_head=4, d_inner=8, mem_len=4).build(40)
    tokens = np.arange(400, dtype=np.int32) % 33
    evaluation.evaluate_tokens(model, tokens, tgt_len=4, protocol=Protocol(4), batch_size=2, progress=True)
    out, err = capfd.readouterr()
    assert "\r" not in out + err and "\x08" not in out + err
    assert err.strip().splitlines()[-1].startswith("evaluating: [##############################] 100.0%")


# ---- issue 34: a changed model or vocabulary is named, not called corrupt; another vocabulary is refused --------
def _random_data(directory, symbols) -> str:
    """A prepared char-level dataset of random ids over the byte values `symbols` (every split 2,000 tokens)."""
    from txl_tf.data.vocab import Vocab

    rng = np.random.default_rng(0)
    splits = {split: rng.integers(0, len(symbols), 2000).astype(np.int32) for split in ("train", "valid", "test")}
    records.write_prepared(str(directory), dataset="random", vocab=Vocab(list(symbols), "char"), splits=splits,
                           source={}, options={})
    return str(directory)


@pytest.fixture(scope="module")
def other_vocab_data(char_data, tmp_path_factory):
    """Random bytes prepared with as many symbols as char_data's vocabulary, but other ones."""
    mine = pipeline_vocab(char_data).symbols
    return _random_data(tmp_path_factory.mktemp("other") / "data", [b for b in range(256) if b not in mine][:len(mine)])


def pipeline_vocab(data_dir):
    from txl_tf.data.pipeline import load_vocab

    return load_vocab(data_dir)


def _contents(directory, ignore=()):
    return {os.path.relpath(os.path.join(root, name), directory): open(os.path.join(root, name), "rb").read()
            for root, _, names in os.walk(directory) for name in names if name not in ignore}


def test_an_edited_architecture_is_named_and_not_called_corrupt(char_data, tmp_path):
    run = tmp_path / "run"
    _train(run, char_data, **{"TrainConfig.train_steps": 4})  # ckpt-2, ckpt-4 (tiny_params: d_inner 24)
    config = run / "config.gin"
    config.write_text(config.read_text().replace("ModelConfig.d_inner = 24", "ModelConfig.d_inner = 32"))
    before = _contents(run)
    with pytest.raises(run_dir.ArchitectureMismatchError, match="ModelConfig.d_inner is 24 there but 32 here"):
        train.run([str(config)], ["TrainConfig.train_steps = 6"], str(run))  # the run's architecture.json says
    assert _contents(run) == before
    os.remove(run / run_dir.ARCHITECTURE_FILE)  # a run written before the record: the checkpoint's shapes tell
    before = _contents(run)
    with pytest.raises(errors.ConfigError) as raised:  # the same command as before, on the edited config.gin
        train.run([str(config)], ["TrainConfig.train_steps = 6"], str(run))
    line = errors.one_line(raised.value)
    assert "ModelConfig.d_inner" in line and "[16, 24] in the checkpoint" in line and "[16, 32] in the model" in line
    assert "is intact" in line and "restore the files" not in line and "move them out" not in line, line
    assert _contents(run) == before
    with pytest.raises(errors.ConfigError, match=r"ModelConfig.d_inner: 24 in the checkpoint, 32 configured"):
        loading.load_model(str(run))  # evaluate, export, generate, average, from_preset


def test_another_vocabulary_size_is_named_and_not_called_corrupt(char_data, tmp_path):
    run = tmp_path / "run"
    _train(run, char_data, **{"TrainConfig.train_steps": 2})
    os.remove(run / run_dir.VOCAB_FINGERPRINT_FILE)  # a run written before fingerprints: the sizes tell
    os.remove(run / run_dir.ARCHITECTURE_FILE)  # (with its architecture.json, n_token's record names the field)
    big = _random_data(tmp_path / "d256", range(256))
    size = len(pipeline_vocab(char_data))
    for call in (lambda: _train(run, big, **{"TrainConfig.train_steps": 4}),
                 lambda: loading.load_model(str(run), gin_params=[f"DATA_DIR = '{big}'"])):
        with pytest.raises(errors.ConfigError) as raised:
            call()
        line = errors.one_line(raised.value)
        assert f"vocabulary size n_token: {size} in the checkpoint, 256 configured" in line, line
        assert "none restores intact" not in line and "restore the files" not in line, line


@pytest.mark.slow  # ~8 s: two trainings; CI's slow phase
def test_another_vocabulary_of_the_same_size_is_refused_unless_asked_for(char_data, other_vocab_data, tmp_path,
                                                                         monkeypatch):
    from txl_tf import TransformerXLCausalLM

    monkeypatch.delenv(run_dir.ALLOW_OTHER_VOCAB_ENV, raising=False)
    run = tmp_path / "run"
    _train(run, char_data, **{"TrainConfig.train_steps": 2})
    assert run_dir.recorded_vocabulary(str(run))["sha256"] == records.vocab_sha256(pipeline_vocab(char_data))
    before = _contents(run)
    other = [f"DATA_DIR = '{other_vocab_data}'"]
    refusals = {
        "resume": lambda: _train(run, other_vocab_data, **{"TrainConfig.train_steps": 4}),
        "evaluate": lambda: loading.load_model(str(run), gin_params=other),
        "from_preset": lambda: TransformerXLCausalLM.from_preset(str(run), gin_param=other),
        "fine-tune": lambda: _train(tmp_path / "finetuned", other_vocab_data,
                                    **{"TrainConfig.init_checkpoint": repr(str(run))}),
    }
    for name, call in refusals.items():
        with pytest.raises(errors.ConfigError) as raised:
            call()
        line = errors.one_line(raised.value)
        assert "another vocabulary" in line and str(run / run_dir.VOCAB_FINGERPRINT_FILE) in line, (name, line)
        assert f"{other_vocab_data}/vocab.json" in line and run_dir.ALLOW_OTHER_VOCAB_ENV in line, (name, line)
    assert _contents(run) == before  # the resume is refused before anything in the run folder changes
    assert not any(name.startswith("ckpt-") for name in os.listdir(tmp_path / "finetuned"))
    monkeypatch.setenv(run_dir.ALLOW_OTHER_VOCAB_ENV, "1")  # asked for
    assert loading.load_model(str(run), gin_params=other)[2].endswith("ckpt-2")
    monkeypatch.delenv(run_dir.ALLOW_OTHER_VOCAB_ENV)
    os.remove(run / run_dir.VOCAB_FINGERPRINT_FILE)  # a run written before fingerprints keeps working
    assert loading.load_model(str(run), gin_params=other)[2].endswith("ckpt-2")
    _train(run, char_data, **{"TrainConfig.train_steps": 4})  # and records its vocabulary when it resumes
    assert run_dir.recorded_vocabulary(str(run))["sha256"] == records.vocab_sha256(pipeline_vocab(char_data))
