# rankwatch: `make demo` runs the main job, `make test` runs every check. Both set up a fresh
# machine on their own: a virtual environment with the CPU torch build, the project, and (for
# tests) the real Prometheus / Alertmanager / VictoriaMetrics binaries.

PYTHON   ?= python3
VENV     ?= .venv
PY       := $(VENV)/bin/python
BACKENDS ?= $(CURDIR)/.cache/backends
STAMP    := $(VENV)/.installed

export RANKWATCH_BACKENDS_BIN := $(BACKENDS)/bin

.PHONY: venv backends demo test lint typecheck unit bench bench-scale clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	# The CPU build first: a plain `torch` requirement would otherwise pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

backends:
	bash deploy/install-backends.sh $(BACKENDS)

demo: venv
	$(VENV)/bin/rankwatch demo $(ARGS)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: venv
	$(VENV)/bin/mypy diagnosis exporter

unit: venv
	$(PY) -m pytest -q $(PYTEST_ARGS)

test: venv backends lint typecheck unit

bench: venv
	$(PY) -m bench.run_all

# Root memory, CPU per window, sockets per rank and publishing at 8 ... 4,096 ranks (spawns up
# to 32 Gloo processes for a few seconds).
bench-scale: venv
	$(PY) -m bench.run_all --only bench_scale

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .pytest_cache .ruff_cache
