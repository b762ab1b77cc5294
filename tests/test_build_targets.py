"""The Bazel BUILD files stay honest: every module has a target, every test file a py_test.

The BUILD files are read as text (no Bazel needed):
  - txl_tf/BUILD: each txl_tf/**/*.py is in the srcs of exactly one py_library, and each library's deps
    name the libraries of the txl_tf modules it imports (at any depth, lazy imports included);
  - tests/BUILD: each helper module of tests/ has a py_library; each tests/test_*.py has a
    `pytest_test(name = "test_x", ...)`, whose deps name the libraries it imports, and whose `slow`
    matches the file's @pytest.mark.slow marks;
  - scripts/BUILD: each scripts/*.py has a py_binary whose deps name the libraries it imports.

Under Bazel the files come from the runfiles (see the `data` of this target), elsewhere from the checkout.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

REPO_ROOT = pathlib.Path(__file__).absolute().parents[1]
PACKAGE = "txl_tf"
# Every pytest_test gets these (tests/pytest_test.bzl): the package's __init__.py files and the conftest.
COMMON_TEST_DEPS = {"//txl_tf:txl_tf", "//tests:conftest"}
# Files of tests/ that are neither test files nor libraries: the runner is in the srcs of every test.
NOT_LIBRARIES = {"tests/pytest_runner.py"}

_CALL = re.compile(r"^(py_library|py_binary|py_test|pytest_test)\(", re.MULTILINE)
# Packages whose Python files each need a target, and the rule of those targets.
TARGET_RULES = {PACKAGE: "py_library", "tests": "py_library", "scripts": "py_binary"}
_STRING = re.compile(r'"([^"]*)"')


def _strip_comments(text: str) -> str:
    return "\n".join(line.split("#", 1)[0] for line in text.splitlines())


def build_calls(text: str) -> list[tuple[str, str]]:
    """(rule, body) of each top-level `py_library`, `py_binary`, `py_test` or `pytest_test` call."""
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
    """{repo-relative source: (label, canonical deps)} of the targets of txl_tf/, tests/ and scripts/."""
    modules: dict[str, tuple[str, list[str]]] = {}
    for package, wanted in TARGET_RULES.items():
        if not (repo / package / "BUILD").exists():
            continue
        for rule, body in build_calls((repo / package / "BUILD").read_text()):
            if rule != wanted:
                continue
            label = _label(":" + _strings(body, "name")[0], package)
            deps = [_label(dep, package) for dep in _strings(body, "deps")]
            for src in _strings(body, "srcs"):
                path = f"{package}/{src}"
                modules.setdefault(path, (label, deps))
                if modules[path][0] != label:
                    raise AssertionError(
                        f"{path} is in two py_library targets: {modules[path][0]} and {label}"
                    )
    return modules


def _import_statements(path: pathlib.Path, repo: pathlib.Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every import in `path`, at any depth (lazy imports inside functions included):
    `import a.b` is ("a.b", []), `from a import b, c` is ("a", ["b", "c"]); relative imports resolved."""
    statements = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            statements += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the importing file's package
                package = path.parent.relative_to(repo).parts
                base = ".".join(package[: len(package) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module
            statements.append((module, [alias.name for alias in node.names]))
    return statements


def imported_files(path: pathlib.Path, repo: pathlib.Path) -> set[str]:
    """Repo-relative candidates for the files `path` imports (txl_tf modules; tests/ helpers from tests/).

    Each dotted name yields both `a/b.py` and `a/b/__init__.py`; callers keep the ones that exist.
    """
    names = []
    for module, imported in _import_statements(path, repo):
        names += [module] + [f"{module}.{name}" for name in imported]
    in_tests = path.parent == repo / "tests"
    found = set()
    for name in names:
        parts = name.split(".")
        if parts[0] == PACKAGE:
            found |= {"/".join(parts) + ".py", "/".join(parts + ["__init__.py"])}
        elif in_tests and len(parts) == 1:
            found.add(f"tests/{parts[0]}.py")
    return found


def _module_file(name: str, repo: pathlib.Path) -> str | None:
    """The repo-relative file of module `name` of the package (a.b: a/b.py or a/b/__init__.py), None if none."""
    parts = name.split(".")
    if parts[0] != PACKAGE:
        return None
    for candidate in ("/".join(parts) + ".py", "/".join(parts + ["__init__.py"])):
        if (repo / candidate).is_file():
            return candidate
    return None


def import_graph(repo: pathlib.Path) -> dict[str, set[str]]:
    """{module file: the module files it imports} of the package, lazy imports (and the package's `__getattr__`
    re-exports) included. `from a import b` imports a/b.py when b is a module, else a itself (its __init__.py);
    importing a submodule runs its packages' __init__.py too, but that is not counted as an edge (an __init__.py
    that imports lazily would otherwise make every module look circular)."""
    graph = {}
    for path in sorted((repo / PACKAGE).rglob("*.py")):
        edges = set()
        for module, names in _import_statements(path, repo):
            for name in names or [None]:
                target = (name and _module_file(f"{module}.{name}", repo)) or _module_file(module, repo)
                if target is not None:
                    edges.add(target)
        graph[str(path.relative_to(repo))] = edges
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle [a, b, ..., a] through each group of modules that import each other (Tarjan's strongly
    connected components, then a breadth-first search inside each), in a stable order."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(node: str) -> None:  # recursive: the package's import depth is small
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1 or node in graph.get(node, ()):
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    cycles = []
    for group in groups:
        start = min(group)
        paths = {start: [start]}
        queue = [start]
        while queue:
            node = queue.pop(0)
            for nxt in sorted(graph[node] & group):
                if nxt == start:
                    cycles.append(paths[node] + [start])
                    queue = []
                    break
                if nxt not in paths:
                    paths[nxt] = paths[node] + [nxt]
                    queue.append(nxt)
    return sorted(cycles)


def marks_slow(path: pathlib.Path) -> bool:
    """Whether the file uses `pytest.mark.slow` in code (decorators, `pytestmark`, params), not in strings."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Attribute) and node.attr == "slow":
            if isinstance(node.value, ast.Attribute) and node.value.attr == "mark":
                return True
    return False


def _missing_deps(who: str, path: pathlib.Path, deps, allowed, modules, repo) -> list[str]:
    problems = []
    for imported in sorted(imported_files(path, repo) & set(modules)):
        needed = modules[imported][0]
        if needed not in deps and needed not in allowed:
            problems.append(f"{who} imports {imported} but its deps lack {needed}")
    return problems


def problems_of_library_targets(repo: pathlib.Path) -> list[str]:
    """What is wrong in the py_library / py_binary targets, one line per problem (empty: nothing)."""
    modules = library_targets(repo)
    sources = sorted(str(p.relative_to(repo)) for p in (repo / PACKAGE).rglob("*.py"))
    sources += sorted(str(p.relative_to(repo)) for p in (repo / "scripts").glob("*.py"))
    sources += sorted(
        str(p.relative_to(repo))
        for p in (repo / "tests").glob("*.py")
        if not p.name.startswith("test_") and str(p.relative_to(repo)) not in NOT_LIBRARIES
    )
    problems = [
        f"{src} has no {TARGET_RULES[src.split('/')[0]]} in {src.split('/')[0]}/BUILD"
        for src in sources
        if src not in modules
    ]
    problems += [
        f"{src.split('/')[0]}/BUILD lists {src}, which does not exist"
        for src in modules
        if src not in sources
    ]
    for src in sources:
        if src in modules:
            label, deps = modules[src]
            allowed = {label, f"//{PACKAGE}:{PACKAGE}"}
            problems += _missing_deps(f"{label} ({src})", repo / src, deps, allowed, modules, repo)
    return problems


def problems_of_test_targets(repo: pathlib.Path) -> list[str]:
    """What is wrong in tests/BUILD's pytest_test targets, one line per problem (empty: nothing)."""
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
    test_files = sorted((repo / "tests").glob("test_*.py"))
    for path in test_files:
        name = path.stem
        if name not in targets:
            problems.append(f'tests/{path.name} has no pytest_test(name = "{name}") in tests/BUILD')
            continue
        deps, slow = targets[name]
        problems += _missing_deps(f"//tests:{name}", path, deps, COMMON_TEST_DEPS, modules, repo)
        twice = sorted(label for label in set(deps) if deps.count(label) > 1 or label in COMMON_TEST_DEPS)
        if twice:  # Bazel refuses the whole package over a duplicate label
            problems.append(f"//tests:{name} lists {', '.join(twice)} twice (pytest_test adds "
                            f"{', '.join(sorted(COMMON_TEST_DEPS))} itself)")
        marked = marks_slow(path)
        if marked and slow == "none":
            problems.append(
                f'tests/{path.name} has tests marked slow: declare //tests:{name} with slow = "some" or "all"'
            )
        if not marked and slow != "none":
            problems.append(
                f'//tests:{name} has slow = "{slow}" but tests/{path.name} marks no test slow'
            )
    for name in sorted(set(targets) - {p.stem for p in test_files}):
        problems.append(f"tests/BUILD declares {name}, but tests/{name}.py does not exist")
    return problems


def test_every_module_has_a_py_library_with_the_deps_its_imports_need():
    problems = problems_of_library_targets(REPO_ROOT)
    assert not problems, "fix the BUILD files:\n  " + "\n  ".join(problems)


def test_every_test_file_has_a_py_test():
    problems = problems_of_test_targets(REPO_ROOT)
    assert not problems, "fix tests/BUILD:\n  " + "\n  ".join(problems)


# The package's stages (issue 53), in the order they may import one another: a module imports only modules of its
# own stage or of an earlier one, so the folders form no circle and the model's layers never reach training. The
# base (errors, paths, untrusted input, staging, the entry points' set-up) imports no TensorFlow or Keras.
# configs.py (the gin configuration every stage reads) and the commands (train.py, evaluate.py, ... and the package's
# __init__.py) are the top-level files; the study drives the commands (it trains and averages runs), so it comes last.
STAGES = ("base", "model", "data", "configs", "runs", "evaluation", "lm", "training", "analysis", "commands", "study")
HEAVY = ("tensorflow", "keras", "keras_hub", "tf_keras")


def stage_of(path: str) -> str:
    """The stage of a module file of the package: its folder, or "configs" / "commands" at the top level."""
    parts = pathlib.PurePosixPath(path).relative_to(PACKAGE).parts
    if len(parts) > 1:
        return parts[0]
    return "configs" if parts[0] == "configs.py" else "commands"


def stage_problems(graph: dict[str, set[str]], imports_of) -> list[str]:
    """Where a module imports one of a later stage (STAGES), or a module of the base imports a package of HEAVY
    (`imports_of(file)`: the top-level packages a file imports); an unknown folder is a problem too."""
    problems = []
    for path in sorted(graph):
        stage = stage_of(path)
        if stage not in STAGES:
            problems.append(f"{path} is in no stage: add its folder to STAGES in tests/test_build_targets.py")
            continue
        for target in sorted(graph[path]):
            later = stage_of(target)
            if later in STAGES and STAGES.index(later) > STAGES.index(stage):
                problems.append(f"{path} ({stage}) imports {target} ({later}, a later stage)")
        if stage == "base":
            problems += [f"{path} (the base) imports {name}" for name in sorted(set(imports_of(path)) & set(HEAVY))]
    return problems


def _top_level_imports(path: str) -> set[str]:
    tree = ast.parse((REPO_ROOT / path).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_the_model_layers_and_the_base_stay_in_their_stages():
    problems = stage_problems(import_graph(REPO_ROOT), _top_level_imports)
    assert not problems, "imports across the package's stages:\n  " + "\n  ".join(problems)


def test_a_layer_importing_training_or_a_base_module_importing_tensorflow_is_named():
    model, training, base = f"{PACKAGE}/model/attention.py", f"{PACKAGE}/training/autotune.py", f"{PACKAGE}/base/errors.py"
    graph = {model: {f"{PACKAGE}/model/fused.py"}, f"{PACKAGE}/model/fused.py": {training}, training: {base},
             base: set(), f"{PACKAGE}/base/paths.py": {base}, f"{PACKAGE}/train.py": {training, model},
             f"{PACKAGE}/extras/thing.py": set()}
    imports = {base: {"os", "tensorflow"}}
    assert stage_problems(graph, lambda path: imports.get(path, set())) == [
        f"{PACKAGE}/base/errors.py (the base) imports tensorflow",
        f"{PACKAGE}/extras/thing.py is in no stage: add its folder to STAGES in tests/test_build_targets.py",
        f"{PACKAGE}/model/fused.py (model) imports {training} (training, a later stage)"]


def test_no_import_cycle_in_the_package():
    """No txl_tf module imports itself through others, counting the imports inside functions: a lazy import that
    only hides a circle still makes the modules one tangle (and an import order away from a partial module)."""
    cycles = import_cycles(import_graph(REPO_ROOT))
    assert not cycles, "import cycles in txl_tf (a -> b: a imports b):\n  " + "\n  ".join(
        " -> ".join(cycle) for cycle in cycles)


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

py_library(
    name = "conftest",
    srcs = ["conftest.py"],
)

py_library(
    name = "helpers",
    srcs = ["helpers.py"],
)

pytest_test(
    name = "test_pipeline",
    deps = [
        ":helpers",
        "//txl_tf:data/pipeline",
    ],
    slow = "some",
)
"""


@pytest.fixture
def fake_repo(tmp_path):
    (tmp_path / "txl_tf" / "data").mkdir(parents=True)
    (tmp_path / "tests").mkdir()
    (tmp_path / "scripts").mkdir()
    files = {
        "txl_tf/__init__.py": '"""Package."""\n',
        "txl_tf/data/__init__.py": "",
        "txl_tf/configs.py": "import gin\n",
        "txl_tf/data/pipeline.py": "from txl_tf import configs\nfrom . import __name__ as _n\n",
        "txl_tf/BUILD": _LIBS,
        "tests/BUILD": _TESTS,
        "scripts/BUILD": 'py_binary(\n    name = "bench",\n    srcs = ["bench.py"],\n    deps = ["//txl_tf:configs"],\n)\n',
        "scripts/bench.py": "def main():\n    from txl_tf.configs import X\n",
        "tests/conftest.py": "import pytest\n",
        "tests/helpers.py": "import txl_tf\n",
        "tests/pytest_runner.py": "import pytest\n",
        "tests/test_pipeline.py": (
            "import pytest\nfrom helpers import check\nfrom txl_tf.data.pipeline import x\n\n"
            "@pytest.mark.slow\ndef test_a():\n    pass\n"
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


def test_test_helper_module_needs_a_library_and_a_dep(fake_repo):
    (fake_repo / "tests" / "BUILD").write_text(_TESTS.replace('":helpers",', ""))
    assert problems_of_test_targets(fake_repo) == [
        "//tests:test_pipeline imports tests/helpers.py but its deps lack //tests:helpers"
    ]
    (fake_repo / "tests" / "more_helpers.py").write_text("import numpy\n")
    assert problems_of_library_targets(fake_repo) == [
        "tests/more_helpers.py has no py_library in tests/BUILD"
    ]


def test_script_needs_a_py_binary_with_its_deps(fake_repo):
    (fake_repo / "scripts" / "bench.py").write_text("from txl_tf.data import pipeline\n")
    (fake_repo / "scripts" / "other.py").write_text("import sys\n")
    assert problems_of_library_targets(fake_repo) == [
        "scripts/other.py has no py_binary in scripts/BUILD",
        "//scripts:bench (scripts/bench.py) imports txl_tf/data/pipeline.py but its deps lack "
        "//txl_tf:data/pipeline",
    ]


def test_import_cycle_is_named_lazy_imports_included(fake_repo):
    assert import_cycles(import_graph(fake_repo)) == []
    (fake_repo / "txl_tf" / "configs.py").write_text("def build():\n    from txl_tf.data import pipeline\n")
    assert import_cycles(import_graph(fake_repo)) == [
        ["txl_tf/configs.py", "txl_tf/data/pipeline.py", "txl_tf/configs.py"]]


def test_cycle_check_reads_from_package_import_module_as_the_module_not_the_package(fake_repo):
    """`from txl_tf import configs` imports txl_tf/configs.py; a name that is not a module (`__version__`) is the
    package's, whose lazy `__getattr__` imports count as its edges."""
    (fake_repo / "txl_tf" / "__init__.py").write_text(
        "def __getattr__(name):\n    from txl_tf.data.pipeline import Model\n    return Model\n")
    graph = import_graph(fake_repo)
    assert graph["txl_tf/data/pipeline.py"] == {"txl_tf/configs.py", "txl_tf/data/__init__.py"}
    assert import_cycles(graph) == []
    (fake_repo / "txl_tf" / "configs.py").write_text("from txl_tf import __version__\n")
    assert import_cycles(import_graph(fake_repo)) == [
        ["txl_tf/__init__.py", "txl_tf/data/pipeline.py", "txl_tf/configs.py", "txl_tf/__init__.py"]]
