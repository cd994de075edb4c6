# rankwatch: `make demo` runs the main job, `make test` runs every check. Both set up a fresh
# machine on their own: a virtual environment with the CPU torch build, the project, and (for
# tests) the real Prometheus / Alertmanager / VictoriaMetrics binaries.

PYTHON   ?= python3
VENV     ?= .venv
PY       := $(VENV)/bin/python
BACKENDS ?= $(CURDIR)/.cache/backends
STAMP    := $(VENV)/.installed
UV_PIP   := $(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY)

export RANKWATCH_BACKENDS_BIN := $(BACKENDS)/bin
# Bytecode is written (__pycache__, ignored by git) even where the environment asks otherwise:
# the suite starts several hundred interpreters (ranks, command-line runs) that would each
# compile the project again, and pytest caches its rewritten test modules only this way (a
# collection of the suite took 6 s without, 3 s with).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: venv backends demo test test-fast test-floors fuzz lint typecheck unit generate bench bench-scale accuracy accuracy-unit \
	accuracy-parallel accuracy-trainers accuracy-hang accuracy-deepep reliability-matrix gpu-check clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	# The CPU build first, with pip: a plain `torch` requirement would otherwise pull a multi-GB
	# CUDA build, and pip's configuration is where a machine keeps a local torch wheel.
	$(PY) -m pip install -q torch==2.13.0 'uv>=0.9'
	# The rest with uv, which keeps the torch above (it satisfies every requirement) and
	# resolves the same versions as pip in half the time (20 s against 41 s measured here,
	# bytecode compiled as pip does). With torchtitan (the trainer matrix and its test; it names
	# no torch itself, and imports triton unconditionally, CPU or not) in the same resolution:
	# installed after the project, its datasets pin (huggingface-hub<2) would downgrade the hub
	# under a transformers that needs a newer one, and the framework tests could not import it.
	$(UV_PIP) -e '.[dev]' 'torchtitan==0.3.0' 'triton>=3.5'
	# DeepSpeed (its integration test) ships as source only: build it against the torch above,
	# which an isolated build would replace with a download of another torch.
	$(UV_PIP) --no-build-isolation 'deepspeed>=0.19.8'
	$(PY) -m pip check
	touch $(STAMP)

# The dashboards are also checked against the schema of the oldest Grafana docs/grafana.md
# claims; that SDK is the same package as the dev one, so it lives in a folder of its own.
GRAFANA_SDK_OLDEST := $(VENV)/grafana-sdk-oldest/.installed
$(GRAFANA_SDK_OLDEST): $(STAMP)
	$(PY) -m pip install -q --no-deps --target $(VENV)/grafana-sdk-oldest 'grafana-foundation-sdk==1769699796!10.4.0'
	touch $(GRAFANA_SDK_OLDEST)

venv: $(STAMP) $(GRAFANA_SDK_OLDEST)

backends:
	bash deploy/install-backends.sh $(BACKENDS)

demo: venv
	$(VENV)/bin/rankwatch demo $(ARGS)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

MYPY := $(VENV)/bin/mypy diagnosis exporter rankwatch
typecheck: venv
	$(MYPY)

# Two pytest runs. First, on two workers, everything that can share the machine: the tests
# that start no process world and no server, and the world and server tests marked
# `parallel_safe` (a file's tests stay on one worker, so its module fixtures run once). Then
# the other worlds, real servers and end-to-end suites, one at a time: their verdicts are timed
# (a straggler named because one rank is slower than the others by a margin, an accuracy cell,
# a step time or latency held to a bound, an alert's `for:`), and two of them sharing the
# machine's two cores would make real stragglers. The rule for `parallel_safe` (a file's
# `pytestmark`, or one test's): its checks are counts, contents, exit codes or bounds far above
# what a shared core costs. When in doubt leave it unmarked (alone is always safe); a test that
# fails only beside another is timed: take its mark away. Exit status 5 is "nothing selected"
# (a PYTEST_ARGS path on one side only).
WORLDS := multiproc or servers or e2e
unit: venv
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not ($(WORLDS)) or parallel_safe" \
		$(PYTEST_ARGS) \
		|| [ $$? -eq 5 ]
	$(PY) -m pytest -q -m "($(WORLDS)) and not parallel_safe" $(PYTEST_ARGS) || [ $$? -eq 5 ]

# The quick checks: the engines' and exporter's unit tests, and the dashboard, rule and project
# checks (generated files current, thresholds drawn from the configuration, docs, packaging
# inputs). No process worlds, no real servers or promtool, nothing marked slow. Measured alone
# on a 2-core machine: 2,195 tests in 118 s, about two minutes (not one: the configuration and
# hostile-file corpora and the dashboard checks grew it). The full suite is `make test`.
test-fast: venv
	$(PY) -m pytest -q \
		-m "(diagnosis or exporter or dashboards or project) and not (multiproc or servers or slow)" \
		$(PYTEST_ARGS)

# The type check runs beside the two pytest runs under Linux's idle scheduling policy (nice 19
# where chrt is refused): it takes only CPU time nothing else wants, so no test's timing sees it,
# and the timed worlds leave the cores idle most of the time. Its output comes after the tests';
# either failing fails make test.
IDLE := $(shell chrt -i 0 true 2>/dev/null && echo chrt -i 0 || echo nice -n 19)
test: venv backends lint
	@{ $(IDLE) $(MYPY) > $(VENV)/typecheck.log 2>&1; \
		echo $$? > $(VENV)/typecheck.rc; } & \
	$(MAKE) --no-print-directory unit; unit=$$?; wait; \
	echo "$(MYPY)"; cat $(VENV)/typecheck.log; \
	types=$$(cat $(VENV)/typecheck.rc); [ $$unit -eq 0 ] && [ $$types -eq 0 ]

# The property tests (every test file that uses hypothesis) with fresh randomness: `make test`
# runs them derandomized (the same examples every run; see tests/conftest.py), this runs
# FUZZ_EXAMPLES_FACTOR (default 10) times as many examples per test from a new random seed,
# keeps what fails in .hypothesis/ (replayed first next time) and prints each failing example
# with the @reproduce_failure blob that replays it. Not part of `make test`: a new failure here
# is a bug to fix, with its example added to the test, not a reason for `make test` to flap.
PROPERTY_TESTS = $(filter-out tests/conftest.py,$(shell grep -rlE '^from hypothesis import' tests))
fuzz: venv
	RANKWATCH_HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest -q -n 2 --dist loadfile -p no:cacheprovider \
		-m "not ($(WORLDS))" $(PROPERTY_TESTS) $(PYTEST_ARGS)

# The declared dependency floors, tested: a fresh environment with every runtime dependency (and
# the gRPC extra) pinned to its floor runs the publishing tests. Separate from `test` because it
# builds a second environment; CI runs it after `make test`.
FLOORS_VENV ?= .venv-floors
# The CPU torch build with pip (see $(STAMP)), the rest with the main environment's uv, as there.
test-floors: venv backends
	rm -rf $(FLOORS_VENV)
	$(PYTHON) -m venv $(FLOORS_VENV)
	$(FLOORS_VENV)/bin/python -m pip install -q --upgrade pip
	$(FLOORS_VENV)/bin/python -m pip install -q torch==2.13.0
	$(PYTHON) tests/floor_constraints.py > $(FLOORS_VENV)/floors.txt
	$(VENV)/bin/uv pip install -q --compile-bytecode --python $(FLOORS_VENV)/bin/python \
		--constraint $(FLOORS_VENV)/floors.txt -e '.[grpc]' pytest pytest-timeout hypothesis
	$(FLOORS_VENV)/bin/python -m pip list --format=freeze | grep -iE 'opentelemetry|prometheus|numpy'
	$(FLOORS_VENV)/bin/python -m pytest -q -p no:cacheprovider \
		tests/exporter/publish/test_otlp.py tests/exporter/publish/test_prometheus.py \
		tests/exporter/publish/test_publish.py tests/exporter/publish/test_publish_samples.py

# Rewrites every generated file in place: the dashboards, alert rules and their Kubernetes
# objects, the metric table in docs/metrics.md and the DeepEP pictures in docs/img (removed first,
# so a chart that is no longer drawn goes too). tests/project/test_generated_files.py runs the same
# generators and fails on a stale file. Accuracy and benchmark tables are measurements: their
# own targets below.
generate: venv
	$(PY) -m rankwatch.exporter.assets .
	$(PY) -m rankwatch.exporter.publish.catalogue docs/metrics.md
	rm -f docs/img/deepep-*.png
	$(PY) -c "from rankwatch.exporter.cli.heatmap import render_phase_gallery; \
		render_phase_gallery('docs/img')"

bench: venv
	$(PY) -m bench.run_all

# The step-time accuracy matrices: real Gloo jobs, one slow rank per cell -> docs/accuracy.md:
# the single-dimension matrix, then the 3D-parallel one (both run; either's wrong cell fails).
accuracy: venv
	$(PY) -m bench.accuracy_step_time --out docs/accuracy.md; status=$$?; \
		$(PY) -m bench.accuracy_parallel --out docs/accuracy.md && exit $$status

# The 3D-parallel matrix alone: 4-rank Gloo jobs on a device mesh (tensor, pipeline and data
# parallel), live windows and incidents -> its section of docs/accuracy.md (about 15 minutes).
accuracy-parallel: venv
	$(PY) -m bench.accuracy_parallel --out docs/accuracy.md

# The trainer matrix: torchtitan's own Trainer (FSDP2 x TP, its DCP checkpoints) with
# rankwatch's mixin, 4 Gloo ranks, one slow rank per cell -> its section of docs/accuracy.md
# (about 10 minutes). Accelerate's ParallelismConfig cannot run on a CPU: `make gpu-check`.
accuracy-trainers: venv
	$(PY) -m bench.accuracy_trainers --out docs/accuracy.md

# The hang matrix: real 4-rank Gloo jobs that hang (a rank stuck in its loader or forward, an
# extra or mismatched collective, a rank killed or stopped, the root killed, every rank
# stalled) on DDP, FSDP2, TP x DP and PP x DP, and a long quiet run per shape (compile,
# evaluation, a 60 s checkpoint) -> its section of docs/accuracy.md (about half an hour on 2
# cores). Every job is killed at the end.
accuracy-hang: venv
	$(PY) -m bench.accuracy_hang --out docs/accuracy.md

# The fault's unit matrix: real Gloo jobs in nodes simulated with NODE_NAME (a slow node of 2 or
# 4 ranks, most of a node, one slow GPU on a node, a control), live incidents -> its section
# of docs/accuracy.md (about three minutes).
accuracy-unit: venv
	$(PY) -m bench.accuracy_fault_unit --out docs/accuracy.md

# Regenerates the DeepEP normal-mode accuracy matrix in docs/diagnosis-deepep.md.
accuracy-deepep: venv
	$(PY) -m bench.accuracy_deepep --write

# The storage-fault matrix: real 2-rank Gloo jobs whose folder fills up, turns read-only, is
# deleted, loses its permission, or is a file or a device, against every writer (and the heatmap
# command) -> its section of docs/reliability.md (about three minutes; the mounts need root).
reliability-matrix: venv
	$(PY) -m bench.reliability_matrix --out docs/reliability.md

# Root memory, CPU per window, sockets per rank and publishing at 8 ... 4,096 ranks (spawns up
# to 32 Gloo processes for a few seconds).
bench-scale: venv
	$(PY) -m bench.run_all --only bench_scale

# The GPU clock's device check, run once by hand on a machine with a CUDA GPU (one is enough;
# under four minutes): one table, exit 0 when every cell is right. Without CUDA: one line, 0.
gpu-check: venv
	$(PY) -m bench.gpu_check

clean:
	rm -rf $(VENV) $(FLOORS_VENV) build *.egg-info .mypy_cache .pytest_cache .ruff_cache
