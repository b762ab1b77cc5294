"""Files someone else made are read, never run: a run folder's config.gin (and any gin file or binding) may not
import modules, malformed gin is one line, and the fused kernels' cache loads only a library this user built.
Real gin files and run folders, a real `python -m` subprocess where the exit status and the printed line are the
point, and a real shared library whose constructor leaves a marker when something loads it."""

import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import uuid

import gin
import pytest
from train_utils import REPO_ROOT, subprocess_env, tiny_params

from txl_tf import configs
from txl_tf.base import untrusted
from txl_tf.base.errors import ConfigError
from txl_tf.model import fused
from txl_tf.runs import run_dir

ALLOW_IMPORTS = "TXL_TF_GIN_ALLOW_IMPORTS"  # the opt-in (configs.ALLOW_IMPORTS_ENV)
REFUSAL = "gin files may not import modules (a run folder someone sends must be as safe as a checkpoint)"


def _error_lines(stderr: str) -> list:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def _evil_module(directory, marker) -> str:
    """A module in `directory` (put on sys.path) that writes `marker` when imported; returns its (unique) name."""
    name = f"evil_{uuid.uuid4().hex[:8]}"
    (directory / f"{name}.py").write_text(f"open({str(marker)!r}, 'w').write('evil ran')\n")
    return name


@pytest.fixture
def evil(tmp_path, monkeypatch):
    """(module name, marker path): the module is importable from sys.path and the working directory."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(ALLOW_IMPORTS, raising=False)
    marker = tmp_path / "evil_ran"
    name = _evil_module(tmp_path, marker)
    yield name, marker
    sys.modules.pop(name, None)


def _run_folder(directory, first_line: str) -> str:
    """A run folder whose config.gin is the one training writes for the tiny sample setup, `first_line` first."""
    configs.parse_configs(["gin/sample.gin"], tiny_params(str(directory / "data")))
    text = gin.config_str()
    gin.clear_config()
    run_dir.write_config(str(directory), f"{first_line}\n{text}")
    return str(directory)


# ---- D1: a run folder's config.gin imported (ran) any module it named ------------------------------------------
def test_evaluate_refuses_a_run_folder_whose_config_imports_a_module(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    marker = tmp_path / "evil_ran"
    (work / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('evil ran')\n")
    copy = _run_folder(tmp_path / "copy", "import evil")
    result = subprocess.run([sys.executable, "-m", "txl_tf.evaluate", f"--model_dir={copy}"], cwd=work,
                            env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert not marker.exists(), "evil.py ran"
    assert result.returncode == 2, result.stderr
    assert _error_lines(result.stderr) == [
        f"error: {os.path.join(copy, 'config.gin')}:1: 'import evil' — {REFUSAL}; remove the line or set "
        "TXL_TF_GIN_ALLOW_IMPORTS=1 to allow it"], result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("statement,where", [
    ("import {m}", "config.gin"), ("import {m} as alias", "config.gin"), ("from {m} import thing", "gin_file"),
    ("import {m}", "included"), ("import {m}", "binding"), ("from {m} import thing as alias", "binding"),
])
def test_import_statements_are_refused_before_gin_runs_them(evil, tmp_path, statement, where):
    name, marker = evil
    line = statement.format(m=name)
    model_dir, files, params = str(tmp_path), [], ["EvalConfig.batch_size = 2"]
    if where == "config.gin":
        run_dir.write_config(model_dir, f"{line}\nEvalConfig.mem_len = 8\n")
        named = f"{tmp_path / 'config.gin'}:1"
    elif where == "gin_file":
        (tmp_path / "extra.gin").write_text(f"include 'sample.gin'\n{line}\n")
        files, named = [str(tmp_path / "extra.gin")], f"{tmp_path / 'extra.gin'}:2"
        model_dir = None
    elif where == "included":  # found by gin's search path (the including file's folder), as gin would find it
        (tmp_path / "inner.gin").write_text(f"EvalConfig.mem_len = 8\n\n{line}\n")
        (tmp_path / "outer.gin").write_text("include 'sample.gin'\ninclude 'inner.gin'\n")
        files, named = [str(tmp_path / "outer.gin")], f"{os.path.join(os.getcwd(), 'inner.gin')}:3"
        model_dir = None
    else:
        files, params, model_dir = ["gin/sample.gin"], [*params, line], None
        named = f"gin binding {line!r}"
    with pytest.raises(ConfigError) as raised:
        run_dir.read_configs(model_dir, files, params)
    assert not marker.exists() and name not in sys.modules, f"{name} was imported"
    assert str(raised.value) == (f"{named}: {line!r} — {REFUSAL}; remove the line or set TXL_TF_GIN_ALLOW_IMPORTS=1 "
                                 "to allow it")


def test_imports_run_only_with_the_opt_in(evil, tmp_path, monkeypatch):
    name, marker = evil
    run_dir.write_config(str(tmp_path), f"import {name}\nEvalConfig.mem_len = 8\n")
    monkeypatch.setenv(ALLOW_IMPORTS, "perhaps")
    with pytest.raises(ConfigError, match=f"^{ALLOW_IMPORTS}='perhaps' is not a switch"):
        run_dir.read_configs(str(tmp_path))
    assert not marker.exists()
    monkeypatch.setenv(ALLOW_IMPORTS, "1")
    assert run_dir.read_configs(str(tmp_path)).eval.mem_len == 8
    assert marker.exists()  # the user's own choice: gin imported the module


# ---- D9: a malformed binding or gin file was a tokenize/gin traceback ------------------------------------------
def test_train_reports_a_malformed_binding_in_one_line(tmp_path):
    binding = "TrainConfig.learning_rate=((("
    result = subprocess.run([sys.executable, "-m", "txl_tf.train", "--gin_file=gin/sample.gin",
                             f"--model_dir={tmp_path / 'run'}", f"--gin_param={binding}"], cwd=REPO_ROOT,
                            env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert _error_lines(result.stderr) == [
        f"error: gin binding {binding!r}: bad gin syntax (EOF in multi-line statement); write each binding as "
        "Configurable.parameter = value, e.g. TrainConfig.learning_rate = 2.5e-4"], result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("binding,detail", [
    ("TrainConfig.learning_rate=(((", "EOF in multi-line statement"),
    ("TrainConfig.learning_rate = '''", "EOF in multi-line string"),
    ("TrainConfig.learning_rate 3", "Couldn't parse statement"),
    ("TrainConfig.learning_rate = 1 2", "Expected newline"),
])
def test_malformed_bindings_are_one_config_error_naming_them(binding, detail):
    with pytest.raises(ConfigError) as raised:
        configs.parse_gin(["gin/sample.gin"], [binding])
    message = str(raised.value)
    assert message.startswith(f"gin binding {binding!r}: bad gin syntax ({detail}") and "\n" not in message
    assert message.endswith("write each binding as Configurable.parameter = value, e.g. "
                            "TrainConfig.learning_rate = 2.5e-4")


def test_malformed_gin_files_name_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.gin"
    bad.write_text("include 'sample.gin'\nTrainConfig.batch_size = 4\nTrainConfig.learning_rate = [1,\n")
    with pytest.raises(ConfigError, match=f"^{re.escape(str(bad))}:3: bad gin syntax \\(EOF in multi-line statement"):
        configs.parse_gin([str(bad)])
    missing = tmp_path / "missing.gin"
    missing.write_text("TrainConfig.batch_size = 4\ninclude 'no_such_setup.gin'\n")
    with pytest.raises(ConfigError, match=f"^{re.escape(str(missing))}:2: include 'no_such_setup.gin' not found"):
        configs.parse_gin([str(missing)])
    loop = tmp_path / "loop.gin"
    loop.write_text(f"include '{loop}'\n")
    with pytest.raises(ConfigError, match=f"^{re.escape(str(loop))} includes itself"):
        configs.parse_gin([str(loop)])


# ---- D2: the fused kernels' cache loaded a library another user could have planted -----------------------------
PLANTED = """
#include <cstdio>
#include <cstdlib>
__attribute__((constructor)) static void planted() {
  const char* path = std::getenv("TXL_TF_TEST_PLANTED_MARKER");
  if (path) { std::FILE* f = std::fopen(path, "a"); if (f) { std::fputs("planted library ran\\n", f); std::fclose(f); } }
}
"""


def _build_library(tmp_path_factory, name: str, says: str) -> bytes:
    """The bytes of a shared library whose constructor appends `says` to $TXL_TF_TEST_PLANTED_MARKER."""
    compiler = fused._compiler()
    if compiler is None:
        pytest.skip("no C++ compiler to build the test libraries (CI installs g++)")
    directory = tmp_path_factory.mktemp(name)
    (directory / f"{name}.cc").write_text(PLANTED.replace("planted library ran", says))
    subprocess.run([compiler, "-shared", "-fPIC", str(directory / f"{name}.cc"), "-o", str(directory / f"{name}.so")],
                   check=True, capture_output=True)
    return (directory / f"{name}.so").read_bytes()


@pytest.fixture(scope="module")
def planted_library(tmp_path_factory):
    """A shared library whose constructor appends to $TXL_TF_TEST_PLANTED_MARKER when it is loaded."""
    return _build_library(tmp_path_factory, "planted", "planted library ran")


@pytest.fixture
def kernel_env(tmp_path, monkeypatch):
    """A failing compiler (`false`: nothing is compiled), a private temporary directory and the marker's path."""
    monkeypatch.setenv("CXX", "false")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    marker = tmp_path / "planted_ran"
    monkeypatch.setenv("TXL_TF_TEST_PLANTED_MARKER", str(marker))
    return marker


def _plant(planted_library, root, mode=0o600):
    """Puts the planted library where fused looks for its build: the key's folder, made by a first (failing) build."""
    if not root.exists():
        assert fused._load_once.__wrapped__()[0] is None  # `false` builds nothing but makes the folders
    (key_dir,) = [d for d in root.iterdir() if d.is_dir()]
    target = key_dir / "fused_ops.so"
    target.write_bytes(planted_library)
    os.chmod(target, mode)
    return target


def test_untrusted_refuses_other_owners_and_shared_write_bits(tmp_path):
    def info(mode, uid):
        return os.stat_result((mode, 0, 0, 1, uid, 0, 0, 0, 0, 0))

    assert untrusted.owner_problem(info(stat.S_IFDIR | 0o700, 1000), uid=1000) is None
    assert untrusted.owner_problem(info(stat.S_IFREG | 0o755, 1000), uid=1000) is None
    assert untrusted.owner_problem(info(stat.S_IFDIR | 0o700, 1001), uid=1000) == "owned by uid 1001, not 1000"
    assert untrusted.owner_problem(info(stat.S_IFDIR | 0o1777, 1000), uid=1000) == "writable by group and others (mode 1777)"
    assert untrusted.owner_problem(info(stat.S_IFREG | 0o664, 1000), uid=1000) == "writable by group (mode 664)"
    library = tmp_path / "fused_ops.so"
    library.write_bytes(b"")
    os.chmod(library, 0o644)
    assert untrusted.owner_problem(os.stat(library)) is None  # this process's own file
    os.chmod(library, 0o646)
    assert untrusted.owner_problem(os.stat(library)) == "writable by others (mode 646)"


def test_library_planted_in_the_shared_temp_folder_is_not_loaded(planted_library, kernel_env, tmp_path,
                                                                  monkeypatch, caplog):
    (tmp_path / "not_a_dir").write_text("")
    monkeypatch.setenv("TXL_TF_CACHE", str(tmp_path / "not_a_dir"))  # the home cache cannot be created
    shared = tmp_path / "tmp" / f"txl_tf-kernels-{os.getuid()}"
    planted = _plant(planted_library, shared, 0o755)
    os.chmod(shared, 0o777)  # as another user would leave it in /tmp
    library, reason = fused._load_once.__wrapped__()
    assert not kernel_env.exists(), "the planted library was loaded"
    assert library is None and "output is in" in reason and f"{shared}{os.sep}" not in reason, reason
    assert f"not loading the fused CPU kernels from {shared} ({shared} is writable by group and others" in caplog.text
    assert planted.read_bytes() == planted_library


@pytest.mark.parametrize("open_to_others", ["root", "key folder", "library"])
def test_library_in_a_cache_others_may_write_is_not_loaded(planted_library, kernel_env, tmp_path, monkeypatch,
                                                           caplog, open_to_others):
    monkeypatch.setenv("TXL_TF_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "cache" / "kernels"
    planted = _plant(planted_library, root)
    shared = {"root": root, "key folder": planted.parent, "library": planted}[open_to_others]
    os.chmod(shared, 0o775 if shared.is_dir() else 0o666)
    library, reason = fused._load_once.__wrapped__()
    assert not kernel_env.exists(), "the planted library was loaded"
    assert library is None and f"{root}{os.sep}" not in reason, reason
    assert f"({shared} is writable by group" in caplog.text


def test_own_cache_is_private_and_loaded(planted_library, kernel_env, tmp_path, monkeypatch):
    monkeypatch.setenv("TXL_TF_CACHE", str(tmp_path / "cache"))
    previous = os.umask(0o002)  # a umask that lets the group write new files (common with per-user groups)
    try:
        library, reason = fused._load_once.__wrapped__()  # `false` builds nothing but makes the folders
    finally:
        os.umask(previous)
    assert library is None and "output is in" in reason
    root = tmp_path / "cache" / "kernels"
    (key_dir,) = [d for d in root.iterdir() if d.is_dir()]
    assert [stat.S_IMODE(os.stat(d).st_mode) for d in (root, key_dir)] == [0o700, 0o700]
    _plant(planted_library, root, 0o644)  # stands for the library this user built there
    library, reason = fused._load_once.__wrapped__()
    assert library is not None, reason
    assert kernel_env.read_text() == "planted library ran\n"


# ---- issue 34: a run's config.gin, or a file it includes, that is huge or a device is one line ------------------
@pytest.mark.parametrize("kind", ["huge include", "device include", "device config"])
def test_a_gin_file_that_is_huge_or_a_device_is_one_line(tmp_path, kind):
    run = tmp_path / "run"
    run.mkdir()
    target = tmp_path / "included.gin"
    if kind == "huge include":
        with open(target, "wb") as f:
            f.truncate(3 << 30)  # 3 GiB, sparse: no disk space used
        message = f"gin file {target} holds 3072.0 MiB, more than the 4.0 MiB such a file may hold; give the right file"
    else:
        os.symlink("/dev/zero", target)
        message = f"gin file {target} is not a regular file (a device, FIFO or socket); give a regular file"
    if kind == "device config":
        os.symlink(target, run / "config.gin")
        message = message.replace(str(target), str(run / "config.gin"))
    else:
        (run / "config.gin").write_text(f"include '{target}'\nEvalConfig.mem_len = 8\n")
    with pytest.raises(ConfigError) as raised:
        run_dir.read_configs(str(run))
    assert str(raised.value) == message


# ---- issue 34: every folder above the cache is checked, and exactly the checked file is loaded ------------------
def _may_give_files_away(tmp_path):
    """Whether this process can make a file another user's (uid 65534): root can, except in a user namespace
    that maps no such uid (Bazel's linux-sandbox answers EINVAL)."""
    if os.getuid() != 0:
        return False
    probe = tmp_path / "chown-probe"
    probe.write_bytes(b"")
    try:
        os.chown(probe, 65534, -1)
    except OSError:
        return False
    finally:
        probe.unlink()
    return True


@pytest.mark.parametrize("shared", ["parent", "grandparent", "owner"])
def test_a_cache_below_a_folder_others_may_write_is_not_loaded(planted_library, kernel_env, tmp_path, monkeypatch,
                                                               caplog, shared):
    above = {"parent": tmp_path / "shared", "grandparent": tmp_path / "shared", "owner": tmp_path / "theirs"}[shared]
    cache = above / "cache" if shared != "grandparent" else above / "mine" / "cache"
    cache.mkdir(parents=True, mode=0o700)
    os.chmod(cache.parent, 0o700)
    monkeypatch.setenv("TXL_TF_CACHE", str(cache))
    _plant(planted_library, cache / "kernels", 0o644)  # a library this user's folders hold
    if shared == "owner":
        if not _may_give_files_away(tmp_path):
            pytest.skip("giving a folder to another user needs root outside a user namespace (Bazel's sandbox "
                        "maps no uid 65534)")
        os.chmod(above, 0o755)
        os.chown(above, 65534, -1)
        reason = f"{above} is owned by uid 65534, not {os.getuid()} or root"
    else:
        os.chmod(above, 0o777)
        reason = f"{above} is writable by group and others (mode 777)"
    library, why = fused._load_once.__wrapped__()
    assert not kernel_env.exists(), "a library another user could have swapped in was loaded"
    assert library is None and "output is in" in why, why
    assert f"not loading the fused CPU kernels from {cache / 'kernels'} ({reason}" in caplog.text, caplog.text


def test_a_cache_in_a_sticky_shared_folder_is_loaded(planted_library, kernel_env, tmp_path, monkeypatch):
    sticky = tmp_path / "sticky"  # like /tmp: others may write it, but not rename or delete what is not theirs
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    monkeypatch.setenv("TXL_TF_CACHE", str(sticky / "cache"))
    (sticky / "cache").mkdir(mode=0o700)
    _plant(planted_library, sticky / "cache" / "kernels", 0o644)
    library, reason = fused._load_once.__wrapped__()
    assert library is not None, reason
    assert kernel_env.read_text() == "planted library ran\n"


SWAPPER = r"""
import ctypes, os, sys
a, b, stop = sys.argv[1:4]
libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD, RENAME_EXCHANGE = -100, 2
SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276, "riscv64": 276}.get(os.uname().machine)

def renameat2():
    return libc.renameat2(AT_FDCWD, a.encode(), AT_FDCWD, b.encode(), RENAME_EXCHANGE)

def syscall():
    return libc.syscall(SYS_RENAMEAT2, AT_FDCWD, a.encode(), AT_FDCWD, b.encode(), RENAME_EXCHANGE)

def rename_pairs():  # no renameat2 here: three renames, with moments where a or b is missing
    os.rename(a, a + ".swap"); os.rename(b, a); os.rename(a + ".swap", b)
    return 0

ways = [way for way, usable in ((renameat2, hasattr(libc, "renameat2")), (syscall, SYS_RENAMEAT2)) if usable]
exchange = next((way for way in ways if way() == 0 and way() == 0), rename_pairs)
print("swapping with", exchange.__name__, flush=True)
swaps = 0
while not os.path.exists(stop):
    for _ in range(100):
        try:
            exchange()
        except OSError:  # rename_pairs racing the loader's mkdir
            pass
    swaps += 100
print("swaps", swaps, flush=True)
"""

LOADER = r"""
import os, sys
from txl_tf.model import fused
loaded = 0
for compiler in sys.argv[1:]:
    os.environ["CXX"] = compiler
    loaded += fused._load_once.__wrapped__()[0] is not None
print("loaded", loaded, "of", len(sys.argv) - 1, flush=True)
"""


@pytest.fixture(scope="module")
def own_library(tmp_path_factory):
    """A shared library standing for the kernels this user built: its constructor appends "own library ran"."""
    return _build_library(tmp_path_factory, "own", "own library ran")


@pytest.mark.slow  # ~10 s: 300 loads in fresh processes against a swapping attacker; CI's slow phase
def test_swapping_the_kernels_folder_between_check_and_load_never_loads_the_other_library(
        planted_library, own_library, tmp_path):
    """The race of issue 34 as an attacker runs it: a second process exchanges the checked kernels/ folder with
    one holding another user's library (renameat2 RENAME_EXCHANGE, in a loop) while fresh processes load the
    kernels again and again (each load under another compiler name: another key, another file to load)."""
    cache, bin_dir, tmp = tmp_path / "cache", tmp_path / "bin", tmp_path / "tmp"
    kernels, foreign = cache / "kernels", cache / "foreign"
    for folder in (cache, bin_dir, tmp, kernels, foreign):
        folder.mkdir(mode=0o700)
    compilers, give_away = [], _may_give_files_away(tmp_path)
    for i in range(300):  # failing compilers (nothing is built); each name is another cache key
        compiler = bin_dir / f"cxx{i}"
        compiler.symlink_to(shutil.which("false"))
        compilers.append(str(compiler))
        key = fused._cache_key(str(compiler))
        for root, library in ((kernels, own_library), (foreign, planted_library)):
            (root / key).mkdir(mode=0o700)
            (root / key / "fused_ops.so").write_bytes(library)
            os.chmod(root / key / "fused_ops.so", 0o644)
        if give_away:
            os.chown(foreign / key / "fused_ops.so", 65534, 65534)  # another user's library
        else:
            os.chmod(foreign / key / "fused_ops.so", 0o666)  # one another user could have rewritten
    marker, stop = tmp_path / "marker", tmp_path / "stop"
    env = dict(subprocess_env(), TXL_TF_CACHE=str(cache), TMPDIR=str(tmp), TXL_TF_TEST_PLANTED_MARKER=str(marker),
               TF_CPP_MIN_LOG_LEVEL="3")
    swapper = subprocess.Popen([sys.executable, "-c", SWAPPER, str(kernels), str(foreign), str(stop)],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert swapper.stdout.readline().startswith("swapping with ")
        results = [subprocess.run([sys.executable, "-c", LOADER, *compilers[i::2]], cwd=REPO_ROOT, env=env,
                                  capture_output=True, text=True, timeout=120) for i in range(2)]
    finally:
        stop.touch()
        swaps = swapper.communicate(timeout=30)[0]
    assert int(swaps.split()[-1]) > 0
    ran = marker.read_text().splitlines() if marker.exists() else []
    assert "planted library ran" not in ran, f"the other user's library was loaded {ran.count('planted library ran')} times"
    for result in results:
        assert result.returncode == 0 and result.stdout.startswith("loaded "), result.stderr[-2000:]
    loaded = sum(int(result.stdout.split()[1]) for result in results)
    assert loaded >= 1 and ran.count("own library ran") == loaded, (loaded, ran)  # the kernels were loaded
    assert not list(tmp.iterdir()), "a private copy was left behind"
