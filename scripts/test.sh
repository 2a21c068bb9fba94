#!/usr/bin/env bash
# Installs what the tests need and runs them all (unit, both stores, end-to-end, soak): the README's test
# command and CI's (.ci/run). How long it takes on CI's two cores: docs/benchmarks.md, "The test suite".
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup-env.sh
# The store is tested on PostgreSQL for real: start the local cluster if it is down.
if command -v pg_ctlcluster >/dev/null && ! pg_isready -q -h 127.0.0.1 -p 5432; then
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
fi
ruff check .
python scripts/typecheck.py  # mypy, as configured in pyproject's [tool.mypy]
# The Ray backend's tests start a real three-node Ray cluster (tests/raycluster.py): they run in a
# private network namespace, where loopback is the only interface, so Ray binds 127.0.0.1 and nothing leaves it.
# That namespace has its own loopback (no PostgreSQL there): those tests use SQLite. Then everything else.
RAY_TESTS=(tests/controller/test_ray_backend.py tests/controller/test_lifecycle_ray.py tests/workers/test_exact_resume_ray.py
           tests/workers/test_no_shared_fs_ray.py)
if [ "$#" -eq 0 ]; then
  unshare -rn sh -c 'ip link set lo up && exec python -m pytest -q -p no:cacheprovider "$@"' sh "${RAY_TESTS[@]}"
  set -- "${RAY_TESTS[@]/#/--ignore=}"
fi
# Four workers (pytest-xdist), even on CI's two cores: the end-to-end tests spend much of their time
# waiting on worker processes, polls and leases, so each worker added up to four shortened the run (the
# timings: docs/benchmarks.md, "The test suite"). Every test makes its own store, database, home and ports,
# so none shares state with another worker's.
# pytest exits 5 when it collected no test: that is a failure here, as every non-zero exit is.
exec python -m pytest -q -p no:cacheprovider -n 4 --durations=15 "$@"
