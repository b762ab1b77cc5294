"""Entry point of every Bazel `py_test` here: runs real pytest on the given test file and returns its exit code.

Bazel's `py_test` runs a `main` script; the tests are pytest-style, so each target (see
`tests/pytest_test.bzl`) runs this with the test file and a marker expression:

    pytest_runner.py tests/test_configs.py -m "not slow"

"No tests collected" (pytest exit code 5) is reported as a failure: a target whose tests are all deselected
is a mis-declared target (see the `slow` argument of `pytest_test`), not a pass.
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


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: pytest_runner.py TEST_FILE [pytest options]", file=sys.stderr)
        return 2
    print(
        f"pytest_runner: {sys.executable} (Python {sys.version.split()[0]}), pytest {pytest.__version__}"
    )
    code = int(pytest.main(pytest_args(argv, dict(os.environ))))
    if code == int(pytest.ExitCode.NO_TESTS_COLLECTED):
        print(
            f"pytest_runner: no tests ran for {argv}; if all tests of the file are marked slow, declare the "
            'target with slow = "all" in tests/BUILD',
            file=sys.stderr,
        )
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
