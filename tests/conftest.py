"""Shared fixtures of the whole suite: a private $MORTAL_HOME and a fresh state store per test.

    mortal_home    a tmp folder set as $MORTAL_HOME ($MORTAL_STATE_URL unset)
    store_url      parametrized "sqlite" | "postgres" | "http": a URL of an empty store (sqlite and
                   postgres: a database not yet migrated; http: mortal.state.http_server serving a fresh
                   SQLite file from a thread of this process, $MORTAL_STATE_TOKEN set to its token, so
                   worker subprocesses reach it too)
    sql_store_url  the same, sqlite and postgres only: for tests of SQL itself (engines, migrations)
    store          open_store(store_url), closed after the test
    pg_database    the URL of a fresh PostgreSQL database (for subprocess tests), dropped after
    built_once     built_once(name, build): build(folder) once for the whole test session, pytest-xdist's
                   workers included, and the folder it returned; for read-only artefacts that take long to
                   make (a warm-started model) and come out the same wherever they are made
    ray_cluster    one real three-node Ray cluster per session (tests/raycluster.py), RAY_ADDRESS set to it;
                   only in a private network namespace: scripts/test.sh runs RAY_TEST_FILES in `unshare -rn`
                   (elsewhere they skip, saying how to run them; with CI=true they fail instead)

A test whose subject is not the store narrows `store_url` with a mark of tests/store_kinds.py
(`sqlite_only`, `sql_stores`), which says why one store suffices there.

PostgreSQL is the local server at $MORTAL_TEST_PG_URL (default postgresql://postgres@127.0.0.1:5432/
postgres, trust auth); each test gets its own database `mortal_t_<random>`, dropped WITH (FORCE)
after. Without a reachable server the postgres cases are skipped, except in CI (CI=true): there
they fail, so a broken CI database cannot pass as green.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import pytest
from raycluster import RayCluster, in_private_network

from mortal.state import Store, open_store

PG_ADMIN_URL = os.environ.get("MORTAL_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each worker's torch gets its share of the cores, not all of them. Two workers on
    CI's two cores with two OpenMP threads each made a model that trains in the test process (the tool
    learning tests) about five times slower whenever the other worker trained too: OpenMP threads spin
    while they wait for a core the other process holds. Worker processes the tests start set their own
    threads (MORTAL_THREADS), so only this process is changed."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if os.environ.get("PYTEST_XDIST_WORKER") and workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


@cache
def _pg_unreachable() -> str | None:
    """Why PostgreSQL cannot be used (None when it can); asked once per test session."""
    try:
        import psycopg

        with psycopg.connect(PG_ADMIN_URL, connect_timeout=3):
            return None
    except Exception as err:  # any failure means: no usable server
        return f"PostgreSQL at {PG_ADMIN_URL} is unreachable ({type(err).__name__}: {err})".strip()


def require_postgres() -> None:
    """Skip the calling test without PostgreSQL (fail in CI)."""
    reason = _pg_unreachable()
    if reason is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI=true, so the postgres tests fail instead of skipping")
    pytest.skip(f"{reason}; start it with: pg_ctlcluster --skip-systemctl-redirect 15 main start")


def _with_database(admin_url: str, name: str) -> str:
    base, _, _ = admin_url.rpartition("/")
    return f"{base}/{name}"


@contextmanager
def new_pg_database() -> Iterator[str]:
    """Create an empty database on the test server, yield its URL, drop it (FORCE) afterwards."""
    import psycopg

    require_postgres()
    name = f"mortal_t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield _with_database(PG_ADMIN_URL, name)
    finally:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def mortal_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "mortal_home"
    home.mkdir()
    monkeypatch.setenv("MORTAL_HOME", str(home))
    monkeypatch.delenv("MORTAL_STATE_URL", raising=False)
    return home


@pytest.fixture
def pg_database() -> Iterator[str]:
    with new_pg_database() as url:
        yield url


SQL_STORES = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@contextmanager
def new_store_url(kind: str, home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if kind == "sqlite":
        yield f"sqlite:///{home / 'state.db'}"
    elif kind == "postgres":
        with new_pg_database() as url:
            yield url
    else:
        from mortal.state.http_server import TOKEN_ENV, serve

        token = secrets.token_hex(16)
        monkeypatch.setenv(TOKEN_ENV, token)
        with serve(f"sqlite:///{home / 'state.db'}", token, access_log=home / "access.log") as served:
            yield served.url


@pytest.fixture(params=[*SQL_STORES, "http"])
def store_url(
    request: pytest.FixtureRequest, mortal_home: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    with new_store_url(request.param, mortal_home, monkeypatch) as url:
        yield url


@pytest.fixture(params=SQL_STORES)
def sql_store_url(
    request: pytest.FixtureRequest, mortal_home: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    with new_store_url(request.param, mortal_home, monkeypatch) as url:
        yield url


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    opened = open_store(store_url)
    try:
        yield opened
    finally:
        opened.close()


@pytest.fixture(scope="session")
def built_once(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, Callable[[Path], Path]], Path]:
    """pytest-xdist's workers share the parent of their base temp folders (that session's own): the first
    worker to take the name's lock builds into shared-<name>/, the others wait for it and take its result. A
    module's fixture would otherwise be made again by every worker that runs one of its tests."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent

    def build_once(name: str, build: Callable[[Path], Path]) -> Path:
        done = base / f"shared-{name}.done"  # holds the path build returned
        with open(base / f"shared-{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released as the file closes
            if not done.exists():
                done.write_text(str(build(base / f"shared-{name}")))
            return Path(done.read_text())

    return build_once


RAY_TEST_FILES = (
    "tests/controller/test_ray_backend.py",
    "tests/controller/test_lifecycle_ray.py",
    "tests/workers/test_exact_resume_ray.py",
    "tests/workers/test_no_shared_fs_ray.py",
)  # scripts/test.sh lists the same


@pytest.fixture(scope="session")
def ray_session_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    pytest.importorskip("ray", reason="the ray backend's tests need ray: pip install 'mortal[ray]'")
    if not in_private_network():
        why = (
            "the Ray tests run a real cluster and must run in a private network namespace, loopback only: "
            f"unshare -rn sh -c 'ip link set lo up && python -m pytest {' '.join(RAY_TEST_FILES)}'"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    cluster = RayCluster(Path(tmp_path_factory.mktemp("ray")))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def ray_cluster(ray_session_cluster: RayCluster, monkeypatch: pytest.MonkeyPatch) -> RayCluster:
    monkeypatch.setenv("RAY_ADDRESS", ray_session_cluster.address)
    return ray_session_cluster
