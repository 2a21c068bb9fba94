"""The sampled completions in the store: recorded per step by the actor, read by `get completions`.

Run against every store (SQLite, PostgreSQL, and the HTTP store in front of SQLite) through the
`store` fixture; the migration that adds the table runs on both SQL engines (`sql_store_url`).
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from sqlalchemy import MetaData

from mortal.state import CompletionOrder, Fenced, NewCompletion, Store, WorkerRef, open_store
from mortal.state.engine import connection, make_engine
from mortal.state.migrate import current_revision, head_revision, upgrade

SPEC = {"model": {"name": "tiny"}}
NOW = datetime(2026, 1, 2, tzinfo=UTC)
LONG = "def f(x):\n    return x  # " + "ü" * 5000  # long, multi-line, not ASCII: must come back as written


def _actor(store: Store, run: str = "r") -> WorkerRef:
    row = store.create_worker(run, "actor", 0, backend="local", lease_seconds=10)
    return WorkerRef(run, "actor", 0, row.incarnation)


def _sample(i: int, reward: float | None, **kw) -> NewCompletion:
    fields = dict(
        sample=i,
        prompt=f"What is {i} + 1?",
        completion=str(i + 1),
        rewards={"correct": reward},
        reward=reward,
        advantage=0.5 - i,
        weight_version=3,
        extra={"seen": i},
    )
    return NewCompletion(**{**fields, **kw})


@pytest.fixture
def actor(store: Store) -> WorkerRef:
    store.apply_run("r", SPEC)
    return _actor(store)


def test_a_step_keeps_every_field_and_full_text(store: Store, actor: WorkerRef) -> None:
    store.add_completions(
        actor,
        1,
        [
            _sample(
                0,
                1.0,
                completion=LONG,
                rewards={"correct": 1.0, "judge": None},
                extra={"seen": 0, "note": "ok", "flag": True},
            )
        ],
    )
    [row] = store.list_completions("r", step=1)
    assert (row.run, row.step, row.sample, row.completion, row.reward, row.advantage, row.weight_version) == (
        "r",
        1,
        0,
        LONG,
        1.0,
        0.5,
        3,
    )
    assert row.rewards == {"correct": 1.0, "judge": None}
    assert row.extra == {"seen": 0, "note": "ok", "flag": True}
    assert row.time.utcoffset() is not None


def test_steps_are_listed_in_order_and_a_step_recorded_again_is_replaced(
    store: Store, actor: WorkerRef
) -> None:
    store.add_completions(actor, 2, [_sample(i, float(i)) for i in range(3)])
    store.add_completions(actor, 1, [_sample(i, float(i)) for i in range(2)])
    assert store.completion_steps("r") == [1, 2]
    assert [(c.step, c.sample) for c in store.list_completions("r")] == [
        (1, 0),
        (1, 1),
        (2, 0),
        (2, 1),
        (2, 2),
    ]
    store.add_completions(actor, 2, [_sample(0, 9.0)])  # a resumed actor trains step 2 again
    assert [(c.sample, c.reward) for c in store.list_completions("r", step=2)] == [(0, 9.0)]
    assert store.list_completions("r", step=7) == [] and store.completion_steps("other") == []


def test_worst_and_best_sort_by_total_reward_with_unscored_last(store: Store, actor: WorkerRef) -> None:
    rewards = [0.5, None, -1.0, 2.0, 0.5]
    store.add_completions(actor, 1, [_sample(i, r) for i, r in enumerate(rewards)])
    worst = store.list_completions("r", step=1, order=CompletionOrder.worst)
    assert [c.sample for c in worst] == [2, 0, 4, 3, 1]  # ties keep the sampled order
    best = store.list_completions("r", step=1, order=CompletionOrder.best, limit=2)
    assert [c.sample for c in best] == [3, 0]
    assert [c.sample for c in store.list_completions("r", order="worst", limit=1)] == [2]
    with pytest.raises(ValueError, match="limit"):
        store.list_completions("r", limit=0)


def test_only_the_live_actor_records_completions(store: Store, actor: WorkerRef) -> None:
    newer = _actor(store)
    with pytest.raises(Fenced):
        store.add_completions(actor, 1, [_sample(0, 1.0)])
    store.add_completions(newer, 1, [_sample(0, 1.0)])
    assert len(store.list_completions("r")) == 1


def test_purging_a_run_removes_its_completions_only(store: Store, actor: WorkerRef) -> None:
    store.add_completions(actor, 1, [_sample(0, 1.0)])
    store.apply_run("other", SPEC)
    store.add_completions(_actor(store, "other"), 1, [_sample(0, 2.0)])
    store.mark_deleted("r", purge=True)
    store.purge_run("r")
    assert store.list_completions("r") == [] and store.completion_steps("r") == []
    assert [c.reward for c in store.list_completions("other")] == [2.0]


def test_migration_0003_adds_the_table_and_keeps_the_runs(sql_store_url: str) -> None:
    engine = make_engine(sql_store_url)
    upgrade(engine, "0002")
    with connection(engine) as conn:
        tables = MetaData()
        tables.reflect(conn)
        assert "completions" not in tables.tables
        conn.execute(
            tables.tables["runs"].insert(),
            [
                dict(
                    name="old",
                    uid="u",
                    labels={},
                    annotations={},
                    spec=SPEC,
                    generation=1,
                    resource_version=1,
                    phase="Running",
                    status={},
                    created_at=NOW,
                    updated_at=NOW,
                    deleted_at=None,
                    purge_requested=False,
                )
            ],
        )
    engine.dispose()
    store = open_store(sql_store_url)
    try:
        assert store.get_run("old").phase == "Running" and store.list_completions("old") == []
        store.add_completions(_actor(store, "old"), 1, [_sample(0, 1.0)])
        assert store.completion_steps("old") == [1]
    finally:
        store.close()
    engine = make_engine(sql_store_url)
    with connection(engine, write=False) as conn:
        assert current_revision(conn) == head_revision() >= "0003"
    engine.dispose()
