#!/usr/bin/env bash
# Installs what the tests need and runs them all (unit, both stores, end-to-end, soak): < 20 min on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup-env.sh
# The store is tested on PostgreSQL for real: start the local cluster if it is down.
if command -v pg_ctlcluster >/dev/null && ! pg_isready -q -h 127.0.0.1 -p 5432; then
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
fi
ruff check .
# pytest exits 5 when it collected no test: that is a failure here, as every non-zero exit is.
exec python -m pytest -q -p no:cacheprovider "$@"
