"""Schema migrations of the state store, run in code (Alembic, scripts in mortal/state/migrations).

Called by `SqlStore.migrate()` (and so by `open_store`) and by the tests. The Alembic Config is
built here with `script_location` pointing at the installed package folder, so migrations run from
a wheel as well as from a checkout; there is no alembic.ini.

Several processes may open the store at once (CLI, controller, workers): the upgrade runs in one
transaction under a lock (SQLite: the write lock taken by BEGIN IMMEDIATE; PostgreSQL: a
transaction-scoped advisory lock), and re-reads the version under that lock, so the second process
finds the schema current and does nothing. Opening an already-current store reads one row.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, text
from sqlalchemy.engine import Connection

from mortal.state.engine import connection, is_postgres

VERSION_TABLE = "mortal_alembic_version"
_PG_LOCK_KEY = 0x6D6F7274616C  # "mortal": the advisory lock serializing migrations on one database


def alembic_config(conn: Connection | None = None) -> Config:
    """An Alembic Config for the package's migration scripts, bound to `conn` when given."""
    cfg = Config()
    cfg.set_main_option("script_location", str(Path(__file__).parent / "migrations"))
    cfg.attributes["connection"] = conn
    return cfg


@cache
def head_revision() -> str:
    """The newest revision shipped with this package."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "no migration scripts found"
    return head


def current_revision(conn: Connection) -> str | None:
    """The revision the database is at (None for an empty database)."""
    return MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}).get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Bring the database to `revision` (default: the newest); safe from several processes at once."""
    if revision == "head":
        with connection(engine, write=False) as conn:
            if current_revision(conn) == head_revision():
                return
    with connection(engine, write=True) as conn:
        if is_postgres(conn):
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_LOCK_KEY})
        command.upgrade(alembic_config(conn), revision)
