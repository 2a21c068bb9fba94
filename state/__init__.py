"""mortal.state: the state store. `open_store()` is the way in; everything else is its vocabulary.

    from mortal.state import open_store, WorkerRef, Conflict
    store = open_store()                 # $MORTAL_STATE_URL, else SQLite at $MORTAL_HOME/state.db
    store = open_store("https://...")    # the store served over HTTP (token: $MORTAL_STATE_TOKEN)
    run, outcome = store.apply_run("quickstart", spec_dict, labels={"team": "rl"})

Importing this package connects to nothing; `open_store` connects and migrates.
"""

from __future__ import annotations

import contextlib
import os

from mortal.state.engine import sqlite_path
from mortal.state.errors import (
    AlreadyExists,
    ChangeRefused,
    Conflict,
    Fenced,
    InvalidName,
    InvalidValue,
    NotFound,
    StaleDocument,
    StoreError,
)
from mortal.state.paths import default_state_url
from mortal.state.store import (
    ApplyOutcome,
    CompletionOrder,
    LeaderFence,
    NewCompletion,
    NewTask,
    Store,
    WorkerRef,
)
from mortal.state.tables import (
    CheckpointRow,
    CompletionRow,
    EventRow,
    LeaseRow,
    MetricRow,
    RunRow,
    TaskRow,
    WeightRow,
    WorkerRow,
)

__all__ = [
    "AlreadyExists",
    "ApplyOutcome",
    "ChangeRefused",
    "CheckpointRow",
    "CompletionOrder",
    "CompletionRow",
    "Conflict",
    "EventRow",
    "Fenced",
    "InvalidName",
    "InvalidValue",
    "LeaderFence",
    "LeaseRow",
    "MetricRow",
    "NewCompletion",
    "NewTask",
    "NotFound",
    "RunRow",
    "StaleDocument",
    "Store",
    "StoreError",
    "TaskRow",
    "WeightRow",
    "WorkerRef",
    "WorkerRow",
    "open_store",
]


def open_store(url: str | None = None, connections: int | None = None) -> Store:
    """The store at `url` (default: $MORTAL_STATE_URL, else SQLite under $MORTAL_HOME), migrated.

    URLs: `sqlite:///PATH` (its folder is created), `postgresql://user@host/db`, or `http(s)://HOST`
    (mortal.state.http_store: the server owns the database and migrated it when it started).
    `connections`: for a SQL store, database connections to open now and keep open, one per thread that
    will call it at once (the store server passes its threads); default: opened on demand.
    """
    url = url or default_state_url()
    if url.startswith(("http://", "https://")):
        if connections is not None:
            raise ValueError("connections: the HTTP store's database connections are its server's")
        from mortal.state.http_store import HttpStore

        # Its Store methods are generated from the wire's method table when the class is made
        # (http_store._with_remote_methods), which a type checker cannot see.
        return HttpStore(url)  # type: ignore[abstract]
    from mortal.state.sql_store import SqlStore

    path = sqlite_path(url)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # created readable by its owner only (SQLite gives its -wal and -shm files the same mode): the
        # store holds every run's spec, events and worker records, which the HTTP store guards by token
        with contextlib.suppress(FileExistsError):
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    store = SqlStore(url, pool_size=connections)
    store.migrate()
    if connections is not None:
        store.open_connections(connections)
    return store
