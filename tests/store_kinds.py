"""Which stores a test runs on, when its subject is the controller, the workers or the CLI, not the store.

tests/conftest.py's `store_url` runs a test on every store (SQLite, PostgreSQL, the HTTP store).
The store itself is held to its contract on all of them (tests/state/), so a test of what is built
on the store needs one store only, unless the store's own behaviour is part of what it checks:

    @sqlite_only    the subject is the controller, a worker or the CLI: SQLite, the default store
    @sql_stores     a process is frozen or killed while it may hold a transaction open, which only a
                    SQL store lets it do (SQLite's write lock: controller/lockwatch.py; PostgreSQL's
                    idle-in-transaction timeout: mortal.state.engine)
    @caller_clock   the test moves time by passing `now`, which only a SqlStore in this process takes: over
                    HTTP the server's clock decides leases (tests/state/test_http_auth.py checks that)

Each store is still driven through the whole controller: the actor-kill recovery runs on every
store (test_lifecycle_actor_kill.py), the soak and the frozen-process tests on both SQL stores, the
Modal lifecycle on the HTTP store.
"""

from __future__ import annotations

import pytest

sqlite_only = pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
sql_stores = pytest.mark.parametrize(
    "store_url", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
caller_clock = sql_stores
