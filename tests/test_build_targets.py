"""The Bazel BUILD files stay honest: every txl_tf module has a py_library, every test file a py_test.

The BUILD files are read as text (no Bazel needed):
  - txl_tf/BUILD: each txl_tf/**/*.py is in the srcs of exactly one py_library, and each library's deps
    name the libraries of the txl_tf modules it imports;
  - tests/BUILD: each tests/test_*.py has a `pytest_test(name = "test_x", ...)`, whose deps name the
    libraries of the txl_tf modules it imports, and whose `slow` matches the file's @pytest.mark.slow marks.

Under Bazel the files come from the runfiles (see the `data` of this target), elsewhere from the checkout.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

REPO_ROOT = pathlib.Path(__file__).absolute().parents[1]
PACKAGE = "txl_tf"
PACKAGE_LABEL = "//txl_tf"  # the library of the package's __init__.py files; every test gets it

_CALL = re.compile(r"^(py_library|py_test|pytest_test)\(", re.MULTILINE)
_STRING = re.compile(r'"([^"]*)"')


def _strip_comments(text: str) -> str:
    return "\n".join(line.split("#", 1)[0] for line in text.splitlines())


def build_calls(text: str) -> list[tuple[str, str]]:
    """(rule, body) of each top-level `py_library(...)`, `py_test(...)` or `pytest_test(...)` call."""
    text = _strip_comments(text)
    calls = []
    for match in _CALL.finditer(text):
        depth, end = 0, match.end() - 1
        for end in range(match.end() - 1, len(text)):
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            if depth == 0:
                break
        calls.append((match.group(1), text[match.end() : end]))
    return calls


def _attr(body: str, name: str) -> str | None:
    match = re.search(rf"\b{name}\s*=\s*(\[[^\]]*\]|\"[^\"]*\")", body)
    return match.group(1) if match else None


def _strings(body: str, name: str) -> list[str]:
    value = _attr(body, name)
    return _STRING.findall(value) if value else []


def _label(dep: str, package: str) -> str:
    """Canonical form: ':x' in package p is '//p:x'; '//p' is '//p:<last part of p>'."""
    if dep.startswith(":"):
        return f"//{package}{dep}"
    if dep.startswith("//") and ":" not in dep:
        return f"{dep}:{dep.rsplit('/', 1)[-1]}"
    return dep


def library_targets(repo: pathlib.Path) -> dict[str, tuple[str, list[str]]]:
    """{module path relative to txl_tf/: (label, canonical deps)} from txl_tf/BUILD."""
    modules: dict[str, tuple[str, list[str]]] = {}
    for rule, body in build_calls((repo / PACKAGE / "BUILD").read_text()):
        if rule != "py_library":
            continue
        label = _label(":" + _strings(body, "name")[0], PACKAGE)
        deps = [_label(dep, PACKAGE) for dep in _strings(body, "deps")]
        for src in _strings(body, "srcs"):
            modules.setdefault(src, (label, deps))
            if modules[src][0] != label:
                raise AssertionError(
                    f"txl_tf/{src} is in two py_library targets: {modules[src][0]} and {label}"
                )
    return modules


def txl_tf_imports(path: pathlib.Path, repo: pathlib.Path) -> set[str]:
    """Module paths (relative to txl_tf/) of the txl_tf modules that `path` imports, at any depth.

    Each dotted name yields both candidates `a/b.py` and `a/b/__init__.py`; callers keep the existing ones.
    """
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the importing file's package
                package = path.parent.relative_to(repo).parts
                base = ".".join(package[: len(package) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module
            names += [module] + [f"{module}.{alias.name}" for alias in node.names]
    found = set()
    for name in names:
        parts = name.split(".")
        if parts[0] == PACKAGE:
            stem = "/".join(parts[1:])
            found |= {f"{stem}.py", f"{stem}/__init__.py"} if stem else {"__init__.py"}
    return found


def marks_slow(path: pathlib.Path) -> bool:
    """Whether the file uses `pytest.mark.slow` in code (decorators, `pytestmark`, params), not in strings."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Attribute) and node.attr == "slow":
            if isinstance(node.value, ast.Attribute) and node.value.attr == "mark":
                return True
    return False


def problems_of_library_targets(repo: pathlib.Path) -> list[str]:
    """What is wrong in txl_tf/BUILD, one line per problem (empty: nothing)."""
    modules = library_targets(repo)
    package_dir = repo / PACKAGE
    sources = sorted(str(p.relative_to(package_dir)) for p in package_dir.rglob("*.py"))
    problems = [
        f"txl_tf/{src} has no py_library in txl_tf/BUILD" for src in sources if src not in modules
    ]
    problems += [
        f"txl_tf/BUILD lists txl_tf/{src}, which does not exist"
        for src in modules
        if src not in sources
    ]
    package_label = _label(PACKAGE_LABEL, PACKAGE)
    for src in sources:
        if src not in modules:
            continue
        label, deps = modules[src]
        for imported in sorted(txl_tf_imports(package_dir / src, repo) & set(modules)):
            needed = modules[imported][0]
            if needed not in (label, package_label) and needed not in deps:
                problems.append(
                    f"{label} (txl_tf/{src}) imports txl_tf/{imported} but its deps lack {needed}"
                )
    return problems


def problems_of_test_targets(repo: pathlib.Path) -> list[str]:
    """What is wrong in tests/BUILD, one line per problem (empty: nothing)."""
    modules = library_targets(repo)
    targets = {}
    for rule, body in build_calls((repo / "tests" / "BUILD").read_text()):
        names = _strings(body, "name")
        if rule == "pytest_test" and names:
            slow = _attr(body, "slow")
            targets[names[0]] = (
                [_label(d, "tests") for d in _strings(body, "deps")],
                slow.strip('"') if slow else "none",
            )
    problems = []
    package_label = _label(PACKAGE_LABEL, PACKAGE)
    for path in sorted((repo / "tests").glob("test_*.py")):
        name = path.stem
        if name not in targets:
            problems.append(f'tests/{path.name} has no pytest_test(name = "{name}") in tests/BUILD')
            continue
        deps, slow = targets[name]
        for imported in sorted(txl_tf_imports(path, repo) & set(modules)):
            needed = modules[imported][0]
            if needed != package_label and needed not in deps:
                problems.append(
                    f"//tests:{name} imports txl_tf/{imported} but its deps lack {needed}"
                )
        marked = marks_slow(path)
        if marked and slow == "none":
            problems.append(
                f'tests/{path.name} has tests marked slow: declare //tests:{name} with slow = "some" or "all"'
            )
        if not marked and slow != "none":
            problems.append(
                f'//tests:{name} has slow = "{slow}" but tests/{path.name} marks no test slow'
            )
    for name in sorted(set(targets) - {p.stem for p in (repo / "tests").glob("test_*.py")}):
        problems.append(f"tests/BUILD declares {name}, but tests/{name}.py does not exist")
    return problems


def test_every_module_has_a_py_library_with_the_deps_its_imports_need():
    problems = problems_of_library_targets(REPO_ROOT)
    assert not problems, "fix txl_tf/BUILD:\n  " + "\n  ".join(problems)


def test_every_test_file_has_a_py_test():
    problems = problems_of_test_targets(REPO_ROOT)
    assert not problems, "fix tests/BUILD:\n  " + "\n  ".join(problems)


# The checks themselves, on a small made-up repository.

_LIBS = """
py_library(
    name = "txl_tf",
    srcs = ["__init__.py", "data/__init__.py"],  # the package (comment with a paren: ")")
)

py_library(
    name = "configs",
    srcs = ["configs.py"],
)

py_library(
    name = "data/pipeline",
    srcs = ["data/pipeline.py"],
    deps = [":configs"],
)
"""

_TESTS = """
load("//tests:pytest_test.bzl", "pytest_test")

pytest_test(
    name = "test_pipeline",
    deps = ["//txl_tf:data/pipeline"],
    slow = "some",
)
"""


@pytest.fixture
def fake_repo(tmp_path):
    (tmp_path / "txl_tf" / "data").mkdir(parents=True)
    (tmp_path / "tests").mkdir()
    files = {
        "txl_tf/__init__.py": '"""Package."""\n',
        "txl_tf/data/__init__.py": "",
        "txl_tf/configs.py": "import gin\n",
        "txl_tf/data/pipeline.py": "from txl_tf import configs\nfrom . import __name__ as _n\n",
        "txl_tf/BUILD": _LIBS,
        "tests/BUILD": _TESTS,
        "tests/test_pipeline.py": (
            "import pytest\nfrom txl_tf.data.pipeline import x\n\n@pytest.mark.slow\ndef test_a():\n    pass\n"
        ),
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def test_consistent_fake_repo_has_no_problems(fake_repo):
    assert problems_of_library_targets(fake_repo) == []
    assert problems_of_test_targets(fake_repo) == []


def test_new_module_without_target_is_named(fake_repo):
    (fake_repo / "txl_tf" / "data" / "vocab.py").write_text("import collections\n")
    assert problems_of_library_targets(fake_repo) == [
        "txl_tf/data/vocab.py has no py_library in txl_tf/BUILD"
    ]


def test_import_without_dep_is_named(fake_repo):
    (fake_repo / "txl_tf" / "BUILD").write_text(_LIBS.replace('deps = [":configs"],', ""))
    assert problems_of_library_targets(fake_repo) == [
        "//txl_tf:data/pipeline (txl_tf/data/pipeline.py) imports txl_tf/configs.py but its deps lack //txl_tf:configs"
    ]


def test_lazy_import_inside_a_function_counts(fake_repo):
    (fake_repo / "txl_tf" / "configs.py").write_text(
        "def build():\n    from txl_tf.data import pipeline\n"
    )
    assert problems_of_library_targets(fake_repo) == [
        "//txl_tf:configs (txl_tf/configs.py) imports txl_tf/data/pipeline.py but its deps lack //txl_tf:data/pipeline"
    ]


def test_deleted_module_still_listed_is_named(fake_repo):
    (fake_repo / "txl_tf" / "configs.py").unlink()
    assert problems_of_library_targets(fake_repo) == [
        "txl_tf/BUILD lists txl_tf/configs.py, which does not exist"
    ]


def test_new_test_file_without_target_is_named(fake_repo):
    (fake_repo / "tests" / "test_configs.py").write_text("def test_x():\n    pass\n")
    assert problems_of_test_targets(fake_repo) == [
        'tests/test_configs.py has no pytest_test(name = "test_configs") in tests/BUILD'
    ]


def test_test_import_without_dep_is_named(fake_repo):
    (fake_repo / "tests" / "BUILD").write_text(_TESTS.replace('"//txl_tf:data/pipeline"', ""))
    assert problems_of_test_targets(fake_repo) == [
        "//tests:test_pipeline imports txl_tf/data/pipeline.py but its deps lack //txl_tf:data/pipeline"
    ]


def test_slow_declaration_must_match_the_marks(fake_repo):
    (fake_repo / "tests" / "BUILD").write_text(_TESTS.replace('slow = "some",', ""))
    assert problems_of_test_targets(fake_repo) == [
        'tests/test_pipeline.py has tests marked slow: declare //tests:test_pipeline with slow = "some" or "all"'
    ]
    (fake_repo / "tests" / "BUILD").write_text(_TESTS)
    (fake_repo / "tests" / "test_pipeline.py").write_text("from txl_tf.data.pipeline import x\n")
    assert problems_of_test_targets(fake_repo) == [
        '//tests:test_pipeline has slow = "some" but tests/test_pipeline.py marks no test slow'
    ]


def test_txl_tf_is_imported_from_this_tree():
    """Under Bazel the package comes from the runfiles next to this test, not an installed copy."""
    import txl_tf

    assert pathlib.Path(txl_tf.__file__).absolute().parents[1] == REPO_ROOT
