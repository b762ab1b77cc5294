"""One way to define flags (txl_tf.base.cli), the Keras backend chosen once by the package, entry points importable
together.

Every entry point of the package and every script of scripts/ (a module with a `__main__` block) defines its flags in
`define_flags(flag_values)` and runs through `cli.run(main, define_flags)`; importing it defines nothing, and a flag
name means the same type everywhere (the shared ones, the same help too).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest
from absl import flags

import txl_tf
from txl_tf.base import cli
from txl_tf.base.errors import ConfigError
from txl_tf.runs import loading

REPO_ROOT = pathlib.Path(__file__).absolute().parents[1]
PACKAGE_DIR = REPO_ROOT / "txl_tf"
SCRIPTS_DIR = REPO_ROOT / "scripts"


def _module_name(path: pathlib.Path) -> str:
    return ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)


def _is_main_block(node: ast.stmt) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__")


def _entry_point_files() -> list[pathlib.Path]:
    """The package's entry points, then the scripts (scripts/*.py, run as `python scripts/NAME.py`)."""
    def with_main(paths):
        return sorted(p for p in paths if any(_is_main_block(node) for node in ast.parse(p.read_text()).body))

    return with_main(PACKAGE_DIR.rglob("*.py")) + with_main(SCRIPTS_DIR.glob("*.py"))


ENTRY_POINTS = [_module_name(p) for p in _entry_point_files()]


def _is_script(module: str) -> bool:
    return module.startswith("scripts.")


def _import(module: str):
    """The module; a script (not a package) is loaded from its file under the name `scripts.NAME`."""
    if not _is_script(module):
        return importlib.import_module(module)
    if module not in sys.modules:
        spec = importlib.util.spec_from_file_location(module, REPO_ROOT / f"{module.replace('.', '/')}.py")
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[module] = loaded
        spec.loader.exec_module(loaded)
    return sys.modules[module]


def _command(module: str) -> list[str]:
    """The command line that runs the entry point: `python -m` (a package's __main__ runs as the package), or the
    script's file."""
    if _is_script(module):
        return [sys.executable, str(REPO_ROOT / f"{module.replace('.', '/')}.py")]
    return [sys.executable, "-m", module.removesuffix(".__main__")]


def _flags_of(module: str) -> flags.FlagValues:
    flag_values = flags.FlagValues()
    _import(module).define_flags(flag_values)
    return flag_values


def test_the_entry_points_are_found():
    expected = {"txl_tf.train", "txl_tf.evaluate", "txl_tf.generate", "txl_tf.export", "txl_tf.average",
                "txl_tf.convert", "txl_tf.sweep", "txl_tf.study.__main__", "txl_tf.data.prepare",
                "txl_tf.analysis.recl", "txl_tf.analysis.attention_maps", "scripts.benchmark_model",
                "scripts.benchmark_data", "scripts.benchmark_eval_speed", "scripts.benchmark_inference"}
    assert expected <= set(ENTRY_POINTS)


@pytest.mark.parametrize("path", _entry_point_files(), ids=_module_name)
def test_entry_point_shape(path):
    """`define_flags(flag_values)`, no flag defined outside it, and `cli.run(main, define_flags)` as __main__."""
    tree = ast.parse(path.read_text())
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert "define_flags" in functions and "main" in functions, f"{path} needs define_flags and main"
    assert [a.arg for a in functions["define_flags"].args.args] == ["flag_values"]
    main_block = next(node for node in tree.body if _is_main_block(node))
    assert [ast.unparse(s) for s in main_block.body] in (["cli.run(main, define_flags)"],
                                                         ["cli.run(main, define_flags, verbosity='error')"])
    definers = {"define_flags"}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name not in definers:
            for call in ast.walk(node):
                if isinstance(call, ast.Call) and "DEFINE" in ast.unparse(call.func):
                    pytest.fail(f"{path}: {node.name} defines a flag; flags belong in define_flags")
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef | ast.ClassDef):
            assert "DEFINE_" not in ast.unparse(node), f"{path} defines a flag at import"


def test_only_cli_and_entry_points_define_flags():
    allowed = set(_entry_point_files()) | {PACKAGE_DIR / "base" / "cli.py"}
    defining = {p for p in PACKAGE_DIR.rglob("*.py") if "flags.DEFINE_" in p.read_text()}
    assert defining <= allowed, f"flags defined outside the entry points: {sorted(map(str, defining - allowed))}"


def test_importing_every_entry_point_together_defines_no_flags():
    for module in ENTRY_POINTS:
        _import(module)
    by_module = flags.FLAGS.flags_by_module_dict()
    ours = {module: [f.name for f in defined] for module, defined in by_module.items()
            if module.startswith(("txl_tf", "scripts")) or str(PACKAGE_DIR) in module or str(SCRIPTS_DIR) in module}
    assert not ours, f"importing defined flags on absl's FLAGS: {ours}"


def test_every_entry_point_defines_its_flags_once_on_given_flag_values():
    for module in ENTRY_POINTS:
        flag_values = _flags_of(module)
        assert "verbosity" not in flag_values  # absl's own flags are not redefined
        assert len(flag_values) > 0, module


def _shared_flags() -> dict:
    flag_values = flags.FlagValues()
    cli.define(flag_values, *cli.SHARED)
    return {name: flag_values[name] for name in cli.SHARED}


def test_a_flag_name_has_one_type_everywhere_and_the_shared_ones_one_help():
    shared = _shared_flags()
    seen: dict[str, tuple] = {}
    for module in ENTRY_POINTS:
        flag_values = _flags_of(module)
        for name in flag_values:
            flag = flag_values[name]
            kind = (type(flag).__name__, flag.flag_type())
            first_kind, first_module = seen.setdefault(name, (kind, module))
            assert kind == first_kind, f"--{name} is {kind} in {module} but {first_kind} in {first_module}"
            if name in shared:
                assert (flag.help, flag.default) == (shared[name].help, shared[name].default), (
                    f"--{name} in {module} has its own help or default; define it with cli.define")


def test_model_flags_are_the_shared_group():
    flag_values = flags.FlagValues()
    cli.define_model_flags(flag_values)
    assert sorted(flag_values) == sorted(cli.MODEL_FLAGS)
    assert flag_values["which"].default == "latest"


def test_load_model_from_flags_needs_a_source():
    flag_values = flags.FlagValues()
    cli.define_model_flags(flag_values)
    flag_values(["prog"])
    with pytest.raises(ConfigError, match="give --model_dir"):
        loading.load_model_from_flags(flag_values)


def test_no_arguments():
    cli.no_arguments(["prog"])
    with pytest.raises(ConfigError, match=r"unexpected arguments \['extra'\]; quote it"):
        cli.no_arguments(["prog", "extra"], "quote it")


def test_importing_the_package_imports_no_tensorflow_and_chooses_the_backend():
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    code = ("import os, sys, txl_tf, txl_tf.base.cli\n"
            "assert 'tensorflow' not in sys.modules and 'keras' not in sys.modules, 'imported TensorFlow'\n"
            "print(os.environ['KERAS_BACKEND'], os.environ['TF_CPP_MIN_LOG_LEVEL'])\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["tensorflow", env.get("TF_CPP_MIN_LOG_LEVEL", "3")]


def _heavy_imports(node: ast.stmt) -> list[str]:
    """The modules a top-level import statement loads, in order, that may start TensorFlow (anything but the
    standard library, absl, numpy, the package itself and txl_tf.base, which imports no TensorFlow:
    tests/test_build_targets.py)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module in ("txl_tf", "txl_tf.base"):
        names = [f"{node.module}.{alias.name}" for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names = [node.module]
    else:
        return []
    light = ("txl_tf", "txl_tf.base", "absl", "numpy", "__future__")
    return [name for name in names if name.split(".")[0] not in sys.stdlib_module_names
            and not any(name == m or name.startswith(m + ".") and m != "txl_tf" for m in light)]


@pytest.mark.parametrize("path", _entry_point_files(), ids=_module_name)
def test_entry_points_import_cli_before_anything_that_may_start_tensorflow(path):
    """txl_tf.base.cli quiets TensorFlow's start-up only when it is imported first (`# isort: split` keeps it there)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module == "txl_tf.base" and node.names[0].name == "cli":
            return
        heavy = _heavy_imports(node)
        assert not heavy, f"{path}:{node.lineno} imports {heavy[0]} before txl_tf.base.cli"


def test_the_model_class_loads_on_first_use():
    from txl_tf.model.transformer_xl import TransformerXL

    assert txl_tf.TransformerXL is TransformerXL
    assert "TransformerXL" in dir(txl_tf)
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        txl_tf.nothing  # noqa: B018


@pytest.mark.slow
@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_help_in_a_subprocess(module):
    """`python -m <entry point> --help` (`python scripts/NAME.py --help`) lists the command's flags, the shared ones
    included."""
    result = subprocess.run([*_command(module), "--help"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert "Traceback" not in result.stderr and "error:" not in result.stderr, result.stderr
    assert result.returncode in (0, 1), result.stderr  # absl exits with 1 after printing help
    for name in _flags_of(module):
        assert f"--{name}:" in result.stdout or f"--[no]{name}:" in result.stdout, f"--{name} missing"


def test_run_reports_a_bad_flag_in_one_line():
    """`cli.run` end to end on the lightest entry point (no TensorFlow): an unknown flag is one `error:` line."""
    result = subprocess.run([sys.executable, "-m", "txl_tf.analysis.recl", "--model=a={c}.npy", "--bogus=1"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: Unknown command line flag 'bogus'"), result.stderr
    assert "Traceback" not in result.stderr
