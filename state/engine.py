"""SQLAlchemy engines and transactions for the state store: SQLite and PostgreSQL made to behave alike.

Called by SqlStore and the migration runner; nothing else opens a database connection. Creating an
engine connects to nothing; the first transaction does.

- SQLite: WAL journal (readers never block the writer), a busy timeout (a writer waits instead of
  failing), foreign keys on, and `BEGIN IMMEDIATE` for write transactions, so two processes that
  read-then-write serialize on the write lock at BEGIN instead of one failing with "database is
  locked" half way through.
- PostgreSQL: `postgresql://` URLs are driven by psycopg 3; READ COMMITTED plus row locks
  (`FOR UPDATE`, `FOR SHARE`, `SKIP LOCKED`) in the store's queries. No round trip checks a pooled
  connection before use (the pool's pre-ping was one more per call): one the server has closed is
  dropped at checkout (`_drop_if_closed_by_server`), and one that breaks inside a transaction raises
  ConnectionLost, which SqlStore answers by making the call again once.
"""

from __future__ import annotations

import contextlib
import select
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pydantic_core
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.exc import DBAPIError, DisconnectionError
from sqlalchemy.pool import StaticPool
from sqlmodel import Session

from mortal.state.errors import ConnectionLost, Unavailable

SQLITE_BUSY_TIMEOUT_MS = 60_000
PG_IDLE_IN_TRANSACTION_TIMEOUT_MS = 30_000
_WRITE = "mortal_write"


def sqlalchemy_url(url: str) -> str:
    """Map user-facing URLs onto SQLAlchemy drivers: postgres[ql]:// -> postgresql+psycopg://."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def sqlite_path(url: str) -> Path | None:
    """The database file of a SQLite URL (None for other databases and in-memory SQLite)."""
    parsed = make_url(sqlalchemy_url(url))
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return Path(parsed.database)


def json_text(value: Any) -> str:
    """A JSON column's text, written by pydantic-core (Rust) rather than the json module SQLAlchemy uses by
    default. Why: a step's rollout answer (64 completions of 256 tokens, 0.5 MB) is written and read in the
    step's critical path; through SQLite that took 13 ms to write and 9 ms to read with the json module,
    3-4 ms and 3 ms with pydantic-core (bench/store_answers.py, docs/benchmarks.md). Same
    JSON as json.dumps (NaN and Infinity included, as Python writes them) except that non-ASCII is written as
    UTF-8 rather than escaped, and a None key becomes "None" rather than "null"."""
    return pydantic_core.to_json(value, inf_nan_mode="constants").decode()


def json_value(value: Any) -> Any:
    """`value` as a JSON column gives it back (tuples as lists, keys as strings): what comparing with a
    stored value must use, written and read by the same codec as the columns."""
    return pydantic_core.from_json(json_text(value))


JSON_CODEC = {"json_serializer": json_text, "json_deserializer": pydantic_core.from_json}


def make_engine(url: str, pool_size: int | None = None) -> Engine:
    """An engine for `url`; nothing is connected yet. JSON columns go through JSON_CODEC.

    `pool_size`: connections the pool keeps open (default SQLAlchemy's). A process that makes calls from
    N threads at once (the store server) asks for N: with fewer kept, every burst of calls past them
    opens connections that are closed again on their return, and on PostgreSQL each is a new server
    process, forked, authenticated and warming its catalog caches while the calls wait.
    """
    url = sqlalchemy_url(url)
    sizing = {} if pool_size is None else {"pool_size": pool_size}
    if make_url(url).get_backend_name() == "sqlite":
        # In-memory SQLite exists per connection: keep exactly one (tests and throwaway stores only).
        pool = {"poolclass": StaticPool} if sqlite_path(url) is None else sizing
        connect_args = {"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000}
        engine = create_engine(url, connect_args=connect_args, **pool, **JSON_CODEC)
        event.listen(engine, "connect", _sqlite_on_connect)
        event.listen(engine, "begin", _sqlite_on_begin)
        return engine
    # A process frozen inside a transaction (SIGSTOP, a paused VM) would hold its row locks for ever and
    # stall every writer behind it, the controller included: the server ends such a session instead.
    options = f"-c idle_in_transaction_session_timeout={PG_IDLE_IN_TRANSACTION_TIMEOUT_MS}"
    engine = create_engine(url, connect_args={"options": options}, **sizing, **JSON_CODEC)
    event.listen(engine, "checkout", _drop_if_closed_by_server)
    return engine


def open_connections(engine: Engine, count: int, prepare: Callable[[Connection], None] | None = None) -> None:
    """Open `count` pooled connections now (at most the pool's size are kept), so that the first calls
    of a server's threads find them open instead of each opening its own while clients wait; each runs
    `prepare` in a transaction rolled back afterwards."""
    with contextlib.ExitStack() as held:
        for _ in range(count):
            conn = held.enter_context(engine.connect())
            if prepare is not None:
                with conn.begin() as transaction:
                    prepare(conn)
                    transaction.rollback()


def _drop_if_closed_by_server(dbapi_connection, connection_record, connection_proxy) -> None:
    """Refuse a pooled PostgreSQL connection that the server has closed while it sat in the pool.

    Why this and not the pool's pre-ping: a ping is a round trip per call, and the store's calls are
    a few round trips each. An idle connection gets nothing from the server unless it is being closed
    (a backend terminated, a server restarting, a timeout: its last message and the end of the
    stream), so a socket with something to read is one to drop; poll(0) asks the kernel without
    waiting. DisconnectionError makes the pool open another connection in its place.
    """
    if dbapi_connection.closed or dbapi_connection.broken:
        raise DisconnectionError("the pooled connection is closed")
    readable = select.poll()
    readable.register(dbapi_connection.fileno(), select.POLLIN)
    if readable.poll(0):
        raise DisconnectionError("the server closed the pooled connection")


def _sqlite_on_connect(dbapi_connection, connection_record) -> None:
    # Turn off pysqlite's own transaction handling, so that the "begin" hook decides how to BEGIN.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def _sqlite_on_begin(conn: Connection) -> None:
    conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get(_WRITE) else "BEGIN")


def is_postgres(engine: Engine | Connection) -> bool:
    return engine.dialect.name == "postgresql"


@contextmanager
def connection(engine: Engine, write: bool = True, one_read: bool = False) -> Iterator[Connection]:
    """One transaction on one connection: committed on success, rolled back on any error.

    `write=True` takes SQLite's write lock at BEGIN (a no-op distinction on PostgreSQL), after this
    process's own writer lock (`_writer_lock`). A connection that breaks raises ConnectionLost when
    nothing can have been committed (before COMMIT was sent: the server rolls the transaction back),
    Unavailable when COMMIT itself got no answer (applied or not, nobody can tell).
    `one_read`: the block runs one reading statement; PostgreSQL runs it on its own (autocommit), without
    the round trips of BEGIN and COMMIT around it (one statement sees one snapshot either way, in READ
    COMMITTED as in a transaction of its own). SQLite keeps the transaction.
    """
    committing = False
    try:
        with _writer_lock(engine, write), engine.connect() as conn:
            if one_read and is_postgres(engine):
                yield conn.execution_options(isolation_level="AUTOCOMMIT")
                return
            conn.execution_options(**{_WRITE: write})
            with conn.begin():
                yield conn
                committing = True
    except DBAPIError as err:
        if not err.connection_invalidated:
            raise
        if committing:
            raise Unavailable(f"the database connection broke while committing: {err.orig}") from err
        raise ConnectionLost(f"the database connection broke: {err.orig}") from err


_WRITER_LOCKS: weakref.WeakKeyDictionary[Engine, threading.RLock] = weakref.WeakKeyDictionary()
_WRITER_LOCKS_GUARD = threading.Lock()


def _writer_lock(engine: Engine, write: bool) -> contextlib.AbstractContextManager[Any]:
    """SQLite writers of one process queue on a lock of the process before they BEGIN IMMEDIATE.

    Why: SQLite has one writer at a time, and a connection that finds the write lock taken waits in
    SQLite's busy handler, which sleeps in steps of up to 100 ms and does not wake when the lock is
    freed. Threads of one process (the store server's, the controller's) then pay those sleeps as
    latency: at 256 clients the store server's p99 was mostly that. Queued here they wake as soon as
    the writer before them commits; only writers of other processes meet the busy handler. Readers
    (WAL) never wait. PostgreSQL has row locks and needs none of this.
    """
    if not write or engine.dialect.name != "sqlite":
        return contextlib.nullcontext()
    with _WRITER_LOCKS_GUARD:
        return _WRITER_LOCKS.setdefault(engine, threading.RLock())


@contextmanager
def transaction(engine: Engine, write: bool = True) -> Iterator[Session]:
    """A Session inside `connection(engine, write)`; rows read from it come back detached."""
    with (
        connection(engine, write) as conn,
        Session(bind=conn, expire_on_commit=False, autoflush=True) as session,
    ):
        yield session
        session.flush()
