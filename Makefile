# Quick start:  make demo   (tiny models on CPU: vanilla vs strict twin drafting)
#               make test   (the test suite)
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: env demo test test-fast bench
env:
	WORKBENCH_VENV=$(VENV) bash scripts/setup_env.sh

demo: env
	$(PY) -m workbench.demo

# two pytest-xdist workers, one test module per worker at a time (module fixtures are built once); most
# engine tests keep one core busy, so two workers fill a 2-core host. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: env
	$(PY) -m pytest -q -p no:cacheprovider --durations=30 $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

# everything that starts no vLLM engine
test-fast: env
	$(PY) -m pytest -q -m "not vllm"

# the demo run and every benchmark run, each into results/<id>/<run id>/ (the figures the README quotes)
bench: env
	$(PY) benchmarks/run_all.py
