"""`pytest_test`: one Bazel py_test per pytest file, run by tests/pytest_runner.py.

    pytest_test(name = "test_x", deps = [...])                  # tests marked slow are skipped
    pytest_test(name = "test_x", deps = [...], slow = "some")   # + target test_x_slow (tag "slow") runs them
    pytest_test(name = "test_x", deps = [...], slow = "all")    # one target, tag "slow", runs every test

`bazel test --test_tag_filters=-slow //...` then runs exactly the tests `make test` runs.
"""

_COMMON_DEPS = [
    "//tests:conftest",
    "//txl_tf",
]

def _py_pytest(name, src, deps, data, marker, tags, size, **kwargs):
    native.py_test(
        name = name,
        srcs = ["pytest_runner.py", src],
        main = "pytest_runner.py",
        args = ["$(location %s)" % src, "-ra", "-m", "'%s'" % marker],
        deps = _COMMON_DEPS + deps,
        data = ["//:pyproject.toml"] + data,
        python_version = "PY3",
        srcs_version = "PY3",
        tags = tags,
        size = size,
        **kwargs
    )

def pytest_test(name, deps = [], data = [], slow = "none", size = "medium", tags = [], **kwargs):
    """Declares the py_test(s) of `<name>.py`.

    Args:
      name: the test file's name without `.py` (e.g. "test_configs").
      deps: py_library targets the test imports (//txl_tf and the conftest are always added).
      data: files the tests read at run time.
      slow: "none", "some" (adds `<name>_slow`, tagged "slow", for the tests marked slow) or "all".
      size: Bazel size of the fast target (the slow ones are "large").
      tags: extra tags.
      **kwargs: passed to py_test (e.g. timeout, shard_count).
    """
    src = name + ".py"
    if slow not in ("none", "some", "all"):
        fail("pytest_test(%s): slow must be 'none', 'some' or 'all', got %r" % (name, slow))
    if slow == "all":
        _py_pytest(name, src, deps, data, "", tags + ["slow"], "large", **kwargs)
        return
    _py_pytest(name, src, deps, data, "not slow", tags, size, **kwargs)
    if slow == "some":
        _py_pytest(name + "_slow", src, deps, data, "slow", tags + ["slow"], "large", **kwargs)
