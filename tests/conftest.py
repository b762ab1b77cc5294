"""Shared pytest configuration: paths to the shared fixtures and a small TF set-up."""

import os
import pathlib

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _tensorflows_onednn_default() -> str:
    """"1" where TensorFlow's Linux build turns oneDNN on by itself (CPUs with AVX512_VNNI, AVX512_BF16, AVX_VNNI
    or AMX), else "0"."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    return "1" if {"avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16"} & set(flags) else "0"


# The tests and the processes they start run on TensorFlow's own oneDNN default, so that `python -m txl_tf.train`
# does not measure oneDNN in every test process (tests/test_autotune.py tests that measurement).
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", _tensorflows_onednn_default())

import pytest  # noqa: E402

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
# The golden fixtures live in ../shared beside the checkout (not inside the repo).
SHARED = pathlib.Path(os.environ.get("TXL_SHARED_DIR", REPO_ROOT.parent / "shared"))
FIXTURE_DIR = SHARED / "fixtures" / "original_tf_char_small"


@pytest.fixture(autouse=True)
def _no_gin_bindings_left_behind():
    """Clears gin's global configuration after every test: in-process training (`txl_tf.train.run`) leaves its
    bindings behind, and a later test's `ModelConfig()` would build that model instead of the defaults."""
    yield
    import gin

    gin.clear_config()


@pytest.fixture
def autotune_cache(tmp_path, monkeypatch):
    """The training-path cache file of a private TXL_TF_CACHE (not written yet), $TXL_TF_AUTOTUNE unset."""
    from txl_tf.training import autotune

    monkeypatch.setenv("TXL_TF_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(autotune.MEASURE_ENV, raising=False)
    return tmp_path / "cache" / autotune.CHOICES_FILE


@pytest.fixture
def fixture_dir():
    if not (FIXTURE_DIR / "golden.npz").exists():
        pytest.skip(f"golden fixtures not found at {FIXTURE_DIR} (set TXL_SHARED_DIR to the shared/ folder)")
    return FIXTURE_DIR


@pytest.fixture
def read_only():
    """`read_only(folder)` makes `folder` unwritable as a user meets it and returns the reason the system gives:
    chmod 0o555 for a user (EACCES); for root, whom modes do not stop, a read-only bind mount of the folder onto
    itself (EROFS, as on a read-only file system), else the immutable attribute (chattr +i: EPERM). Undone after."""
    import errno
    import subprocess

    undo = []

    def make(folder) -> str:
        folder = str(folder)
        if os.geteuid() != 0:
            os.chmod(folder, 0o555)
            undo.append(lambda: os.chmod(folder, 0o755))
            return os.strerror(errno.EACCES)
        try:
            if subprocess.run(["mount", "--bind", folder, folder], capture_output=True).returncode == 0:
                undo.append(lambda: subprocess.run(["umount", folder], check=True))
                if subprocess.run(["mount", "-o", "remount,bind,ro", folder], capture_output=True).returncode == 0:
                    return os.strerror(errno.EROFS)
            if subprocess.run(["chattr", "+i", folder], capture_output=True).returncode == 0:
                undo.append(lambda: subprocess.run(["chattr", "-i", folder], check=True))
                return os.strerror(errno.EPERM)
        except FileNotFoundError:
            pass
        pytest.skip("running as root, which chmod does not stop, without mount or chattr to make a folder read-only")

    yield make
    for step in reversed(undo):
        step()


def _configure_two_logical_cpus():
    """Split the CPU into 2 logical devices before any op runs, so MirroredStrategy tests have 2 replicas.

    Logical devices share the host thread pools, so single-device tests are unaffected.
    """
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
    except RuntimeError:  # already initialised (e.g. a plugin ran an op first): keep what exists
        pass


_configure_two_logical_cpus()
