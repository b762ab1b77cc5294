"""Staged directories (txl_tf.base.staging) and their users: a writer killed with SIGKILL at any moment leaves the target
intact plus marked staging folders that the next run removes; folders of the user beside the target (data.old-2024,
data.tmp-mine) are never touched by prepare, export or average; average is replaced whole; the study's --publish
writes only inside its folder and a bad --readme is refused before anything is written."""

import os
import shutil
import signal
import subprocess
import sys

import pytest
from train_utils import REPO_ROOT, make_run, subprocess_env, tiny_text

from txl_tf import average
from txl_tf.base import staging
from txl_tf.runs import loading
from txl_tf.study import report

USER_FOLDERS = ("old-2024", "tmp-mine")


def _user_folders(target):
    """The user's own folders beside `target` (TARGET.old-2024, TARGET.tmp-mine), each holding a file."""
    paths = []
    for suffix in USER_FOLDERS:
        path = target.parent / f"{target.name}.{suffix}"
        path.mkdir()
        (path / "notes.txt").write_text("mine")
        paths.append(path)
    return paths


def _assert_untouched(paths):
    for path in paths:
        assert (path / "notes.txt").read_text() == "mine", f"{path} was removed"


def _siblings(target):
    return sorted(p for p in os.listdir(target.parent) if p.startswith(target.name + "."))


# ---- staging itself: a writer killed with SIGKILL at each moment --------------------------------------------------
# The child loads staging.py by its path (no TensorFlow import: fast) and kills itself at the named moment.
WRITER = r"""
import importlib.util, os, shutil, signal, sys

spec = importlib.util.spec_from_file_location("staging", sys.argv[1])
staging = importlib.util.module_from_spec(spec)
spec.loader.exec_module(staging)
target, point = sys.argv[2], sys.argv[3]


def die(*_):
    os.kill(os.getpid(), signal.SIGKILL)


marks, mark = [0], staging._mark


def mark_or_die(path, base):
    marks[0] += 1
    if (point, marks[0]) in (("tmp_created", 1), ("old_created", 2)):
        die()  # the folder exists, its marker not yet
    mark(path, base)


staging._mark = mark_or_die
rename, rmtree = os.rename, shutil.rmtree
if point == "between_renames":  # the previous target moved into NAME.old-*, the new one not yet in place
    os.rename = lambda src, dst: (rename(src, dst), ".old-" in os.path.basename(os.path.dirname(dst)) and die())
if point == "swapped":  # the new target in place, the staging folders not yet removed
    staging._discard = die
if point == "discarding":  # the previous target's copy deleted, the markers not yet
    shutil.rmtree = lambda *a, **k: (rmtree(*a, **k), die())
with staging.staged_dir(target) as tmp:
    with open(os.path.join(tmp, "version"), "w") as f:
        f.write("new")
    if point == "writing":
        die()
"""
POINTS = {"tmp_created": "old", "writing": "old", "old_created": "old", "between_renames": "old", "swapped": "new",
          "discarding": "new"}


@pytest.mark.parametrize("point", sorted(POINTS))
def test_a_writer_killed_at_any_moment_leaves_the_target_and_only_its_marked_folders(tmp_path, point):
    target = tmp_path / "out"
    target.mkdir()
    (target / "version").write_text("old")
    mine = _user_folders(target)
    writer = subprocess.run([sys.executable, "-c", WRITER, staging.__file__, str(target), point], timeout=60)
    assert writer.returncode == -signal.SIGKILL
    left = [tmp_path / p for p in _siblings(target) if p.split(".", 1)[1] not in USER_FOLDERS]
    assert left and all((p / staging.MARKER).exists() or not os.listdir(p) for p in left)  # marked (or empty)
    staging.remove_stale(str(target))  # what the next prepare / export / average does first
    assert (target / "version").read_text() == POINTS[point] and os.listdir(target) == ["version"]
    assert _siblings(target) == sorted(p.name for p in mine)
    _assert_untouched(mine)


def test_a_live_writers_marked_folder_is_kept(tmp_path):
    target = tmp_path / "out"
    with staging.staged_dir(str(target)) as tmp:
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            with open(os.path.join(os.path.dirname(tmp), staging.MARKER)) as f:
                marker = f.read()
            live = tmp_path / f"out.tmp-{other.pid}-abcdefgh"  # another process writing the same target
            live.mkdir()
            (live / staging.MARKER).write_text(marker.replace(f'"pid": {os.getpid()}', f'"pid": {other.pid}'))
            assert staging.remove_stale(str(target)) == [] and live.exists()
        finally:
            other.kill()
            other.wait()
        assert staging.remove_stale(str(target)) == [str(live)]  # its writer is gone now; ours is still in use
        assert os.path.isdir(tmp)
    assert os.listdir(target) == [] and _siblings(target) == []


# ---- prepare and export leave the user's folders alone ---------------------------------------------------------
def _prepare(source, data_dir, *extra):
    return subprocess.run([sys.executable, "-m", "txl_tf.data.prepare", "--dataset=text", f"--source={source}",
                           f"--data_dir={data_dir}", *extra], cwd=REPO_ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # CI's slow phase: the fast suite stays near 10 minutes on 2 cores
def test_prepare_keeps_the_users_folders_and_removes_a_killed_preparations(tmp_path):
    source, data_dir = tmp_path / "tiny.txt", tmp_path / "data"
    source.write_text(tiny_text(400))
    mine = _user_folders(data_dir)
    first = _prepare(source, data_dir)
    assert first.returncode == 0, first.stderr[-2000:]
    _assert_untouched(mine)
    killed = subprocess.run([sys.executable, "-c", WRITER, staging.__file__, str(data_dir), "writing"], timeout=60)
    assert killed.returncode == -signal.SIGKILL and len(_siblings(data_dir)) == 3
    again = _prepare(source, data_dir, "--overwrite")  # rebuilt, and swapped in through data.old-*
    assert again.returncode == 0 and f"prepared {data_dir}" in again.stdout, again.stderr[-2000:]
    assert "removed 1 unfinished preparation(s)" in again.stdout
    assert _siblings(data_dir) == sorted(p.name for p in mine)
    _assert_untouched(mine)
    assert staging.MARKER not in os.listdir(data_dir)


@pytest.mark.slow  # ~8-16 s of subprocesses; CI runs it in its slow phase
def test_export_keeps_the_users_folders(tmp_path):
    run = tmp_path / "run"
    make_run(run, [0.0])
    export_dir = tmp_path / "export"
    command = [sys.executable, "-m", "txl_tf.export", f"--model_dir={run}", f"--export_dir={export_dir}"]
    first = subprocess.run(command, cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    mine = _user_folders(export_dir)
    again = subprocess.run(command + ["--overwrite"], cwd=REPO_ROOT, env=subprocess_env(), capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert _siblings(export_dir) == sorted(p.name for p in mine)
    _assert_untouched(mine)
    assert (export_dir / "saved_model.pb").exists() and staging.MARKER not in os.listdir(export_dir)


# ---- average: killed with SIGKILL, re-run --------------------------------------------------------------------------
def _average_killed(run, until, *extra):
    """Runs `python -m txl_tf.average --last=2` and SIGKILLs it as soon as `until(names of run/)` holds; returns
    whether it was killed (False: it finished first)."""
    command = [sys.executable, "-m", "txl_tf.average", f"--model_dir={run}", "--last=2", *extra]
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=subprocess_env(), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        while process.poll() is None:
            if until(run):
                process.send_signal(signal.SIGKILL)
                break
    finally:
        process.wait(timeout=300)
    return process.returncode == -signal.SIGKILL


def _checkpoint_without_record(run):
    """A checkpoint (or its _temp) already written into an averaged* folder whose averaged.json is not."""
    for name in os.listdir(run):
        if name.startswith("averaged"):
            for _, folders, files in os.walk(run / name):
                if any(n.startswith("ckpt-") for n in folders + files) and average.RECORD_FILE not in files:
                    return True
    return False


def _state(directory):
    return {name: (directory / name).read_bytes() for name in sorted(os.listdir(directory))}


def test_average_killed_before_its_record_is_written_can_be_rerun(tmp_path):
    run = tmp_path / "run"
    make_run(run, [0.0, 0.5])
    for _ in range(3):  # the window is short: the average may finish before it is seen
        if _average_killed(run, _checkpoint_without_record):
            break
        shutil.rmtree(run / "averaged")
    else:
        pytest.fail("the average finished three times before its checkpoint was seen")
    prefix = average.average(average.last_checkpoints(str(run), 2), str(run / "averaged"), model_dir=str(run))
    assert prefix == str(run / "averaged" / "ckpt-20")
    assert loading.load_model(str(run / "averaged"))[2] == prefix
    assert _siblings(run / "averaged") == [] and staging.MARKER not in os.listdir(run / "averaged")


def test_average_overwrite_killed_keeps_the_previous_average(tmp_path):
    run = tmp_path / "run"
    make_run(run, [0.0, 0.5])
    average.average(average.last_checkpoints(str(run), 2), str(run / "averaged"), model_dir=str(run))
    previous = _state(run / "averaged")

    def started(path):  # the previous average deleted (before the fix), or the new one's staging folder made
        return not (path / "averaged").exists() or any(".tmp-" in n for n in os.listdir(path))

    assert _average_killed(run, started, "--overwrite")
    assert _state(run / "averaged") == previous
    with pytest.raises(FileExistsError, match="pass --overwrite"):
        average.average(average.last_checkpoints(str(run), 2), str(run / "averaged"), model_dir=str(run))
    assert _state(run / "averaged") == previous and _siblings(run / "averaged") == []
    average.average(average.last_checkpoints(str(run), 1), str(run / "averaged"), model_dir=str(run),
                    overwrite=True)
    assert '"mean_of": 1' in (run / "averaged" / average.RECORD_FILE).read_text()


# ---- study --publish writes only inside its folder ------------------------------------------------------------------
def _study_report(tmp_path, *flags):
    """`python -m txl_tf.study --study=report` on the published results.json (no training)."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    shutil.copyfile(os.path.join(REPO_ROOT, "docs", "reproduction", "results.json"), out / "results.json")
    return subprocess.run([sys.executable, "-m", "txl_tf.study", "--study=report", f"--output_dir={out}", *flags],
                          cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)


def _site(tmp_path, readme_text):
    site = tmp_path / "site"
    (site / "docs").mkdir(parents=True)
    (site / "README.md").write_text(readme_text)
    return site


STALE_BLOCK = f"# project\n\n{report.SUMMARY_BEGIN}\nstale\n{report.SUMMARY_END}\n\nmore\n"


def test_publish_writes_only_inside_its_folder(tmp_path):
    site = _site(tmp_path, STALE_BLOCK)
    result = _study_report(tmp_path, f"--publish={site / 'docs'}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert (site / "README.md").read_text() == STALE_BLOCK
    assert sorted(os.listdir(site)) == ["README.md", "docs"]
    assert sorted(os.listdir(site / "docs")) == ["reproduction", "reproduction.md"]
    assert "results.json" in os.listdir(site / "docs" / "reproduction")


def test_readme_flag_rewrites_only_the_summary_block(tmp_path):
    site = _site(tmp_path, STALE_BLOCK)
    result = _study_report(tmp_path, f"--publish={site / 'docs'}", f"--readme={site / 'README.md'}")
    assert result.returncode == 0, result.stderr[-2000:]
    text = (site / "README.md").read_text()
    assert "stale" not in text and text.startswith("# project\n\n") and text.endswith("\n\nmore\n")
    assert report.missing_markers(text) == []


@pytest.mark.parametrize("readme", ["# project without the block\n", f"# project\n{report.SUMMARY_BEGIN}\n"])
def test_readme_without_the_summary_block_is_one_error_and_nothing_is_written(tmp_path, readme):
    site = _site(tmp_path, readme)
    result = _study_report(tmp_path, f"--publish={site / 'docs'}", f"--readme={site / 'README.md'}")
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert str(site / "README.md") in lines[0] and report.SUMMARY_END in lines[0]
    assert os.listdir(site / "docs") == [] and (site / "README.md").read_text() == readme
    assert os.listdir(tmp_path / "out") == ["results.json"]  # not even the study's own report.md
