# The two set-up commands of the README: `make run` and `make test`.
# Each creates (or reuses) the virtual environment in .venv and installs the package into it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DATA_DIR ?= data
MODEL_DIR ?= runs/sample

.PHONY: venv run test test-all test-slow lint bazel-test clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,analysis]'
	touch $@

venv: $(VENV)/.installed

# Main job: prepare the embedded default corpus (real Wikipedia text) and train the CPU-sized model on it.
run: venv
	$(PY) -m txl_tf.data.prepare --dataset=enwik8_sample --data_dir=$(DATA_DIR)/enwik8_sample
	$(PY) -m txl_tf.train --gin_file=gin/sample.gin --model_dir=$(MODEL_DIR) \
	  --gin_param="DATA_DIR='$(DATA_DIR)/enwik8_sample'"

# The fast test suite (< ~10 min on 2 cores), two test files at a time (pytest-xdist; each file stays in one
# worker process, as each is one Bazel target; docs/development.md has the timings). TEST_WORKERS=0 runs them in
# this process.
TEST_WORKERS ?= 2
test: venv
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25

# Everything, slow tests included.
test-all: venv
	$(PY) -m pytest -q -m ''

# The tests marked slow (CI's slow phase): two files at a time as `test` runs them (one such test keeps about one
# of 2 cores busy: 108 of them ran 61 minutes in one process on a 2-core AMD EPYC, AVX2, 2026-11-29, at a load of
# ~1.1), then, one at a time, the files whose tests time a run against a bound (a lost worker's end, a kill's
# resume, a training path's choice on a busy machine), which a second test on the same cores could stretch.
SLOW_SERIAL ?= tests/test_autotune_busy.py tests/test_cluster.py tests/test_train.py
test-slow: venv
	$(PY) -m pytest -q -m slow -n $(TEST_WORKERS) --dist loadfile --durations=25 \
	  $(foreach file,$(SLOW_SERIAL),--ignore=$(file))
	$(if $(strip $(SLOW_SERIAL)),$(PY) -m pytest -q -m slow --durations=10 $(SLOW_SERIAL))

# Bazel (Debian's bazel-bootstrap, offline; see README "Development"): the fast tests, one py_test per file,
# run by the virtual environment's Python. BAZEL_FLAGS='--test_tag_filters=' runs the slow ones too.
BAZEL ?= bazel
BAZEL_TARGETS ?= //...
BAZEL_FLAGS ?= --test_tag_filters=-slow
SHARED_DIR ?= $(abspath ..)/shared
bazel-test: venv
	PATH="$(abspath $(VENV))/bin:$$PATH" TXL_SHARED_DIR="$(SHARED_DIR)" \
	  $(BAZEL) test $(BAZEL_FLAGS) $(BAZEL_TARGETS)

lint: venv
	$(VENV)/bin/ruff check txl_tf tests scripts

clean:
	rm -rf $(VENV) build *.egg-info
