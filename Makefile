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
	$(PY) -m pytest -q -p no:cacheprovider

# everything that starts no vLLM engine
test-fast: env
	$(PY) -m pytest -q -m "not vllm"

bench: env
	$(PY) benchmarks/bench_legs.py spec
	$(PY) benchmarks/bench_legs.py trace
	$(PY) benchmarks/bench_explorer.py
