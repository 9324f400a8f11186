# The two commands of the README: `make run` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: run test test-unit test-gpu test-multihost check chaos fuzz bench deps tools clean

$(VENV)/.installed: pyproject.toml
	@command -v redis-server >/dev/null || $(MAKE) deps
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

DEBIAN_PACKAGES := redis-server wrk nghttp2-client prometheus docker-compose chromium
TOOLS := redis-server wrk h2load promtool docker-compose chromium

deps:  ## Debian packages: redis-server; wrk and h2load (the benchmark, `conveyor bench`); promtool, docker-compose and chromium (the tests of the alert rules, the compose file and Flower's pages)
	@if [ "$$(id -u)" = 0 ]; then apt-get update -q && apt-get install -yq --no-install-recommends $(DEBIAN_PACKAGES); \
	else sudo apt-get update -q && sudo apt-get install -yq --no-install-recommends $(DEBIAN_PACKAGES); fi

tools:  ## `make deps` when any tool the tests use is missing; if it fails, the tests that need that tool skip
	@missing=""; for tool in $(TOOLS); do command -v $$tool >/dev/null || missing="$$missing $$tool"; done; \
	if [ -n "$$missing" ]; then echo "not installed:$$missing; installing them (make deps)"; \
	$(MAKE) deps || echo "make deps failed: the tests that need$$missing skip"; fi

run: $(VENV)/.installed
	$(VENV)/bin/conveyor run

test: $(VENV)/.installed tools  ## everything: the suite on two cores, then the timing-sensitive tests alone
	$(PY) -m pytest -n 2 --dist loadfile -m "not serial" $(PYTEST_ARGS)
	$(PY) -m pytest -n 0 -m serial $(PYTEST_ARGS) || [ $$? -eq 5 ]

test-unit: $(VENV)/.installed  ## the in-process tests only: no redis-server, API or Celery processes
	$(PY) -m pytest -n 2 -m "not integration" $(PYTEST_ARGS)

test-gpu: $(VENV)/.installed  ## the GPU tests (tests/gpu/); they skip without a CUDA device
	$(PY) -m pytest -n 0 -m gpu tests/gpu $(PYTEST_ARGS)

test-multihost: $(VENV)/.installed  ## tests/multihost at 10x its CI size (needs root: network namespaces); figures in multihost-report.json
	CONVEYOR_MULTIHOST_SCALE=10 CONVEYOR_MULTIHOST_REPORT=multihost-report.json $(PY) -m pytest -n 0 -m multihost -s tests/multihost $(PYTEST_ARGS)

chaos: $(VENV)/.installed  ## the chaos suite at a larger size; figures go to chaos-report.jsonl
	CONVEYOR_CHAOS_SCALE=5 CONVEYOR_CHAOS_REPORT=chaos-report.jsonl $(PY) -m pytest -m chaos -s tests/test_chaos.py

fuzz: $(VENV)/.installed  ## schemathesis and the hostile-input fuzzer for 5 minutes; figures in fuzz-report.json
	CONVEYOR_FUZZ_SECONDS=300 $(PY) -m pytest -m fuzz -s --timeout=0 tests/test_fuzz.py

check: $(VENV)/.installed  ## ruff, mypy, and the import rules between batching/, api/ and workers/
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -q -p no:cacheprovider tests/test_import_rules.py

bench: $(VENV)/.installed
	@command -v wrk >/dev/null || $(MAKE) deps
	$(PY) -m bench.run

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
