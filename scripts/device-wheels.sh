#!/usr/bin/env bash
# Prepares .whl/ for runs on the lent GPU machine (whose image has torch, transformers, accelerate,
# peft, but not TRL, datasets, sqlmodel or pydantic): mortal itself as a wheel, plus what it needs
# that the image lacks, all for CPython 3.12 on x86-64. On that machine:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# then run Python from outside the repository root (its mortal/ folder would shadow the install).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
rm -f .whl/mortal-*.whl
python -m pip wheel -q --no-deps --no-build-isolation -w .whl . 2>/dev/null
download() {
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 -d .whl "$@" 2>/dev/null
}
download trl==1.16.0 datasets dill multiprocess xxhash sqlmodel sqlalchemy greenlet pydantic pydantic-core \
  typing-inspection annotated-types alembic mako typer click shellingham ruamel.yaml watchfiles psutil tenacity inotify-simple liger-kernel
# The image's transformers (5.17) wraps a model sharded at load in DDP, which a sharded actor (actor.count > 1)
# cannot train (workers/actor/sharded.py MIN_TRANSFORMERS): carry the version CI tests. Its needs (huggingface-hub,
# tokenizers, safetensors) are in the image at versions it accepts.
download transformers==5.24.0
ls .whl
