#!/usr/bin/env bash
# The quickstart: trains SmolLM2-135M-Instruct on this machine's CPU through the controller and
# follows the run until it succeeds (about 10 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup-env.sh
mortalctl apply -f specs/examples/quickstart.yaml --follow
