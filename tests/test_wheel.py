"""The wheel outside the checkout: `pip wheel` builds it, a fresh virtual environment installs it (not editable), and
from a directory outside the checkout the commands prepare a tiny text corpus, train it with the shipped
`--gin_file=sample.gin`, evaluate, generate and export, printing none of TensorFlow's start-up lines.

The fresh environment takes the dependencies (TensorFlow and the rest) from the environment running the tests, by
a path file after its own site-packages, so the test needs no download beyond the build requirements; txl_tf itself
comes only from the wheel.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig

import pytest
import train_utils

from txl_tf.base import cli

REPO_ROOT = pathlib.Path(__file__).absolute().parents[1]
# A line TensorFlow (or absl's C++ log) prints by itself (as in tests/test_packaging.py).
TF_LOG_LINE = re.compile(r"^[IWEF]\d{4} |absl::InitializeLog|oneDNN|cuInit|cuda", re.MULTILINE)


def _run(command: list, cwd, env, timeout: float = 600) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"{command[:4]} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    return result


# slow: builds and installs a wheel, then five commands in subprocesses (about 40 s on 2 cores)
@pytest.mark.slow
def test_the_wheel_prepares_trains_evaluates_generates_and_exports_outside_the_checkout(tmp_path):
    source = tmp_path / "source"  # a copy: building writes build/ and *.egg-info beside pyproject.toml
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, source / name)
    for name in ("txl_tf", "gin"):
        shutil.copytree(REPO_ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "BUILD"))
    build_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-v", "-w", tmp_path / "dist", source],
                 tmp_path, build_env)
    # setuptools stops building projects with the deprecated license table after 2027-02-18: the SPDX string only.
    assert "project.license` as a TOML table is deprecated" not in built.stdout + built.stderr
    assert "License classifiers are deprecated" not in built.stdout + built.stderr
    wheel, = (tmp_path / "dist").glob("txl_tf-*.whl")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], tmp_path, build_env)
    python = venv / "bin" / "python"
    site = pathlib.Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path,
                             build_env).stdout.strip())
    (site / "zz_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index",
          "--ignore-installed", wheel], tmp_path, build_env)

    work = tmp_path / "work"  # outside the checkout: nothing of it on the path or in the working directory
    work.mkdir()
    env = {k: v for k, v in train_utils.subprocess_env().items()
           if k not in ("PYTHONPATH", "TF_CPP_MIN_LOG_LEVEL", cli.TF_LOGS_ENV)}
    where = _run([python, "-c", "import txl_tf, txl_tf.configs as c; print(txl_tf.__file__); print(c.GIN_DIR)"],
                 work, env).stdout.split()
    assert pathlib.Path(where[0]).is_relative_to(site), where
    assert pathlib.Path(where[1]) == site / "txl_tf" / "gin" and (site / "txl_tf/gin/study/ablation.gin").is_file()

    def command(module: str, *flags: str) -> str:
        result = _run([python, "-m", module, *flags], work, env)
        assert not TF_LOG_LINE.search(result.stderr), f"{module} printed TensorFlow's log:\n{result.stderr}"
        return result.stdout

    (work / "corpus.txt").write_text(train_utils.tiny_text())
    command("txl_tf.data.prepare", "--dataset=text", "--source=corpus.txt", "--data_dir=data/tiny",
            f"--cache_dir={tmp_path / 'cache'}")
    assert (work / "data" / "tiny").is_dir()
    params = train_utils.tiny_params("data/tiny")
    command("txl_tf.train", "--gin_file=sample.gin", "--model_dir=runs/tiny", *[f"--gin_param={p}" for p in params])
    assert list((work / "runs" / "tiny").glob("ckpt-6.index"))
    assert "bpc" in command("txl_tf.evaluate", "--model_dir=runs/tiny", "--split=valid")
    text = command("txl_tf.generate", "--model_dir=runs/tiny", "--prompt=the memory", "--max_tokens=8", "--seed=1")
    assert "the memory" in text
    command("txl_tf.export", "--model_dir=runs/tiny", "--export_dir=exported")
    assert (work / "exported" / "saved_model.pb").is_file()
