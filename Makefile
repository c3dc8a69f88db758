# Quick start:  make demo   (tiny models on CPU: vanilla vs strict twin drafting)
#               make test   (the test suite)
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: env demo test test-fast bench
env:
	WORKBENCH_VENV=$(VENV) bash scripts/setup_env.sh

demo: env
	$(PY) -m workbench.demo

test: env
	$(PY) -m pytest -q -p no:cacheprovider --durations=30

# everything that starts no vLLM engine
test-fast: env
	$(PY) -m pytest -q -m "not vllm"

# the demo run and every benchmark run, each into results/<id>/<run id>/ (the figures the README quotes)
bench: env
	$(PY) benchmarks/run_all.py
