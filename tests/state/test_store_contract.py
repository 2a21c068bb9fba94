"""The Store contract, run against every backend through the `store` fixture (SQLite, PostgreSQL).

Written against mortal.state's public interface only (Store, WorkerRef, LeaderFence, NewTask,
errors), so another implementation (the HTTP store) can run the same suite.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from store_kinds import caller_clock

from mortal.state import (
    ApplyOutcome,
    ChangeRefused,
    Conflict,
    Fenced,
    LeaderFence,
    NewTask,
    NotFound,
    Store,
    WorkerRef,
)
from mortal.state.store import STALE_ROLLOUTS, TaskTally

SPEC = {"model": {"name": "tiny"}, "rollout": {"replicas": 1}, "algorithm": {"learningRate": 5e-6}}


def _spec(**rollout: int) -> dict:
    return {**SPEC, "rollout": {**SPEC["rollout"], **rollout}}


def _worker(store: Store, run: str = "r", role: str = "actor", replica: int = 0) -> WorkerRef:
    row = store.create_worker(run, role, replica, backend="local", lease_seconds=10)
    return WorkerRef(run, role, replica, row.incarnation)


@pytest.fixture
def run(store: Store) -> str:
    store.apply_run("r", SPEC)
    return "r"


# -- runs ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("write", ["apply_run", "update_spec"])
def test_a_finished_run_takes_no_spec_change_and_max_steps_never_goes_below_the_step_reached(
    store: Store, run: str, write: str
) -> None:
    """ChangeRefused, whoever writes (apply, scale): a finished run is forked, not changed; maxSteps below
    the run's step would leave the actor training past it. What changes nothing, and labels, still pass."""

    def change(spec: dict) -> object:
        if write == "apply_run":
            return store.apply_run(run, spec)
        return store.update_spec(run, spec, store.get_run(run).resource_version)

    def max_steps(n: int) -> dict:
        return {**SPEC, "algorithm": {**SPEC["algorithm"], "maxSteps": n}}

    store.write_status(run, {"phase": "Running", "step": 40})
    with pytest.raises(ChangeRefused, match="maxSteps 30 is below step 40"):
        change(max_steps(30))
    change(max_steps(40))
    store.write_status(run, {"phase": "Succeeded", "step": 40})
    with pytest.raises(ChangeRefused, match="is Succeeded; a finished run cannot be changed: fork it"):
        change(max_steps(80))
    assert store.get_run(run).spec == max_steps(40)
    change(max_steps(40))  # the same spec again: nothing to refuse
    assert store.apply_run(run, max_steps(40), {"team": "rl"})[1] is ApplyOutcome.configured


def test_apply_created_unchanged_configured(store: Store) -> None:
    row, outcome = store.apply_run("r", SPEC, {"team": "rl"})
    assert outcome is ApplyOutcome.created
    assert (row.generation, row.resource_version, row.phase, row.spec) == (1, 1, "Pending", SPEC)

    reordered = {"rollout": {"replicas": 1}, "algorithm": {"learningRate": 5e-6}, "model": {"name": "tiny"}}
    row, outcome = store.apply_run("r", reordered, {"team": "rl"})
    assert outcome is ApplyOutcome.unchanged and row.resource_version == 1

    row, outcome = store.apply_run("r", SPEC, {"team": "rl", "tier": "a"})
    assert outcome is ApplyOutcome.configured
    assert (row.generation, row.resource_version) == (1, 2), "labels alone: resource_version only"

    row, outcome = store.apply_run("r", _spec(replicas=3), {"team": "rl", "tier": "a"})
    assert outcome is ApplyOutcome.configured
    assert (row.generation, row.resource_version, row.spec["rollout"]["replicas"]) == (2, 3, 3)

    row, outcome = store.apply_run(
        "r", _spec(replicas=3), {"team": "rl", "tier": "a"}, annotations={"note": "x"}
    )
    assert outcome is ApplyOutcome.configured
    assert (row.generation, row.resource_version, row.annotations) == (2, 4, {"note": "x"})
    assert store.get_run("r") == row


def test_apply_keeps_the_fields_its_document_set_when_it_changes_the_run(store: Store) -> None:
    """`applied` (the fields the document set) is kept for the next apply's three-way merge. A document that
    changes nothing keeps the run's as it was (spelling out what the run has does not take its fields
    over), unless the run had none: a fork's first apply records them."""
    row, _ = store.apply_run("r", SPEC, applied={"model": {"name": "tiny"}})
    assert row.applied == {"model": {"name": "tiny"}}
    row, outcome = store.apply_run("r", SPEC, applied=SPEC)
    assert (
        outcome is ApplyOutcome.unchanged
        and row.resource_version == 1
        and row.applied == {"model": {"name": "tiny"}}
    )
    row, outcome = store.apply_run("r", _spec(replicas=2), applied={"rollout": {"replicas": 2}})
    assert outcome is ApplyOutcome.configured and row.applied == {"rollout": {"replicas": 2}}
    forked = store.fork_run("f", SPEC, {}, {}, "r", 0, "/nowhere", 0)
    assert forked.applied is None, "a fork was never applied"
    row, outcome = store.apply_run("f", SPEC, applied={"model": {"name": "tiny"}})
    assert outcome is ApplyOutcome.unchanged and row.applied == {"model": {"name": "tiny"}}


def test_apply_with_a_resource_version_writes_only_over_that_version(store: Store) -> None:
    """The read-merge-write of mortal.state.apply_document: 0 means "no such run"; a version the run has
    moved past (a scale landed between the read and the write) is a Conflict and writes nothing."""
    row, outcome = store.apply_run("r", SPEC, resource_version=0)
    assert outcome is ApplyOutcome.created
    with pytest.raises(Conflict):
        store.apply_run("r", _spec(replicas=2), resource_version=0)
    store.update_spec("r", _spec(replicas=4), row.resource_version)
    with pytest.raises(Conflict):
        store.apply_run("r", _spec(replicas=2), resource_version=row.resource_version)
    assert store.get_run("r").spec["rollout"]["replicas"] == 4
    row, outcome = store.apply_run("r", _spec(replicas=2), resource_version=row.resource_version + 1)
    assert outcome is ApplyOutcome.configured and row.spec["rollout"]["replicas"] == 2


def test_timestamps_are_utc_aware(store: Store, run: str) -> None:
    row = store.get_run(run)
    assert row.created_at.tzinfo is not None and row.created_at.utcoffset() == timedelta(0)
    assert abs(datetime.now(UTC) - row.created_at) < timedelta(minutes=1)


def test_update_spec_compare_and_swap(store: Store, run: str) -> None:
    row = store.update_spec(run, _spec(replicas=4), resource_version=1)
    assert (row.generation, row.resource_version, row.spec["rollout"]["replicas"]) == (2, 2, 4)
    with pytest.raises(Conflict):
        store.update_spec(run, _spec(replicas=5), resource_version=1)
    assert store.get_run(run).spec["rollout"]["replicas"] == 4
    same = store.update_spec(run, _spec(replicas=4), resource_version=2)
    assert (same.generation, same.resource_version) == (2, 3), "an equal spec does not bump generation"


def test_write_status(store: Store, run: str) -> None:
    row = store.write_status(run, {"phase": "Running", "step": 3})
    assert (row.phase, row.status["step"], row.generation, row.resource_version) == ("Running", 3, 1, 2)
    row = store.write_status(run, {"phase": "Recovering"}, resource_version=2)
    assert row.resource_version == 3
    with pytest.raises(Conflict):
        store.write_status(run, {"phase": "Failed"}, resource_version=2)
    assert store.get_run(run).phase == "Recovering"
    with pytest.raises(Conflict):
        store.update_spec(run, _spec(replicas=2), resource_version=2)


def test_a_status_and_the_events_that_explain_it_land_together_or_not_at_all(store: Store, run: str) -> None:
    phase_event = ("Normal", "Succeeded", "phase Running -> Succeeded")
    row = store.write_status(run, {"phase": "Succeeded"}, resource_version=1, events=[phase_event])
    assert row.phase == "Succeeded"
    assert [(e.type, e.reason, e.message) for e in store.list_events(run)] == [phase_event]
    with pytest.raises(Conflict):
        store.write_status(
            run, {"phase": "Failed"}, resource_version=1, events=[("Warning", "Failed", "lost")]
        )
    assert [e.reason for e in store.list_events(run)] == ["Succeeded"], "a refused status wrote its event"


def test_not_found(store: Store) -> None:
    for call in (
        lambda: store.get_run("nope"),
        lambda: store.update_spec("nope", SPEC, 1),
        lambda: store.write_status("nope", {"phase": "Running"}),
        lambda: store.mark_deleted("nope"),
        lambda: store.purge_run("nope"),
        lambda: store.create_worker("nope", "actor", 0, "local", 10),
        lambda: store.end_worker(12345, "Lost"),
        lambda: store.set_worker_handle(12345, "pid:1"),
    ):
        with pytest.raises(NotFound):
            call()


def test_list_runs_label_selector(store: Store) -> None:
    store.apply_run("a", SPEC, {"team": "rl", "tier": "gold"})
    store.apply_run("b", SPEC, {"team": "rl"})
    store.apply_run("c", SPEC, {"team": "nlp"})
    names = lambda **sel: [r.name for r in store.list_runs(labels=sel or None)]  # noqa: E731
    assert names() == ["a", "b", "c"]
    assert names(team="rl") == ["a", "b"]
    assert names(team="rl", tier="gold") == ["a"]
    assert names(team="vision") == []
    store.mark_deleted("b")
    assert [r.name for r in store.list_runs(labels={"team": "rl"}, include_deleted=False)] == ["a"]


def test_delete_then_purge(store: Store, run: str) -> None:
    ref = _worker(store, run)
    store.add_event(run, "Normal", "Created", "hello")
    store.add_metrics(ref, 1, {"loss": 1.0})
    store.record_checkpoint(ref, 1, "/ckpt/1", 1)
    store.publish_weights(ref, 1, 1, "/w/1")
    store.enqueue_tasks(ref, [NewTask(step=1, slot=0, min_weight_version=0)])
    store.apply_run("other", SPEC)
    store.add_event("other", "Normal", "Created", "kept")

    row = store.mark_deleted(run)
    assert row.deleted_at is not None and not row.purge_requested
    assert store.mark_deleted(run).resource_version == row.resource_version, "idempotent: no second write"
    assert store.mark_deleted(run, purge=True).purge_requested
    with pytest.raises(Conflict):
        store.apply_run(run, _spec(replicas=2))
    with pytest.raises(Conflict):
        store.update_spec(run, SPEC, store.get_run(run).resource_version)
    with pytest.raises(Conflict):
        store.create_worker(run, "rollout", 0, "local", 10)

    uid = store.get_run(run).uid
    assert store.run_uid(run) == uid and store.run_uid("other") == store.get_run("other").uid != uid
    store.purge_run(run)
    with pytest.raises(NotFound):
        store.get_run(run)
    assert store.run_uid(run) is None
    assert store.list_workers(run) == [] and store.list_events(run) == []
    assert (
        store.list_metrics(run) == [] and store.list_checkpoints(run) == [] and store.list_weights(run) == []
    )
    assert store.step_results(run, 1) == []
    assert [e.message for e in store.list_events("other")] == ["kept"]
    row, outcome = store.apply_run(run, SPEC)
    assert outcome is ApplyOutcome.created and row.generation == 1
    assert store.run_uid(run) == row.uid != uid, "a run applied again under its name has a new uid"


# -- workers and fencing -------------------------------------------------------------------------
def test_incarnations_increase_across_the_run(store: Store, run: str) -> None:
    refs = [
        _worker(store, run, "actor", 0),
        _worker(store, run, "rollout", 0),
        _worker(store, run, "rollout", 1),
    ]
    again = _worker(store, run, "rollout", 0)
    assert [r.incarnation for r in [*refs, again]] == [1, 2, 3, 4]
    rows = store.list_workers(run)
    assert [(w.role, w.replica, w.incarnation, w.state) for w in rows] == [
        ("actor", 0, 1, "Pending"),
        ("rollout", 0, 2, "Pending"),
        ("rollout", 0, 4, "Pending"),
        ("rollout", 1, 3, "Pending"),
    ]


def test_heartbeat_carries_what_the_worker_is_doing_since_when_on_the_stores_clock(
    store: Store, run: str
) -> None:
    ref = _worker(store, run)
    row = store.heartbeat(ref, activity="task 3.1", activity_seconds=42.0)
    assert row.activity == "task 3.1"
    assert (row.heartbeat_at - row.activity_since).total_seconds() == pytest.approx(42.0)
    listed = next(w for w in store.list_workers(run) if w.id == row.id)
    assert (listed.activity, listed.activity_since) == (row.activity, row.activity_since)
    idle = store.heartbeat(ref)
    assert (idle.activity, idle.activity_since) == (None, None), "no activity: idle"
    for bad in ("mining 1", "task \x1b[2J", "task " + "x" * 300):
        with pytest.raises(ValueError, match="activity must be one of task, step, weight-load"):
            store.heartbeat(ref, activity=bad)
    for odd in (-5.0, 1e12):  # a worker's number is bounded, never an error (NaN: test_activity_age)
        row = store.heartbeat(ref, activity="step 2", activity_seconds=odd)
        assert row.activity_since <= row.heartbeat_at


def test_a_request_for_a_workers_stacks_is_read_back_by_its_heartbeat_and_answered_once(
    store: Store, run: str
) -> None:
    ref = _worker(store, run, "rollout")
    worker_id = _row_id(store, ref)
    idle = store.heartbeat(ref)
    assert (idle.stacks_asked_at, idle.stacks_written_at) == (None, None)
    assert store.report_stacks(ref).stacks_written_at is None, "an answer nobody asked for is no answer"
    asked = store.request_stacks(worker_id)
    assert asked.stacks_asked_at is not None and asked.stacks_written_at is None
    beat = store.heartbeat(ref, activity="task 1.0", activity_seconds=90.0)
    assert (beat.stacks_asked_at, beat.stacks_written_at) == (asked.stacks_asked_at, None)
    answered = store.report_stacks(ref)
    assert answered.stacks_written_at >= answered.stacks_asked_at
    assert store.report_stacks(ref).stacks_written_at == answered.stacks_written_at, "once per request"
    again = store.request_stacks(worker_id)  # a new request forgets the answer to the last one
    assert again.stacks_asked_at >= answered.stacks_asked_at and again.stacks_written_at is None
    signalled = store.request_stacks(worker_id, written=True)  # the backend signalled the process itself
    assert signalled.stacks_written_at == signalled.stacks_asked_at is not None
    listed = next(w for w in store.list_workers(run) if w.id == worker_id)
    assert (listed.stacks_asked_at, listed.stacks_written_at) == (
        signalled.stacks_asked_at,
        signalled.stacks_written_at,
    )
    store.end_worker(worker_id, "Failed", message="TaskDeadlineExceeded: task 1.0 has run 90 s")
    with pytest.raises(Fenced):
        store.report_stacks(ref)
    ended = store.request_stacks(worker_id)
    assert (ended.state, ended.stacks_asked_at) == ("Failed", signalled.stacks_asked_at), "an ended row stays"
    with pytest.raises(NotFound):
        store.request_stacks(10**9)


@pytest.mark.parametrize(
    "seconds, age",
    [(None, 0.0), (3.5, 3.5), (-1.0, 0.0), (float("nan"), 0.0), (float("inf"), 0.0), (1e12, 365 * 86400.0)],
)
def test_activity_age(seconds, age) -> None:
    from mortal.state.store import activity_age

    assert activity_age(seconds) == age


def test_heartbeat_and_exit(store: Store, run: str) -> None:
    ref = _worker(store, run)
    row = store.heartbeat(ref, step=2, weight_version=2)
    assert (row.state, row.step, row.weight_version) == ("Running", 2, 2) and row.heartbeat_at is not None
    assert store.heartbeat(ref).step == 2, "None leaves step as it was"
    row = store.report_exit(ref, "Succeeded", 0)
    assert (row.state, row.exit_code) == ("Succeeded", 0) and row.ended_at is not None
    with pytest.raises(Fenced):
        store.heartbeat(ref)
    assert store.list_workers(run, live_only=True) == []
    assert store.end_worker(row.id, "Lost").state == "Succeeded", "the first terminal state stays"
    with pytest.raises(ValueError):
        store.end_worker(row.id, "Running")


def test_stale_incarnation_is_fenced(store: Store, run: str) -> None:
    old = _worker(store, run)
    store.heartbeat(old)
    store.enqueue_tasks(old, [NewTask(step=1, slot=0, min_weight_version=0)])
    rollout = _worker(store, run, "rollout", 0)
    task = store.lease_task(rollout, 30)
    assert task is not None

    new = _worker(store, run)  # relaunch of actor-0 without ending the old row: newest wins
    for write in (
        lambda: store.heartbeat(old),
        lambda: store.report_exit(old, "Failed", 1),
        lambda: store.add_metrics(old, 1, {"loss": 0.5}),
        lambda: store.record_checkpoint(old, 1, "/c", 1),
        lambda: store.publish_weights(old, 1, 1, "/w"),
        lambda: store.enqueue_tasks(old, [NewTask(step=2, slot=0, min_weight_version=0)]),
        lambda: store.reset_tasks(old, 0),
    ):
        with pytest.raises(Fenced):
            write()
    store.heartbeat(new)
    store.add_metrics(new, 1, {"loss": 0.5})

    store.end_worker(_row_id(store, rollout), "Lost")
    with pytest.raises(Fenced):
        store.complete_task(rollout, task.id, task.lease_token, {"reward": 1.0})
    with pytest.raises(Fenced):
        store.lease_task(rollout, 30)
    with pytest.raises(Fenced):  # a slot that never existed
        store.heartbeat(WorkerRef(run, "rollout", 7, 1))


def test_a_worker_of_a_purged_run_is_fenced_from_its_successor_of_the_same_name(
    store: Store, run: str
) -> None:
    """Incarnations count from 1 again in a run created anew: the run's uid tells the two apart."""
    old_uid = store.get_run(run).uid
    old = WorkerRef(run, "actor", 0, _worker(store, run).incarnation, run_uid=old_uid)
    store.heartbeat(old)
    store.mark_deleted(run)
    store.purge_run(run)
    store.apply_run(run, SPEC)
    new_uid = store.get_run(run).uid
    assert new_uid != old_uid
    new = WorkerRef(run, "actor", 0, _worker(store, run).incarnation, run_uid=new_uid)
    assert (new.run, new.role, new.replica, new.incarnation) == (
        old.run,
        old.role,
        old.replica,
        old.incarnation,
    )
    with pytest.raises(Fenced, match="earlier run"):
        store.heartbeat(old)
    assert store.heartbeat(new).state == "Running"


def test_a_task_is_completed_only_by_the_worker_holding_its_lease(store: Store, run: str) -> None:
    actor = _worker(store, run)
    store.enqueue_tasks(actor, [NewTask(step=1, slot=0, min_weight_version=0)])
    holder, other = _worker(store, run, "rollout", 0), _worker(store, run, "rollout", 1)
    task = store.lease_task(holder, 30)
    assert not store.complete_task(other, task.id, task.lease_token, {"reward": 1.0})
    assert not store.renew_task(other, task.id, task.lease_token, 30)
    assert store.complete_task(holder, task.id, task.lease_token, {"reward": 1.0})


def test_a_result_reads_back_as_it_was_written(store: Store, run: str) -> None:
    """A rollout's answer through the JSON column (written by pydantic-core,
    state/engine.py): token ids, float log-probabilities to the last bit, text beyond
    ASCII, None, and integers past 64 bits come back equal."""
    actor, rollout = _worker(store, run), _worker(store, run, "rollout", 0)
    store.enqueue_tasks(actor, [NewTask(step=1, slot=0, min_weight_version=0)])
    task = store.lease_task(rollout, 30)
    result = {
        "completion_ids": [[151643, 0, 42]],
        "logprobs": [[-1e-320, -0.1, -3.0000000000000004, -0.0]],
        "completions": ["déjà vu ✓ \u4e2d\u6587"],
        "rewards": {"a": [None, 1.5]},
        "big": 2**70,
    }
    assert store.complete_task(rollout, task.id, task.lease_token, result)
    (row,) = store.step_results(run, 1)
    assert row.result == result and repr(row.result["logprobs"]) == repr(result["logprobs"])


def _row_id(store: Store, ref: WorkerRef) -> int:
    (row,) = [w for w in store.list_workers(ref.run) if w.incarnation == ref.incarnation]
    return row.id


def test_worker_handle(store: Store, run: str) -> None:
    ref = _worker(store, run)
    assert store.set_worker_handle(_row_id(store, ref), "pid:42").handle == "pid:42"


# -- leases --------------------------------------------------------------------------------------
@caller_clock
def test_lease_acquire_renew_takeover(store: Store, run: str) -> None:
    t0 = datetime.now(UTC)
    a = store.acquire_lease("leader", "a", 10, now=t0)
    assert (a.holder, a.token) == ("a", 1)
    assert store.acquire_lease("leader", "b", 10, now=t0 + timedelta(seconds=5)) is None
    renewed = store.acquire_lease("leader", "a", 10, now=t0 + timedelta(seconds=5))
    assert renewed.token == 1 and renewed.expires_at == t0 + timedelta(seconds=15)
    fence_a = LeaderFence("leader", "a", 1)
    store.write_status(run, {"phase": "Running"}, fence=fence_a)
    store.create_worker(run, "actor", 0, "local", 10, fence=fence_a)

    b = store.acquire_lease("leader", "b", 10, now=datetime.now(UTC) + timedelta(seconds=60))
    assert (b.holder, b.token) == ("b", 2)
    assert store.get_lease("leader").holder == "b"
    for write in (
        lambda: store.write_status(run, {"phase": "Failed"}, fence=fence_a),
        lambda: store.create_worker(run, "actor", 0, "local", 10, fence=fence_a),
        lambda: store.end_worker(store.list_workers(run)[0].id, "Lost", fence=fence_a),
        lambda: store.purge_run(run, fence=fence_a),
    ):
        with pytest.raises(Fenced):
            write()
    assert store.get_run(run).phase == "Running"
    store.write_status(run, {"phase": "Recovering"}, fence=LeaderFence("leader", "b", 2))


@caller_clock
def test_expired_or_released_lease_fences(store: Store, run: str) -> None:
    store.acquire_lease("leader", "a", 10, now=datetime.now(UTC) - timedelta(seconds=60))
    with pytest.raises(Fenced):
        store.write_status(run, {"phase": "Running"}, fence=LeaderFence("leader", "a", 1))
    store.acquire_lease("leader", "a", 10)
    store.release_lease("leader", "b")  # not the holder: nothing happens
    store.write_status(run, {"phase": "Running"}, fence=LeaderFence("leader", "a", 1))
    store.release_lease("leader", "a")
    with pytest.raises(Fenced):
        store.write_status(run, {"phase": "Running"}, fence=LeaderFence("leader", "a", 1))
    assert store.acquire_lease("leader", "b", 10).token == 2
    assert store.get_lease("nope") is None
    naive = datetime.now(UTC).replace(tzinfo=None)  # naive times are taken as UTC
    assert store.acquire_lease("other", "a", 10, now=naive).expires_at == (
        naive + timedelta(seconds=10)
    ).replace(tzinfo=UTC)


# -- task queue ----------------------------------------------------------------------------------
def _tasks(*specs: tuple[int, int, int]) -> list[NewTask]:
    return [
        NewTask(step=s, slot=k, min_weight_version=v, payload={"prompt": f"{s}.{k}"}) for s, k, v in specs
    ]


def test_task_queue_order_and_idempotent_enqueue(store: Store, run: str) -> None:
    actor, rollout = _worker(store, run), _worker(store, run, "rollout", 0)
    assert store.enqueue_tasks(actor, _tasks((1, 1, 0), (0, 1, 0), (0, 0, 0))) == 3
    assert store.enqueue_tasks(actor, _tasks((0, 0, 0), (1, 0, 0))) == 1
    order = [store.lease_task(rollout, 30) for _ in range(4)]
    assert [(t.step, t.slot) for t in order] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(t.lease_token == 1 and t.attempts == 1 and t.state == "leased" for t in order)
    assert order[0].payload == {"prompt": "0.0"} and order[0].lease_holder == rollout.id
    assert store.lease_task(rollout, 30) is None
    assert store.complete_task(rollout, order[0].id, order[0].lease_token, {"reward": 0})
    assert store.step_states(run, 0) == ["done", "leased"] and store.step_states(run, 2) == []
    assert store.complete_task(rollout, order[1].id, order[1].lease_token, {"reward": 1})
    results = store.step_results(run, 0)
    assert [(t.slot, t.state, t.result) for t in results] == [
        (0, "done", {"reward": 0}),
        (1, "done", {"reward": 1}),
    ]
    assert store.reset_tasks(actor, 1) == 2
    assert store.step_results(run, 1) == [] and len(store.step_results(run, 0)) == 2


@caller_clock
def test_task_lease_expiry_and_stale_token(store: Store, run: str) -> None:
    actor = _worker(store, run)
    r0, r1 = _worker(store, run, "rollout", 0), _worker(store, run, "rollout", 1)
    store.enqueue_tasks(actor, _tasks((0, 0, 0)))
    t0 = datetime.now(UTC)
    first = store.lease_task(r0, 10, now=t0)
    assert store.lease_task(r1, 10, now=t0 + timedelta(seconds=5)) is None, "lease still valid"
    assert store.renew_task(r0, first.id, first.lease_token, 10)
    second = store.lease_task(r1, 10, now=datetime.now(UTC) + timedelta(seconds=60))
    assert (second.id, second.lease_token, second.attempts) == (first.id, 2, 2)
    assert second.lease_holder == r1.id
    assert not store.renew_task(r0, first.id, first.lease_token, 10)
    assert not store.complete_task(r0, first.id, first.lease_token, {"late": True}), "stale token"
    assert store.complete_task(r1, second.id, second.lease_token, {"ok": True})
    assert not store.complete_task(r1, second.id, second.lease_token, {"twice": True})
    assert store.step_results(run, 0)[0].result == {"ok": True}


def test_ending_a_worker_releases_exactly_its_incarnations_leases(store: Store, run: str) -> None:
    """The controller ends a lost rollout: its tasks are claimable at once, long before their leases run
    out; another worker's lease and the slot's newer incarnation's lease are untouched."""
    actor = _worker(store, run)
    dead, other = _worker(store, run, "rollout", 0), _worker(store, run, "rollout", 1)
    store.enqueue_tasks(actor, _tasks((0, 0, 0), (0, 1, 0), (0, 2, 0)))
    held = store.lease_task(dead, 600)
    kept = store.lease_task(other, 600)
    row = store.end_worker(_row_id(store, dead), "Lost", message="process is gone")
    assert row.state == "Lost"
    by_slot = {t.slot: t for t in store.step_results(run, 0)}
    assert (by_slot[held.slot].state, by_slot[held.slot].lease_holder) == ("queued", None)
    assert (by_slot[kept.slot].state, by_slot[kept.slot].lease_holder) == ("leased", other.id)

    newer = _worker(store, run, "rollout", 0)  # the relaunch, leasing the released task first (oldest slot)
    again = store.lease_task(newer, 600)
    assert (again.id, again.lease_holder, again.attempts) == (held.id, newer.id, 2)
    assert again.lease_token > held.lease_token
    with pytest.raises(Fenced):  # the dead incarnation's late answer is refused
        store.complete_task(dead, held.id, held.lease_token, {"late": True})
    with pytest.raises(Fenced):
        store.renew_task(dead, held.id, held.lease_token, 600)
    assert store.end_worker(row.id, "Lost").state == "Lost"  # ending it again releases nothing more
    assert store.step_results(run, 0)[held.slot].lease_holder == newer.id
    assert store.complete_task(newer, again.id, again.lease_token, {"ok": True})
    assert store.complete_task(other, kept.id, kept.lease_token, {"ok": True})
    assert [t.state for t in store.step_results(run, 0)] == ["done", "done", "queued"]


def test_a_worker_reporting_its_own_exit_releases_its_leases(store: Store, run: str) -> None:
    actor, rollout = _worker(store, run), _worker(store, run, "rollout", 0)
    store.enqueue_tasks(actor, _tasks((0, 0, 0)))
    held = store.lease_task(rollout, 600)
    store.report_exit(rollout, "Failed", 1, "reward function raised")
    other = _worker(store, run, "rollout", 1)
    assert store.lease_task(other, 600).id == held.id


def test_ending_a_worker_leaves_its_done_tasks_done(store: Store, run: str) -> None:
    """Only leased tasks go back to the queue: one its holder completed stays done, with its result."""
    actor, rollout = _worker(store, run), _worker(store, run, "rollout", 0)
    store.enqueue_tasks(actor, _tasks((0, 0, 0)))
    task = store.lease_task(rollout, 600)
    assert store.complete_task(rollout, task.id, task.lease_token, {"ok": True})
    store.end_worker(_row_id(store, rollout), "Lost")
    [row] = store.step_results(run, 0)
    assert (row.state, row.result, row.lease_holder) == ("done", {"ok": True}, rollout.id)


def test_the_task_tally_counts_steps_done_tasks_releases_and_stale_drops(store: Store, run: str) -> None:
    assert store.task_tally(run) == TaskTally()
    actor, dead = _worker(store, run), _worker(store, run, "rollout", 0)
    store.enqueue_tasks(actor, _tasks((1, 0, 0), (1, 1, 0), (2, 0, 0)))
    held = store.lease_task(dead, 600)
    store.end_worker(_row_id(store, dead), "Lost")  # its task is queued again: leased a second time below
    other = _worker(store, run, "rollout", 1)
    again, fresh = store.lease_task(other, 600), store.lease_task(other, 600)
    assert (again.id, again.attempts, fresh.attempts) == (held.id, 2, 1)
    for task in (again, fresh):
        assert store.complete_task(other, task.id, task.lease_token, {"ok": True})
    store.add_event(run, "Warning", STALE_ROLLOUTS, "step 2: 1 task(s) answered with older weights")
    store.add_event(run, "Normal", "Other", "not a stale drop")
    assert store.task_tally(run) == TaskTally(steps=2, tasks=3, done=2, releases=1, stale_drops=1)
    store.reset_tasks(actor, from_step=2)  # a resume queues step 2 again: what it held counts no more
    assert store.task_tally(run) == TaskTally(steps=1, tasks=2, done=2, releases=1, stale_drops=1)


def test_task_max_weight_version(store: Store, run: str) -> None:
    actor, rollout = _worker(store, run), _worker(store, run, "rollout", 0)
    store.enqueue_tasks(actor, _tasks((0, 0, 2), (1, 0, 0)))
    assert store.lease_task(rollout, 30, max_weight_version=0).step == 1
    assert store.lease_task(rollout, 30, max_weight_version=1) is None
    assert store.lease_task(rollout, 30, max_weight_version=2).step == 0


# -- checkpoints, weights, events, metrics -------------------------------------------------------
def test_checkpoints(store: Store, run: str) -> None:
    ref = _worker(store, run)
    assert store.latest_checkpoint(run) is None
    for step in (20, 10, 30):
        store.record_checkpoint(ref, step, f"/ckpt/{step}", weight_version=step)
    assert [c.step for c in store.list_checkpoints(run)] == [10, 20, 30]
    assert all(c.complete for c in store.list_checkpoints(run))
    assert store.latest_checkpoint(run).path == "/ckpt/30"
    store.delete_checkpoint(ref, 30)
    assert store.latest_checkpoint(run).step == 20
    again = store.record_checkpoint(ref, 20, "/ckpt/20b", weight_version=21)
    assert (again.path, again.weight_version) == ("/ckpt/20b", 21)
    assert [c.step for c in store.list_checkpoints(run, complete_only=False)] == [10, 20]


def test_checkpoints_and_weights_keep_what_made_them(store: Store, run: str) -> None:
    ref = _worker(store, run)
    made = {
        "specGeneration": 2,
        "rewardCode": "ab" * 32,
        "dataset": {"name": "d.jsonl", "rows": 3},
        "position": {"step": 5, "consumed": 10},
    }
    store.record_checkpoint(ref, 5, "/ckpt/5", weight_version=5, provenance=made)
    store.record_checkpoint(ref, 6, "/ckpt/6", weight_version=6)
    assert [c.provenance for c in store.list_checkpoints(run)] == [made, None]
    store.publish_weights(ref, 5, step=5, path="/w/v5", provenance=made)
    assert store.latest_weights(run).provenance == made
    again = store.record_checkpoint(
        ref, 5, "/ckpt/5b", weight_version=7, provenance={**made, "specGeneration": 3}
    )
    assert (
        again.provenance["specGeneration"] == 3 == store.list_checkpoints(run)[0].provenance["specGeneration"]
    )


def test_weights(store: Store, run: str) -> None:
    ref = _worker(store, run)
    assert store.latest_weights(run) is None
    for version in (1, 2, 3):
        store.publish_weights(ref, version, step=version, path=f"/w/v{version}")
    with pytest.raises(Conflict):
        store.publish_weights(ref, 3, step=3, path="/w/again")
    with pytest.raises(Conflict):
        store.publish_weights(ref, 2, step=2, path="/w/older")
    assert (store.latest_weights(run).version, store.latest_weights(run).method) == (3, "volume")
    store.delete_weights(ref, 1)
    assert [w.version for w in store.list_weights(run)] == [2, 3]


def test_events_newest_limit_oldest_first(store: Store, run: str) -> None:
    store.apply_run("other", SPEC)
    for i in range(5):
        store.add_event(run, "Normal" if i % 2 else "Warning", f"Reason{i}", f"m{i}")
    store.add_event("other", "Normal", "Other", "o")
    assert [e.message for e in store.list_events(run, limit=3)] == ["m2", "m3", "m4"]
    assert [e.message for e in store.list_events(run)] == ["m0", "m1", "m2", "m3", "m4"]
    assert store.list_events(run)[0].type == "Warning"
    assert [e.message for e in store.list_events(limit=2)] == ["m4", "o"]
    m3 = store.list_events(run)[3]
    assert [e.message for e in store.list_events(run, limit=2, before_id=m3.id)] == ["m1", "m2"], (
        "a page back"
    )


def test_metrics(store: Store, run: str) -> None:
    ref = _worker(store, run)
    store.add_metrics(ref, 2, {"loss": 0.2, "reward/mean": 0.5})
    store.add_metrics(ref, 1, {"loss": 0.1, "kl": 0.0})
    got = [(m.step, m.name, m.value) for m in store.list_metrics(run)]
    assert got == [(1, "kl", 0.0), (1, "loss", 0.1), (2, "loss", 0.2), (2, "reward/mean", 0.5)]
    assert [m.step for m in store.list_metrics(run, name="loss")] == [1, 2]
    assert [m.name for m in store.list_metrics(run, since_step=2)] == ["loss", "reward/mean"]
    store.add_metrics(ref, 2, {"loss": 0.25})  # a resumed run records step 2 again
    assert [m.value for m in store.list_metrics(run, name="loss")] == [0.1, 0.25]
