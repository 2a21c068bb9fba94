"""The engine's SQLite writer lock: threads of one process take turns before BEGIN IMMEDIATE, so none of
them meets SQLite's busy handler (whose sleeps, up to 100 ms each, were most of the store server's p99 at
256 clients: docs/benchmarks.md). Shown with SQLite's own busy timeout at 0, where a thread that found the
write lock taken would fail at once with "database is locked"."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from sqlalchemy import event, text

from mortal.state.engine import _writer_lock, connection, make_engine

THREADS, WRITES = 8, 25


@pytest.fixture
def impatient_engine(tmp_path: Path):
    engine = make_engine(f"sqlite:///{tmp_path / 'w.db'}")

    @event.listens_for(engine, "connect")
    def _no_busy_wait(dbapi_connection, _record) -> None:  # after make_engine's own hook: wins
        dbapi_connection.execute("PRAGMA busy_timeout=0")

    with connection(engine) as conn:
        conn.execute(text("CREATE TABLE counter (n INTEGER NOT NULL)"))
        conn.execute(text("INSERT INTO counter VALUES (0)"))
    yield engine
    engine.dispose()


def _hammer(engine, errors: list[BaseException], start: threading.Barrier) -> None:
    start.wait()
    try:
        for _ in range(WRITES):
            with connection(engine) as conn:
                n = conn.execute(text("SELECT n FROM counter")).scalar_one()
                conn.execute(text("UPDATE counter SET n = :n"), {"n": n + 1})
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        errors.append(exc)


def _writers_together(engine) -> list[BaseException]:
    """THREADS threads, started together, each making WRITES read-modify-write transactions; their errors."""
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS)
    threads = [threading.Thread(target=_hammer, args=(engine, errors, start)) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return errors


def test_writers_of_one_process_never_meet_sqlites_busy_handler(impatient_engine) -> None:
    assert _writers_together(impatient_engine) == []
    with connection(impatient_engine, write=False) as conn:
        assert conn.execute(text("SELECT n FROM counter")).scalar_one() == THREADS * WRITES


def test_without_the_lock_the_same_writers_collide(impatient_engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: the first test passes because of the lock, not because the writers never overlapped."""
    import contextlib

    from mortal.state import engine as engine_module

    monkeypatch.setattr(engine_module, "_writer_lock", lambda engine, write: contextlib.nullcontext())
    errors = _writers_together(impatient_engine)
    assert errors and all("database is locked" in str(e) for e in errors)


def test_readers_and_postgresql_take_no_lock(tmp_path: Path) -> None:
    import contextlib

    engine = make_engine(f"sqlite:///{tmp_path / 'r.db'}")
    assert isinstance(_writer_lock(engine, write=False), contextlib.nullcontext)
    assert _writer_lock(engine, write=True) is _writer_lock(engine, write=True)  # one per engine
    assert _writer_lock(make_engine(f"sqlite:///{tmp_path / 'other.db'}"), True) is not _writer_lock(
        engine, True
    )
    assert isinstance(
        _writer_lock(make_engine("postgresql://u@127.0.0.1:1/none"), True), contextlib.nullcontext
    )


def test_a_sqlite_store_and_its_journal_are_readable_by_their_owner_only(tmp_path: Path) -> None:
    """The store holds every run's spec, events and workers: another local user must not read it."""
    from mortal.state import open_store

    store = open_store(f"sqlite:///{tmp_path / 'home' / 'state.db'}")
    try:
        store.list_runs()
    finally:
        store.close()
    made = sorted(tmp_path.joinpath("home").iterdir())
    assert made and all(p.stat().st_mode & 0o777 == 0o600 for p in made), [
        (p.name, oct(p.stat().st_mode)) for p in made
    ]
