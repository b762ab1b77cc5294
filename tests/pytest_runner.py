"""Entry point of every Bazel `py_test` here: runs real pytest on the given test file and returns its exit code.

Bazel's `py_test` runs a `main` script; the tests are pytest-style, so each target (see
`tests/pytest_test.bzl`) runs this with the test file and a marker expression:

    pytest_runner.py tests/test_configs.py -m "not slow"

"No tests collected" (pytest exit code 5) is a failure: a file without tests, or whose tests are all
deselected by the marker (a mis-declared `slow` argument of `pytest_test`), is not a pass. The one exception
is a file that skips itself at import (`pytest.skip(..., allow_module_level=True)`, `importorskip`): pytest
reports that skip with its reason, and Bazel, which has no "skipped" status, shows the target as passed.
"""

from __future__ import annotations

import os
import sys

import pytest


def pytest_args(argv: list[str], env: dict[str, str]) -> list[str]:
    """pytest's arguments: `argv` plus Bazel's temporary directory and JUnit XML path when Bazel sets them."""
    args = list(argv)
    if env.get("TEST_TMPDIR"):
        args.append(f"--basetemp={os.path.join(env['TEST_TMPDIR'], 'pytest')}")
    if env.get("XML_OUTPUT_FILE"):
        args.append(f"--junitxml={env['XML_OUTPUT_FILE']}")
    return args


class _Collection:
    """pytest plugin: counts what collection skipped and what the marker expression deselected."""

    def __init__(self) -> None:
        self.skipped_modules: list[str] = []
        self.deselected = 0

    def pytest_collectreport(self, report) -> None:
        if report.skipped:
            self.skipped_modules.append(report.nodeid)

    def pytest_deselected(self, items) -> None:
        self.deselected += len(items)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: pytest_runner.py TEST_FILE [pytest options]", file=sys.stderr)
        return 2
    python = f"{sys.executable} (Python {sys.version.split()[0]})"
    print(f"pytest_runner: {python}, pytest {pytest.__version__}")
    collection = _Collection()
    code = int(pytest.main(pytest_args(argv, dict(os.environ)), plugins=[collection]))
    if code != int(pytest.ExitCode.NO_TESTS_COLLECTED):
        return code
    sys.stdout.flush()
    if collection.deselected:
        print(
            f"pytest_runner: FAILED, no test ran for {argv}: the marker deselected all "
            f"{collection.deselected}; if every test of the file is marked slow, declare the target "
            'with slow = "all" in tests/BUILD',
            file=sys.stderr,
        )
        return 1
    if collection.skipped_modules:
        print(
            f"pytest_runner: the whole file skipped itself ({collection.skipped_modules}); reason above"
        )
        return 0
    print(f"pytest_runner: FAILED, no tests found in {argv}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
