"""tests/pytest_runner.py (the main of every Bazel py_test): real pytest runs in a subprocess, real exit codes."""

import subprocess
import sys
import textwrap

import pytest_runner

RUNNER = pytest_runner.__file__

TESTS = textwrap.dedent(
    """
    import pytest

    def test_fast(tmp_path):
        assert tmp_path.is_dir() and 1 + 1 == 2

    @pytest.mark.slow
    def test_slow():
        assert 2 * 2 == 4
    """
)


def _run(tmp_path, body, *args):
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: slow test\n")
    (tmp_path / "test_sample.py").write_text(body)
    (tmp_path / "bazel_tmp").mkdir(
        exist_ok=True
    )  # Bazel creates TEST_TMPDIR before the test starts
    env = {"PATH": "/usr/bin:/bin", "TEST_TMPDIR": str(tmp_path / "bazel_tmp")}
    return subprocess.run(
        [sys.executable, RUNNER, "test_sample.py", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_passing_file_exits_zero_and_reports_what_ran(tmp_path):
    result = _run(tmp_path, TESTS, "-m", "not slow")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed, 1 deselected" in result.stdout
    assert (
        tmp_path / "bazel_tmp" / "pytest"
    ).is_dir()  # pytest's tmp_path lives under Bazel's TEST_TMPDIR


def test_failing_test_gives_pytest_exit_code_one(tmp_path):
    result = _run(tmp_path, TESTS.replace("1 + 1 == 2", "1 + 1 == 3"), "-m", "not slow")
    assert result.returncode == 1
    assert "1 failed" in result.stdout


def test_nothing_collected_is_a_failure_not_a_pass(tmp_path):
    only_slow = "import pytest\n\n@pytest.mark.slow\ndef test_slow():\n    pass\n"
    result = _run(tmp_path, only_slow, "-m", "not slow")
    assert result.returncode == 1
    assert 'slow = "all"' in result.stderr


def test_file_without_tests_is_a_failure(tmp_path):
    result = _run(tmp_path, "import pytest\n\n\ndef helper():\n    pass\n", "-m", "not slow")
    assert result.returncode == 1
    assert "no tests found" in result.stderr


def test_file_that_skips_itself_passes_and_says_so(tmp_path):
    body = (
        'import pytest\n\npytest.skip("needs the data package", allow_module_level=True)\n' + TESTS
    )
    result = _run(tmp_path, body, "-rs", "-m", "not slow")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "needs the data package" in result.stdout
    assert "the whole file skipped itself" in result.stdout


def test_slow_marker_runs_only_the_slow_tests(tmp_path):
    result = _run(tmp_path, TESTS, "-m", "slow")
    assert result.returncode == 0
    assert "1 passed, 1 deselected" in result.stdout


def test_bazel_environment_adds_basetemp_and_junit_xml():
    env = {"TEST_TMPDIR": "/t", "XML_OUTPUT_FILE": "/x/test.xml"}
    assert pytest_runner.pytest_args(["a.py", "-m", "slow"], env) == [
        "a.py",
        "-m",
        "slow",
        "--basetemp=/t/pytest",
        "--junitxml=/x/test.xml",
    ]
    assert pytest_runner.pytest_args(["a.py"], {}) == ["a.py"]
