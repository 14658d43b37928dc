# Two entry points: `make demo` (the main job) and `make test` (the whole suite).
# Each creates .venv inside the repo on first use and installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

.PHONY: demo test test-fast install device-wheels
install: $(STAMP)

demo: $(STAMP)
	$(PY) -m tpurl train --gin_file configs/demo.gin

test: $(STAMP)
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(PY) -m pytest -q -n 2 --dist loadfile --durations=15 tests

# The inner loop: everything but the tests marked slow (subprocesses, several processes, whole runs,
# a compile of their own over about 2.5 s).
test-fast: $(STAMP)
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(PY) -m pytest -q -n 2 --dist loadfile -m "not slow" tests

# Pure-Python dependencies the accelerator image lacks, as wheels for scripts/device_check.sh.
device-wheels: $(STAMP)
	$(PY) -m pip download -q --no-deps --only-binary=:all: -d .whl gin-config tensorboardX
