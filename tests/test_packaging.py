"""What a user outside the checkout meets: the packages and gin files pyproject.toml ships, where the gin files are
found, a missing optional extra as one line, and TensorFlow's start-up lines hidden by the entry points
(tests/test_wheel.py installs the wheel and runs the commands)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest
import train_utils

from txl_tf import configs
from txl_tf.base import cli

REPO_ROOT = pathlib.Path(__file__).absolute().parents[1]
# A line TensorFlow (or absl's C++ log) prints by itself: `I0000 00:00:...`, `E0000 ...`, the absl pre-init warning.
TF_LOG_LINE = re.compile(r"^[IWEF]\d{4} |absl::InitializeLog|oneDNN|cuInit|cuda", re.MULTILINE)


def _env(**extra) -> dict:
    """The test's environment without the logging settings conftest.py and the user may have made."""
    env = {k: v for k, v in train_utils.subprocess_env().items() if k not in ("TF_CPP_MIN_LOG_LEVEL", cli.TF_LOGS_ENV)}
    env.update(extra)
    return env


def test_pyproject_ships_every_package_folder_and_the_gin_files():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    settings = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = set(settings["packages"])
    folders = {".".join(p.relative_to(REPO_ROOT).parts) for p in (REPO_ROOT / "txl_tf").rglob("*")
               if p.is_dir() and p.name != "__pycache__"} | {"txl_tf"}
    gin_folders = {".".join(("txl_tf", *p.relative_to(REPO_ROOT).parts)) for p in (REPO_ROOT / "gin").rglob("*")
                   if p.is_dir()} | {"txl_tf.gin"}
    assert packages == folders | gin_folders
    assert settings["package-dir"] == {"txl_tf.gin": "gin"}
    assert settings["package-data"]["txl_tf.gin"] == ["*.gin"]


def test_the_version_is_pyprojects_and_the_license_an_spdx_string():
    """setuptools stops building a project whose license is the deprecated TOML table after 2027-02-18."""
    import txl_tf

    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert txl_tf.__version__ == project["version"]
    assert project["license"] == "Apache-2.0"


def test_gin_dir_is_the_checkouts_gin_folder_and_gin_files_resolve_from_anywhere(tmp_path, monkeypatch):
    assert pathlib.Path(configs.GIN_DIR) == REPO_ROOT / "gin"
    monkeypatch.chdir(tmp_path)
    for name in ("sample.gin", "gin/sample.gin", "gin/study/ablation_xl.gin", "study/ablation_xl.gin"):
        assert pathlib.Path(configs.resolve_gin_file(name)).samefile(REPO_ROOT / "gin" / name.removeprefix("gin/"))
    with pytest.raises(configs.ConfigError, match=r"gin file 'nothing.gin' not found .*e\.g\. one of .*sample\.gin"):
        configs.resolve_gin_file("nothing.gin")


def test_a_missing_extra_is_one_line_naming_it(tmp_path):
    """`python -m txl_tf.study` where matplotlib cannot be imported (a stand-in package that raises ImportError as
    a missing one does) stops before any run with one line naming the extra."""
    shim = tmp_path / "shim" / "matplotlib"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'matplotlib'\", name='matplotlib')\n")
    env = _env(PYTHONPATH=os.pathsep.join([str(tmp_path / "shim"), str(REPO_ROOT)]))
    result = subprocess.run([sys.executable, "-m", "txl_tf.study", "--study=ablation", "--quick",
                             f"--output_dir={tmp_path / 'out'}"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == "error: the study needs matplotlib: pip install 'txl_tf[analysis]'"
    assert not (tmp_path / "out").exists()


def test_tensorflow_starts_quietly_after_cli_and_loudly_when_asked():
    """Importing txl_tf.base.cli before TensorFlow hides what TensorFlow prints when it starts (the first op included);
    TXL_TF_TF_LOGS=1 leaves TensorFlow's logging alone; our own stderr stays."""
    code = ("import sys, txl_tf.base.cli, tensorflow as tf\n"
            "print(float(tf.constant(1.0) + 1))\n"
            "print('our own line', file=sys.stderr)\n")
    quiet = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=_env(), capture_output=True, text=True,
                           timeout=300)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout.split() == ["2.0"]
    assert quiet.stderr == "our own line\n"
    settings = ("import os, sys, txl_tf.base.cli\n"
                "print(os.environ.get('TF_CPP_MIN_LOG_LEVEL'), any(type(f).__name__ == '_QuietTensorFlowImport'\n"
                "      for f in sys.meta_path))\n")
    for extra, expected in (({}, ["3", "True"]), ({cli.TF_LOGS_ENV: "1"}, ["None", "False"]),
                            ({"TF_CPP_MIN_LOG_LEVEL": "1"}, ["1", "True"])):
        result = subprocess.run([sys.executable, "-c", settings], cwd=REPO_ROOT, env=_env(**extra),
                                capture_output=True, text=True, timeout=120)
        assert result.stdout.split() == expected, (extra, result.stderr)


def test_a_failing_quiet_import_shows_what_it_printed(capfd):
    with cli._stderr_set_aside():
        os.write(2, b"start-up noise\n")
    with pytest.raises(RuntimeError, match="broken"):
        with cli._stderr_set_aside():
            os.write(2, b"why it broke\n")
            raise RuntimeError("broken")
    assert capfd.readouterr().err == "why it broke\n"


@pytest.mark.slow
def test_evaluate_prints_no_tensorflow_start_up_lines(tmp_path):
    """A plain `python -m txl_tf.evaluate` on a tiny run: the command's own lines, none of TensorFlow's."""
    data_dir = train_utils.prepare_tiny_corpus(str(tmp_path))
    train_utils.run_training(str(tmp_path / "run"), train_utils.tiny_params(data_dir))
    result = subprocess.run([sys.executable, "-m", "txl_tf.evaluate", f"--model_dir={tmp_path / 'run'}",
                             "--split=valid"], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "bpc" in result.stdout
    assert not TF_LOG_LINE.search(result.stderr), result.stderr
