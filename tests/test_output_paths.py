"""Output folders at the edges of what a file system allows (issue 52, item 11): a valid name of up to 255 bytes is
written by every writer (its staging siblings get short names), a longer one, a read-only parent and a file where a
folder belongs are one line naming the path and the fix, and nothing is left behind."""

import json
import os
import subprocess
import sys

import pytest
from train_utils import REPO_ROOT, make_run, subprocess_env, tiny_text

from txl_tf import TransformerXLCausalLM, average
from txl_tf.base import paths, staging
from txl_tf.base.errors import UserError
from txl_tf.configs import EvalConfig, ModelConfig
from txl_tf.data import corpora, prepare
from txl_tf.data.vocab import Vocab
from txl_tf.runs import loading

LONGEST = "p" * 255  # the longest name ext4, xfs, btrfs and tmpfs allow: NAME.tmp-<pid>-xxxxxxxx would not fit


@pytest.fixture(scope="module")
def lm():
    config = ModelConfig(n_layer=1, d_model=8, n_head=2, d_head=4, d_inner=16, mem_len=4, n_token=20, dropout=0.0)
    return TransformerXLCausalLM.from_parts(loading.build_model(config), config,
                                            EvalConfig(tgt_len=4, mem_len=4, batch_size=1),
                                            Vocab(list(range(20)), "char"))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("run") / "run"
    make_run(folder, [0.0, 1.0])
    return folder


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("source") / "tiny.txt"
    path.write_text(tiny_text(300))
    return path


def _writers(lm, run, source, overwrite=False) -> dict:
    """{what: write(folder)} for the Python writers of a folder: save_to_preset, prepare, average."""
    settings = corpora.PrepareSettings(source=str(source), level="char", cache_dir=str(source.parent))
    return {
        "save_to_preset": lambda folder: lm.save_to_preset(folder, overwrite=overwrite),
        "prepare": lambda folder: prepare.prepare("text", folder, settings, overwrite=overwrite),
        "average": lambda folder: average.average(average.last_checkpoints(str(run), 2), folder, model_dir=str(run),
                                                  overwrite=overwrite),
    }


def test_a_valid_name_of_255_bytes_is_written_and_replaced_by_every_writer(tmp_path, lm, run, source):
    for what in ("save_to_preset", "prepare", "average"):
        parent = tmp_path / what
        parent.mkdir()
        target = parent / LONGEST
        for overwrite in (False, True):  # a new folder, then a replacement (the previous one staged aside)
            _writers(lm, run, source, overwrite)[what](str(target))
            assert os.listdir(parent) == [LONGEST], (what, os.listdir(parent))  # no staging folder, no lock
        assert paths.read_manifest(str(target)) is not None


def test_a_name_longer_than_the_file_system_allows_is_one_line(tmp_path, lm, run, source):
    target = tmp_path / ("p" * 256)
    for what, write in _writers(lm, run, source).items():
        with pytest.raises(paths.PathError) as raised:
            write(str(target))
        line = str(raised.value)
        assert "\n" not in line and "is 256 bytes long" in line and "give a shorter name" in line, (what, line)
    assert os.listdir(tmp_path) == []


def test_a_read_only_parent_is_one_line_and_nothing_is_written(tmp_path, lm, run, source, read_only):
    folder = tmp_path / "read_only"
    folder.mkdir()
    reason = read_only(folder)
    for what, write in _writers(lm, run, source).items():
        for target in (folder / "out", folder / "new" / "out"):  # in it, and in a folder to be made in it
            with pytest.raises(UserError) as raised:
                write(str(target))
            line = str(raised.value)
            assert "\n" not in line and f"{folder} is not writable ({reason})" in line, (what, line)
            assert "writable" in line.rsplit(";", 1)[-1], line  # the fix
    assert os.listdir(folder) == []


def test_a_file_where_a_folder_belongs_is_one_line(tmp_path, lm, run, source):
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    for what, write in _writers(lm, run, source).items():
        for target in (file / "out", file / "deeper" / "out"):
            with pytest.raises(paths.PathError) as raised:
                write(str(target))
            line = str(raised.value)
            assert "\n" not in line and f"{file} is a file, not a folder; give a path in a folder" in line, (what, line)
    assert file.read_text() == "mine" and sorted(os.listdir(tmp_path)) == ["notes.txt"]


def test_staging_names_fit_the_file_system(tmp_path):
    """The siblings of a long name are named after a cut of it and a hash of all of it: two names alike but for
    their last byte get distinct siblings, and each write leaves only its own target."""
    first, second = "a" * 254 + "1", "a" * 254 + "2"
    assert staging.stem(str(tmp_path), "short") == "short"
    stems = {staging.stem(str(tmp_path), name) for name in (first, second)}
    assert len(stems) == 2 and all(len(stem) + 32 <= 255 for stem in stems)
    with staging.staged_dir(str(tmp_path / first)) as outer:
        with staging.staged_dir(str(tmp_path / second)) as inner:  # both staged at once: no clash
            for folder, name in ((outer, first), (inner, second)):
                with open(os.path.join(folder, "name"), "w") as f:
                    f.write(name)
    assert sorted(os.listdir(tmp_path)) == [first, second]
    assert all((tmp_path / name / "name").read_text() == name for name in (first, second))


def test_convert_writes_a_valid_name_of_255_bytes(fixture_dir, tmp_path):
    target = tmp_path / LONGEST
    result = subprocess.run([sys.executable, "-m", "txl_tf.convert", f"--checkpoint={fixture_dir / 'model.ckpt'}",
                             f"--output_dir={target}"], cwd=REPO_ROOT, env=subprocess_env(), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert os.listdir(tmp_path) == [LONGEST] and json.loads((target / "model_config.json").read_text())
