"""Migrations: upgrades keep every row, the migrated schema equals the models, opening is cheap and
safe from several processes at once. Run on SQLite and PostgreSQL (the `sql_store_url` fixture: these
tests are about SQL engines and schemas, which the HTTP store's clients never see)."""

from __future__ import annotations

import multiprocessing as mp
from datetime import UTC, datetime

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import MetaData, func, select
from sqlmodel import SQLModel

from mortal.state import migrate, open_store
from mortal.state.engine import connection, make_engine
from mortal.state.migrate import VERSION_TABLE, current_revision, head_revision

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)

# Rows as revision 0001 knew them (no runs.annotations yet).
ROWS_0001 = {
    "runs": [
        dict(
            name=n,
            uid=f"uid-{n}",
            labels={"team": "rl"},
            spec={"model": {"name": "m"}},
            generation=2,
            resource_version=5,
            phase="Running",
            status={"phase": "Running", "step": 7},
            created_at=NOW,
            updated_at=NOW,
            deleted_at=None,
            purge_requested=False,
        )
        for n in ("a", "b")
    ],
    "workers": [
        dict(
            run="a",
            role="actor",
            replica=0,
            incarnation=1,
            backend="local",
            handle="pid:1",
            state="Running",
            heartbeat_at=NOW,
            lease_seconds=10.0,
            step=7,
            weight_version=7,
            exit_code=None,
            message=None,
            started_at=NOW,
            ended_at=None,
        )
    ],
    "checkpoints": [dict(run="a", step=5, path="/c/5", weight_version=5, complete=True, created_at=NOW)],
    "weights": [dict(run="a", version=7, step=7, path="/w/7", method="volume", created_at=NOW)],
    "events": [dict(run="a", type="Normal", reason="Started", message="hi", time=NOW)],
    "metrics": [dict(run="a", step=s, name="loss", value=1.0 / s, time=NOW) for s in (1, 2, 3)],
    "leases": [dict(name="leader", holder="ctl", token=3, expires_at=NOW, renewed_at=NOW)],
    "tasks": [
        dict(
            run="a",
            step=8,
            slot=k,
            min_weight_version=7,
            payload={"p": k},
            state="queued",
            lease_holder=None,
            lease_token=0,
            lease_expires_at=None,
            attempts=0,
            result=None,
            created_at=NOW,
            done_at=None,
        )
        for k in range(3)
    ],
}


def test_upgrade_from_0001_keeps_every_row(sql_store_url: str) -> None:
    engine = make_engine(sql_store_url)
    migrate.upgrade(engine, "0001")
    with connection(engine) as conn:
        assert current_revision(conn) == "0001"
        tables = MetaData()
        tables.reflect(conn)
        assert "annotations" not in tables.tables["runs"].c
        for name, rows in ROWS_0001.items():
            conn.execute(tables.tables[name].insert(), rows)
    engine.dispose()

    store = open_store(sql_store_url)
    try:
        engine = make_engine(sql_store_url)
        with connection(engine, write=False) as conn:
            assert current_revision(conn) == head_revision()
            tables = MetaData()
            tables.reflect(conn)
            for name, rows in ROWS_0001.items():
                count = conn.execute(select(func.count()).select_from(tables.tables[name])).scalar_one()
                assert count == len(rows), name
        engine.dispose()
        run = store.get_run("a")
        assert (run.annotations, run.spec, run.status["step"], run.resource_version) == (
            {},
            {"model": {"name": "m"}},
            7,
            5,
        )
        assert run.created_at == NOW
        assert [m.value for m in store.list_metrics("a")] == [1.0, 0.5, 1.0 / 3]
        assert store.get_lease("leader").token == 3
        assert [w.gpus for w in store.list_workers("a")] == [
            0
        ]  # 0004: GPUs of workers recorded before it unknown
        assert [t.payload for t in store.step_results("a", 8)] == [{"p": 0}, {"p": 1}, {"p": 2}]
    finally:
        store.close()


def test_0010_keeps_the_latest_value_of_a_name_recorded_twice(sql_store_url: str) -> None:
    """Before 0010 two writers of one step at once could leave two rows for a name; the upgrade keeps the
    one written last (the highest id) and from then on the unique index holds one."""
    engine = make_engine(sql_store_url)
    migrate.upgrade(engine, "0009")
    with connection(engine) as conn:
        tables = MetaData()
        tables.reflect(conn)
        rows = [dict(run="a", step=1, name="loss", value=value, time=NOW) for value in (1.0, 2.0, 3.0)] + [
            dict(run="a", step=2, name="loss", value=4.0, time=NOW)
        ]
        conn.execute(tables.tables["metrics"].insert(), rows)
    engine.dispose()
    store = open_store(sql_store_url)
    try:
        assert [(m.step, m.value) for m in store.list_metrics("a")] == [(1, 3.0), (2, 4.0)]
    finally:
        store.close()


def test_models_match_the_migrated_schema(sql_store_url: str) -> None:
    open_store(sql_store_url).close()
    engine = make_engine(sql_store_url)
    with connection(engine, write=False) as conn:
        context = MigrationContext.configure(
            conn, opts={"compare_type": True, "version_table": VERSION_TABLE}
        )
        assert compare_metadata(context, SQLModel.metadata) == []
    engine.dispose()


def test_open_is_cheap_when_current(sql_store_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    open_store(sql_store_url).close()

    def no_upgrade(*args: object, **kwargs: object) -> None:
        raise AssertionError("alembic ran on an up-to-date database")

    monkeypatch.setattr(migrate.command, "upgrade", no_upgrade)
    open_store(sql_store_url).close()


def _open_and_count(url: str) -> int:
    store = open_store(url)
    try:
        return len(store.list_runs())
    finally:
        store.close()


@pytest.mark.timeout(300)
def test_concurrent_first_open_migrates_once(sql_store_url: str) -> None:
    with mp.get_context("spawn").Pool(3) as pool:
        assert pool.map(_open_and_count, [sql_store_url] * 3) == [0, 0, 0]
    engine = make_engine(sql_store_url)
    with connection(engine, write=False) as conn:
        assert current_revision(conn) == head_revision()
    engine.dispose()


def test_default_url_under_mortal_home(mortal_home) -> None:
    store = open_store()
    try:
        store.apply_run("r", {"model": {"name": "m"}})
    finally:
        store.close()
    assert (mortal_home / "state.db").exists()


def test_default_url_creates_a_missing_home(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "not" / "yet"
    monkeypatch.setenv("MORTAL_HOME", str(home))
    monkeypatch.delenv("MORTAL_STATE_URL", raising=False)
    open_store().close()
    assert (home / "state.db").exists()
