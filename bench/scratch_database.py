"""A fresh, empty database for one benchmark case (for bench/ scripts).

    from scratch_database import fresh_database
    with fresh_database("sqlite" | "postgres", folder) as url: ...

SQLite: a new file in `folder`. PostgreSQL: a new database on the server of $MORTAL_TEST_PG_URL
(default the local cluster, trust auth), dropped when the block ends, also when it fails.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PG_ADMIN = os.environ.get("MORTAL_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


@contextmanager
def fresh_database(kind: str, folder: Path) -> Iterator[str]:
    if kind == "sqlite":
        yield f"sqlite:///{folder / f'state-{uuid.uuid4().hex[:8]}.db'}"
        return
    import psycopg

    name = f"mortal_bench_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield PG_ADMIN.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
