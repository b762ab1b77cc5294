"""Expected failures of the entry points end in one `error:` line (exit status 2), checked before the work: a
full disk, a split or batch size the data cannot give, an output path that is a directory, and a run whose own
checkpoints are all damaged (no TensorFlow warnings before the line, and best/ named when it is intact)."""

import errno
import os
import shutil
import subprocess
import sys

import gin
import pytest
import tensorflow as tf
from train_utils import (
    REPO_ROOT,
    prepare_tiny_corpus,
    subprocess_env,
    tiny_params,
    tiny_text,
    train_command,
)

from txl_tf import train
from txl_tf.base import errors

RUN = {"TrainConfig.eval_every": 3, "TrainConfig.checkpoint_every": 3}  # ckpt-3, ckpt-6 and best/ckpt-6


@pytest.fixture(scope="module")
def char_data(tmp_path_factory):
    return prepare_tiny_corpus(str(tmp_path_factory.mktemp("data")), "char")


@pytest.fixture(scope="module")
def damaged_run(char_data, tmp_path_factory):
    """A run whose own checkpoints (ckpt-3, ckpt-6) have one byte of a model weight flipped; best/ is intact."""
    run = tmp_path_factory.mktemp("damaged") / "run"
    train.run(["gin/sample.gin"], tiny_params(char_data, **RUN), str(run))
    gin.clear_config()
    for step in (3, 6):
        prefix = str(run / f"ckpt-{step}")
        reader = tf.train.load_checkpoint(prefix)
        name = max((n for n, _ in tf.train.list_variables(prefix) if n.startswith("model/")),
                   key=lambda n: reader.get_tensor(n).size)
        raw = reader.get_tensor(name).tobytes()  # the bytes of the largest weight, past the object graph
        data = run / f"ckpt-{step}.data-00000-of-00001"
        content = bytearray(data.read_bytes())
        offset = content.find(raw)
        assert offset >= 0 and (run / "best" / f"ckpt-{step}.index").exists() == (step == 6)
        content[offset + len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(content))
    return run


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, *args], cwd=REPO_ROOT, env=subprocess_env(), capture_output=True,
                          text=True, timeout=timeout)


def _one_line(result, name=""):
    """The single `error:` line of a command that exited with status 2 and printed no traceback or TF warning."""
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(lines) == 1, (name, result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr and "WARNING:tensorflow" not in result.stderr, (name, result.stderr)
    return lines[0]


# ---- a full disk -----------------------------------------------------------------------------------------------
@pytest.fixture
def full_disk(tmp_path):
    """A 32 KiB tmpfs: room for a run's config.gin, not for a checkpoint or a TFRecord shard."""
    mount_point = tmp_path / "full"
    mount_point.mkdir()
    try:
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32k", "tmpfs", str(mount_point)],
                                capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("no mount command here to make a small full filesystem")
    if result.returncode != 0:
        pytest.skip(f"a tmpfs cannot be mounted here (needs root with mount permission): {result.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=True)


def _says_full(line, mount_point):
    return ("No space left on device" in line and f"{mount_point} has " in line and "free now, of 32.0 KiB" in line
            and "re-run the same command" in line)


def test_prepare_into_a_full_disk_says_which_and_how_much_is_free(full_disk, tmp_path):
    source = tmp_path / "corpus.txt"
    source.write_text(tiny_text())
    line = _one_line(_run("-m", "txl_tf.data.prepare", "--dataset=text", f"--source={source}",
                          f"--cache_dir={tmp_path}", f"--data_dir={full_disk / 'data'}"))
    assert _says_full(line, full_disk) and str(full_disk / "data") in line, line


@pytest.mark.slow  # ~8 s: a training run; CI's slow phase
def test_training_that_cannot_save_a_checkpoint_on_a_full_disk_says_which(char_data, full_disk):
    line = _one_line(_run(*train_command(str(full_disk / "run"), tiny_params(char_data))[1:]))
    assert _says_full(line, full_disk) and str(full_disk / "run" / "ckpt-") in line, line


def test_a_write_without_a_file_name_names_the_open_file(capsys):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")

    def main(argv):
        with open("/dev/full", "w") as f:  # ENOSPC when closed, without a file name
            f.write("x" * 100)

    with pytest.raises(SystemExit) as exited:
        errors.guard(main)([])
    assert exited.value.code == errors.EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: writing /dev/full failed (No space left on device)"), err


# ---- evaluate's and sweep's split, batch size and output paths, checked before the model is loaded -------------
@pytest.mark.slow  # ~8-16 s of subprocesses; CI runs it in its slow phase
def test_a_bad_split_or_batch_size_is_one_line_before_the_model_is_loaded(damaged_run):
    model = f"--model_dir={damaged_run}"  # its latest checkpoints do not restore: every check here comes first
    cases = {
        "evaluate split": (["-m", "txl_tf.evaluate", model, "--split=bogus"],
                           "--split='bogus'", "pass one of test, train, valid"),
        "sweep split": (["-m", "txl_tf.sweep", model, "--split=bogus", "--grid=mem_len=0,4"],
                        "--split='bogus'", "pass one of test, train, valid"),
        "evaluate batch": (["-m", "txl_tf.evaluate", model, "--gin_param=EvalConfig.batch_size=1000000"],
                           "EvalConfig.batch_size=1000000: 1059 tokens are too few", "at most 1058 fit"),
        "sweep batch": (["-m", "txl_tf.sweep", model, "--grid=batch_size=3,1000000"],
                        "batch_size=1000000: 1059 tokens are too few", "at most 1058 fit"),
    }
    for name, (args, value, fix) in cases.items():
        line = _one_line(_run(*args), name)
        assert value in line and fix in line, (name, line)


@pytest.mark.slow  # ~8-16 s of subprocesses; CI runs it in its slow phase
def test_an_output_path_that_cannot_be_written_is_refused_before_evaluating(damaged_run, tmp_path):
    model = f"--model_dir={damaged_run}"
    (tmp_path / "a_file").write_text("")
    cases = {
        "evaluate": (["-m", "txl_tf.evaluate", model, f"--token_losses={tmp_path}"],
                     f"--token_losses={tmp_path} is a directory"),
        "evaluate parent": (["-m", "txl_tf.evaluate", model, f"--token_losses={tmp_path / 'a_file' / 'nll.npy'}"],
                            f"{tmp_path / 'a_file'} is a file"),
        "sweep json": (["-m", "txl_tf.sweep", model, f"--json={tmp_path}"], f"--json={tmp_path} is a directory"),
        "sweep markdown": (["-m", "txl_tf.sweep", model, f"--markdown={tmp_path}"],
                           f"--markdown={tmp_path} is a directory"),
    }
    for name, (args, expected) in cases.items():
        result = _run(*args)
        assert expected in _one_line(result, name) and "evaluating" not in result.stdout, (name, result.stdout)


# ---- every checkpoint of the run damaged ----------------------------------------------------------------------
@pytest.mark.slow  # ~10 s: a run whose every checkpoint is damaged, four commands; CI's slow phase
def test_damaged_checkpoints_give_one_line_without_warnings_and_name_an_intact_best(char_data, damaged_run,
                                                                                     tmp_path):
    line = _one_line(_run("-m", "txl_tf.evaluate", f"--model_dir={damaged_run}"), "evaluate")
    assert "no checkpoint of" in line and f"{damaged_run / 'best' / 'ckpt-6'} restores intact" in line, line
    assert line.endswith("pass --which=best to use it"), line
    run = tmp_path / "run"
    shutil.copytree(damaged_run, run)
    params = tiny_params(char_data, **RUN, **{"TrainConfig.train_steps": 9})
    line = _one_line(_run(*train_command(str(run), params)[1:]), "train")
    assert "none restores intact" in line and "nothing was changed" in line, line
    assert f"{run / 'best' / 'ckpt-6'} restores intact: evaluate or export it with --which=best" in line, line


# ---- issue 34: a read-only run folder; a changed model; another vocabulary ------------------------------------
@pytest.mark.slow  # ~8 s: two CLI runs; CI's slow phase
def test_a_read_only_run_folder_is_one_line_for_train_and_average(char_data, tmp_path, read_only):
    from train_utils import make_run

    new = tmp_path / "new_run"
    new.mkdir()
    reason = read_only(new)
    line = _one_line(_run(*train_command(str(new), tiny_params(char_data))[1:]), "train")
    assert f"--model_dir={new} is not writable ({reason})" in line and "give a writable --model_dir" in line, line
    run = tmp_path / "run"
    make_run(run, [0.0, 0.5])
    reason = read_only(run)
    line = _one_line(_run("-m", "txl_tf.average", f"--model_dir={run}", "--last=2"), "average")
    assert f"{run} is not writable ({reason})" in line and "--output_dir" in line, line


def test_a_write_refused_by_the_system_is_one_line_naming_the_folder(tmp_path, read_only, capsys):
    folder = tmp_path / "out"
    folder.mkdir()
    reason = read_only(folder)

    def main(argv):
        with open(folder / "results.txt", "w") as f:  # any writer: an OSError naming the file
            f.write("x")

    with pytest.raises(SystemExit) as exited:
        errors.guard(main)([])
    assert exited.value.code == errors.EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {folder} is not writable ({reason})"), err
    assert f"writing {folder / 'results.txt'} failed" in err, err

    def buggy(argv):  # a permission error that names no file is a bug: it keeps its traceback
        raise PermissionError(errno.EACCES, "no file named")

    with pytest.raises(PermissionError):
        errors.guard(buggy)([])


def test_a_file_system_that_refuses_every_user_is_one_line(capsys):
    """sysfs refuses new files to every user, root included: the same paths as a read-only run folder, without
    mount or chattr (so this runs wherever Linux does)."""
    from txl_tf.base.run_lock import RunLock

    if not os.path.isdir("/sys/kernel") or errors.not_writable_reason("/sys") is None:
        pytest.skip("no sysfs refusing writes here")
    with pytest.raises(errors.UserError) as raised:
        RunLock("/sys/txl_tf_run").acquire()
    line = errors.one_line(raised.value)
    assert line.startswith("--model_dir=/sys/txl_tf_run is not writable (") and "give a writable --model_dir" in line

    def main(argv):
        with open("/sys/txl_tf_results.txt", "w") as f:
            f.write("x")

    with pytest.raises(SystemExit):
        errors.guard(main)([])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: /sys is not writable ("), err
    assert "writing /sys/txl_tf_results.txt failed" in err, err


def test_an_edited_architecture_is_one_line_and_nothing_follows_it(char_data, tmp_path):
    run = tmp_path / "run"
    train.run(["gin/sample.gin"], tiny_params(char_data, **{"TrainConfig.train_steps": 2}), str(run))
    gin.clear_config()
    config = run / "config.gin"
    config.write_text(config.read_text().replace("ModelConfig.d_inner = 24", "ModelConfig.d_inner = 32"))
    os.remove(run / "architecture.json")  # a run written before the record (tests/test_architecture_checked.py)
    result = _run("-m", "txl_tf.train", f"--gin_file={config}", f"--model_dir={run}",
                  "--gin_param=TrainConfig.train_steps=4")
    line = _one_line(result, "train")
    assert "ModelConfig.d_inner: 24 in the checkpoint, 32 configured" in line, line
    assert result.stderr.rstrip().splitlines()[-1] == line, result.stderr  # no TensorFlow warning after it


def test_evaluate_on_another_vocabulary_is_one_line(char_data, tmp_path):
    import numpy as np

    from txl_tf.data import pipeline, records
    from txl_tf.data.vocab import Vocab

    run = tmp_path / "run"
    train.run(["gin/sample.gin"], tiny_params(char_data, **{"TrainConfig.train_steps": 2}), str(run))
    gin.clear_config()
    mine = pipeline.load_vocab(char_data).symbols  # random bytes, as many symbols as the run's but other ones
    other = str(tmp_path / "other")
    records.write_prepared(other, dataset="random", vocab=Vocab([b for b in range(256) if b not in mine][:len(mine)],
                                                                "char"),
                           splits={"test": np.random.default_rng(0).integers(0, len(mine), 2000)}, source={},
                           options={})
    result = _run("-m", "txl_tf.evaluate", f"--model_dir={run}", f"--gin_param=DATA_DIR='{other}'", "--noprogress")
    line = _one_line(result, "evaluate")
    assert "another vocabulary" in line and "evaluating" not in result.stdout, (line, result.stdout)


# ---- issue 34: a seed NumPy cannot take; evaluation lengths no machine's memory holds -------------------------
@pytest.mark.slow  # ~10 s of subprocess; CI runs it in its slow phase
def test_a_seed_out_of_range_is_one_line_before_training(char_data, tmp_path):
    run = tmp_path / "run"
    params = tiny_params(char_data, **{"TrainConfig.seed": 99999999999999999999999})
    line = _one_line(_run(*train_command(str(run), params)[1:]), "train")
    assert line == ("error: TrainConfig.seed=99999999999999999999999 must be in [0, 4294967295]; fix the binding "
                    "`TrainConfig.seed = ...` in the gin file or --gin_param"), line
    assert not run.exists()


@pytest.mark.slow  # ~16 s of subprocesses; CI runs it in its slow phase
def test_evaluation_lengths_no_memory_holds_are_one_line_before_the_model_is_built(damaged_run):
    """2**31 - 1 memory positions of a tiny model: terabytes of state on any machine."""
    common = [f"--model_dir={damaged_run}", "--which=best", "--gin_param=EvalConfig.mem_len=2147483647"]
    for name, args in {"evaluate": ["-m", "txl_tf.evaluate", *common],
                       "generate": ["-m", "txl_tf.generate", *common, "--max_tokens=3", "--prompt=the "]}.items():
        result = _run(*args)
        line = _one_line(result, name)
        assert line.startswith("error: EvalConfig.mem_len=2147483647: scoring 1 row(s) in segments of 4 over a memory "
                               "of 2147483647 needs about "), (name, line)
        assert line.endswith("of this machine; lower EvalConfig.mem_len") and "evaluating" not in result.stdout, line
