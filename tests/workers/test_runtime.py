"""The worker runtime: fencing ends a zombie at once, exit codes and reports, SIGTERM, heartbeats.

A zombie's writes are refused by the store, so the fencing tests run on every store; exit codes,
reports, SIGTERM and heartbeats are the runtime's, on SQLite only (tests/store_kinds.py)."""

from __future__ import annotations

import gc
import json
import os
import signal
import sqlite3
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sim_helpers import SimCluster, Started, wait_for
from store_kinds import sqlite_only

from mortal.state import Store, WorkerRef, paths
from mortal.state.engine import sqlite_path
from mortal.workers.errors import FatalWorkerError
from mortal.workers.runtime import (
    EXIT_FATAL,
    EXIT_FENCED,
    EXIT_RETRYABLE,
    CollectionClock,
    WorkerContext,
    load_run,
    startup_objects_frozen,
    worker_ref_from_env,
)
from mortal.workers.simulated import simulated_run


@pytest.fixture
def cluster(store_url: str, mortal_home: Path) -> Iterator[SimCluster]:
    c = SimCluster(store_url, mortal_home)
    yield c
    c.close()


def snapshot(cluster: SimCluster, started: Started) -> dict[str, Any]:
    """Everything a worker writes: store rows of the run, its own row, and the published files."""
    run = started.ref.run
    store = cluster.store
    files = sorted(
        p.name
        for d in (paths.weights_dir(run), paths.checkpoints_dir(run))
        if d.is_dir()
        for p in d.iterdir()
        if not p.name.startswith(".")
    )  # in-flight temp dirs: never read
    return {
        "metrics": [(m.step, m.name, m.value) for m in store.list_metrics(run)],
        "weights": [w.version for w in store.list_weights(run)],
        "checkpoints": [c.step for c in store.list_checkpoints(run)],
        "tasks": [
            (t.step, t.slot, t.state, t.lease_token) for s in range(1, 50) for t in store.step_results(run, s)
        ],
        "row": cluster.row(started).model_dump(),
        "files": files,
    }


def assert_unchanged_by_zombie(before: dict[str, Any], after: dict[str, Any], zombie: Started) -> None:
    """The store is exactly as before; on disk, at most the zombie's own unrecorded directories were
    added (a rename cannot be fenced; they carry its incarnation and the live worker sweeps them)."""
    assert {k: v for k, v in after.items() if k != "files"} == {
        k: v for k, v in before.items() if k != "files"
    }
    assert set(before["files"]) <= set(after["files"])
    for name in set(after["files"]) - set(before["files"]):
        assert f"-i{zombie.ref.incarnation}" in name, f"{name} written by the zombie"


def start_long_actor(cluster: SimCluster, name: str) -> Started:
    run = cluster.apply(simulated_run(name, max_steps=10_000, rollout_replicas=0, step_seconds=0.05))
    actor = cluster.start(run.name, "actor")
    cluster.wait_step(actor, 2)
    return actor


def test_fenced_worker_exits_at_once_and_writes_nothing_after(cluster: SimCluster) -> None:
    actor = start_long_actor(cluster, "fenced")
    cluster.store.create_worker("fenced", "actor", 0, "local", 5.0)  # a newer incarnation owns the slot
    before = snapshot(cluster, actor)

    started = time.monotonic()
    assert cluster.wait_exit(actor) == EXIT_FENCED
    assert time.monotonic() - started < 5.0, "a fenced worker must exit within about one heartbeat"
    assert_unchanged_by_zombie(before, snapshot(cluster, actor), actor)
    assert "fenced" in paths.worker_log("fenced", "actor", 0, actor.ref.incarnation).read_text()


def all_threads_stopped(pid: int) -> bool:
    """SIGSTOP takes effect as each thread next leaves the kernel, not when kill() returns."""
    states = [
        Path(t, "stat").read_text().rsplit(")", 1)[1].split()[0] for t in Path(f"/proc/{pid}/task").iterdir()
    ]
    return all(state == "T" for state in states)


def pause(pid: int, store_url: str) -> None:
    """SIGSTOP the worker. On SQLite, at a moment it holds no write transaction: a writer frozen
    inside one holds the database lock, and every other writer (the controller too) waits for it."""
    db = sqlite_path(store_url)
    while True:
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: all_threads_stopped(pid), 30, "the worker to stop")
        if db is None:
            return
        try:
            with sqlite3.connect(db, timeout=0.2, isolation_level=None) as probe:
                probe.execute("BEGIN IMMEDIATE")
                probe.execute("ROLLBACK")
            return
        except sqlite3.OperationalError:
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.01)


def test_paused_worker_replaced_then_resumed_changes_nothing(cluster: SimCluster) -> None:
    actor = start_long_actor(cluster, "paused")
    pid = int(actor.handle.split(":")[0])
    pause(pid, cluster.url)
    try:
        time.sleep(0.3)  # whatever it was doing, it is frozen mid-way
        cluster.store.create_worker("paused", "actor", 0, "local", 5.0)
        before = snapshot(cluster, actor)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert cluster.wait_exit(actor) == EXIT_FENCED
    assert_unchanged_by_zombie(before, snapshot(cluster, actor), actor)


@sqlite_only
def test_fatal_worker_error_exits_3_with_its_message(cluster: SimCluster) -> None:
    run = cluster.apply(simulated_run("fatal", annotations={"mortal.dev/step-seconds": "soon"}))
    actor = cluster.start(run.name, "actor")
    assert cluster.wait_exit(actor) == EXIT_FATAL
    row = cluster.row(actor)
    assert (row.state, row.exit_code) == ("Failed", EXIT_FATAL)
    assert row.message.startswith("InvalidAnnotation:") and "soon" in row.message


@sqlite_only
def test_a_crash_exits_75_with_the_error_recorded(cluster: SimCluster) -> None:
    run = cluster.apply(simulated_run("crash", rollout_replicas=0))
    bad = paths.checkpoints_dir(run.name) / "step-2"
    bad.mkdir(parents=True)
    (bad / "state.json").write_text(json.dumps({"step": "two", "weight_version": 2}))
    writer = cluster.store.create_worker(run.name, "actor", 0, "local", 5.0)
    cluster.store.record_checkpoint(WorkerRef(run.name, "actor", 0, writer.incarnation), 2, str(bad), 2)
    cluster.store.end_worker(writer.id, "Lost")

    actor = cluster.start(run.name, "actor")
    assert cluster.wait_exit(actor) == EXIT_RETRYABLE
    row = cluster.row(actor)
    assert (row.state, row.exit_code) == ("Failed", EXIT_RETRYABLE)
    assert row.message.startswith("ValueError:")
    assert "Traceback" in paths.worker_log(run.name, "actor", 0, actor.ref.incarnation).read_text()


@sqlite_only
def test_nonzero_return_is_reported_failed(cluster: SimCluster) -> None:
    run = cluster.apply(simulated_run("failing", annotations={"mortal.dev/fail": "always"}))
    actor = cluster.start(run.name, "actor")
    assert cluster.wait_exit(actor) == EXIT_RETRYABLE
    row = cluster.row(actor)
    assert (row.state, row.exit_code, row.message) == ("Failed", EXIT_RETRYABLE, "exited with code 75")


@sqlite_only
def test_sigterm_stops_gracefully_at_a_step_boundary(cluster: SimCluster) -> None:
    actor = start_long_actor(cluster, "graceful")
    os.killpg(int(actor.handle.split(":")[0]), signal.SIGTERM)
    assert cluster.wait_exit(actor) == 0
    row = cluster.row(actor)
    assert row.state == "Running", "stopped on request: no report; whoever stopped it records Stopped"
    latest = cluster.store.latest_checkpoint("graceful")
    assert latest is not None and latest.step == row.step, "progress since the last checkpoint is kept"
    assert "stopped on request" in paths.worker_log("graceful", "actor", 0, actor.ref.incarnation).read_text()


# -- in-process --------------------------------------------------------------------------------
@sqlite_only
def test_context_heartbeat_sends_reported_progress(store: Store) -> None:
    run = simulated_run("beat")
    store.apply_run(run.name, run.spec_dict(), annotations=run.metadata.annotations)
    row = store.create_worker(run.name, "actor", 0, "local", lease_seconds=0.9)
    env = {
        "MORTAL_RUN": "beat",
        "MORTAL_ROLE": "actor",
        "MORTAL_REPLICA": "0",
        "MORTAL_INCARNATION": str(row.incarnation),
    }

    ctx = WorkerContext.from_env(store, env)
    assert ctx.heartbeat_seconds == pytest.approx(0.3), "a third of the lease"
    assert ctx.run.metadata.annotations["mortal.dev/workload"] == "simulated"
    assert (
        WorkerContext.from_env(store, {**env, "MORTAL_HEARTBEAT_SECONDS": "0.05"}).heartbeat_seconds == 0.05
    )

    ctx.report(step=3, weight_version=2)
    ctx.report(step=4)
    ctx.start()
    try:
        beaten = wait_for(
            lambda: next(w for w in store.list_workers("beat") if w.id == row.id).heartbeat_at, 30
        )
        wait_for(
            lambda: next(w for w in store.list_workers("beat") if w.id == row.id).heartbeat_at > beaten, 30
        )
    finally:
        ctx.close()
    now = next(w for w in store.list_workers("beat") if w.id == row.id)
    assert (now.state, now.step, now.weight_version) == ("Running", 4, 2)
    assert not ctx.stopping.is_set()


def test_the_heartbeat_says_what_the_worker_is_doing_and_for_how_long(store: Store) -> None:
    run = simulated_run("doing")
    store.apply_run(run.name, run.spec_dict(), annotations=run.metadata.annotations)
    row = store.create_worker(run.name, "rollout", 0, "local", lease_seconds=10.0)
    ref = WorkerRef("doing", "rollout", 0, row.incarnation)
    ctx = WorkerContext(store, ref, run, heartbeat_seconds=60.0)
    with ctx.activity("task 3.1"):
        time.sleep(0.3)
        with ctx.activity("weight-load v2"):  # the innermost is reported
            ctx.check_fence()
            inner = next(w for w in store.list_workers("doing") if w.id == row.id)
        ctx.check_fence()
        outer = next(w for w in store.list_workers("doing") if w.id == row.id)
    ctx.check_fence()
    idle = next(w for w in store.list_workers("doing") if w.id == row.id)
    assert inner.activity == "weight-load v2"
    assert (inner.heartbeat_at - inner.activity_since).total_seconds() < 0.3
    assert outer.activity == "task 3.1"
    assert (outer.heartbeat_at - outer.activity_since).total_seconds() >= 0.3
    assert idle.activity is None


STACKS = "--- stacks of every thread: the controller asked for them"


def stuck_in_a_task(store: Store, worker_id: int) -> None:
    """The workload's thread asks for its stacks (as the controller would) and stays stuck here until the
    heartbeat thread answered. Asked from inside, so that whenever the heartbeat writes the stacks this frame
    is on the thread's stack (asked from outside, an answer written while the request's own call was still
    returning showed the store client's frames instead)."""
    store.request_stacks(worker_id)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if next(w for w in store.list_workers("asked") if w.id == worker_id).stacks_written_at is not None:
            return
        time.sleep(0.02)


def test_the_heartbeat_thread_answers_the_controllers_request_for_stacks_once(store: Store, capfd) -> None:
    """On a backend that cannot signal the process (Modal), the request goes through the store: the heartbeat
    reads it back, the heartbeat thread writes every thread's stack (the stuck one's too), and reports it."""
    run = simulated_run("asked")
    store.apply_run(run.name, run.spec_dict(), annotations=run.metadata.annotations)
    row = store.create_worker(run.name, "rollout", 0, "local", lease_seconds=10.0)
    ref = WorkerRef("asked", "rollout", 0, row.incarnation)
    ctx = WorkerContext(store, ref, run, heartbeat_seconds=0.05)
    ctx.start()
    try:
        with ctx.activity("task 2.0"):
            time.sleep(0.2)
            assert STACKS not in capfd.readouterr().err  # not asked: nothing written
            stuck_in_a_task(store, row.id)
        answered = next(w for w in store.list_workers("asked") if w.id == row.id)
        err = capfd.readouterr().err
        assert answered.stacks_written_at is not None
        assert answered.stacks_written_at >= answered.stacks_asked_at
        assert f"{STACKS} (this worker was doing task 2.0 for " in err
        assert "in stuck_in_a_task" in err  # the stuck thread's frame, named
        time.sleep(0.3)  # more heartbeats read the same, answered request
        assert STACKS not in capfd.readouterr().err
        stuck_in_a_task(store, row.id)  # a new request is answered again
        assert f"{STACKS} (this worker was doing nothing)" in capfd.readouterr().err
    finally:
        ctx.close()


@sqlite_only
def test_the_controllers_memory_choice_in_the_environment_is_the_workers_spec(store: Store) -> None:
    """MORTAL_MICRO_BATCH_SIZE (mortal.specs.memory, set by the controller after an
    out-of-memory) replaces the stored spec's micro batch in the worker's view of its run;
    a value that does not divide the batch is fatal."""
    from mortal.specs.memory import MICRO_BATCH_ENV

    run = simulated_run("healed", spec={"algorithm": {"numGenerations": 2, "batchSize": 8}})
    store.apply_run(run.name, run.spec_dict(), annotations=run.metadata.annotations)
    row = store.create_worker(run.name, "actor", 0, "local", lease_seconds=5)
    env = {
        "MORTAL_RUN": "healed",
        "MORTAL_ROLE": "actor",
        "MORTAL_REPLICA": "0",
        "MORTAL_INCARNATION": str(row.incarnation),
    }
    assert WorkerContext.from_env(store, env).run.spec.algorithm.accumulation_steps == 1
    healed = WorkerContext.from_env(store, {**env, MICRO_BATCH_ENV: "2"}).run.spec.algorithm
    assert (healed.micro_batch_size, healed.accumulation_steps) == (2, 4)
    assert (
        store.get_run("healed").spec["algorithm"]["microBatchSize"] is None
    )  # the stored spec is the user's
    with pytest.raises(FatalWorkerError) as refused:
        WorkerContext.from_env(store, {**env, MICRO_BATCH_ENV: "3"})
    assert refused.value.reason == "InvalidMemorySetting" and MICRO_BATCH_ENV in str(refused.value)


def test_stored_spec_that_no_longer_validates_is_fatal(store: Store) -> None:
    store.apply_run("broken", {"model": {"name": "m"}, "bogus": 1})
    with pytest.raises(FatalWorkerError) as err:
        load_run(store, "broken")
    assert err.value.reason == "InvalidSpec"


def test_worker_ref_from_env() -> None:
    env = {"MORTAL_RUN": "r", "MORTAL_ROLE": "rollout", "MORTAL_REPLICA": "2", "MORTAL_INCARNATION": "7"}
    assert worker_ref_from_env(env).id == "r/rollout-2#7"
    with pytest.raises(RuntimeError, match="MORTAL_INCARNATION"):
        worker_ref_from_env({k: v for k, v in env.items() if k != "MORTAL_INCARNATION"})


def test_cpu_threads_give_the_actor_every_core_and_split_them_among_rollouts():
    from mortal.specs import load_text
    from mortal.workers.runtime import cpu_threads

    def run(actor_gpu: str, replicas: int):
        return load_text(
            "apiVersion: mortal/v1\nkind: TrainingRun\nmetadata: {name: t}\n"
            f"spec: {{model: {{name: m}}, dataset: {{name: 'builtin:arith'}}, actor: {{gpu: {actor_gpu}}},"
            f" rollout: {{replicas: {replicas}}}, rewards: [{{function: 'a:b'}}]}}\n"
        )[0]

    assert cpu_threads("actor", run("none", 2), cores=8) == 8
    assert cpu_threads("rollout", run("none", 2), cores=8) == 4
    assert cpu_threads("rollout", run("none", 3), cores=2) == 1
    assert cpu_threads("actor", run("H100", 2), cores=8) is None


class _Node:
    """An object in a reference cycle: only the garbage collector frees it."""

    def __init__(self) -> None:
        self.itself = self


def test_a_workers_loop_runs_with_its_startup_objects_out_of_full_collections() -> None:
    """What was alive as the loop started (imports, model, trainer) is frozen: full collections skip it.
    Start-up's garbage is collected first rather than frozen, and everything is put back after the loop."""
    garbage, alive = _Node(), _Node()
    garbage_ref = weakref.ref(garbage)
    del garbage
    with startup_objects_frozen():
        assert garbage_ref() is None
        assert gc.get_freeze_count() > 0
        assert not any(obj is alive for obj in gc.get_objects())  # frozen objects are not tracked
        during = _Node()
        assert any(obj is during for obj in gc.get_objects())  # what the loop makes is collected as usual
    assert gc.get_freeze_count() == 0
    assert any(obj is alive for obj in gc.get_objects())


def test_the_collection_clock_counts_the_collectors_time_since_it_was_last_read() -> None:
    callbacks = list(gc.callbacks)
    with CollectionClock() as clock:
        clock.take()  # whatever was collected before counts for no step here
        cycles = [_Node() for _ in range(50_000)]
        del cycles
        gc.collect()
        assert clock.take() > 0
        assert clock.take() == 0.0  # read, so reset
    assert gc.callbacks == callbacks  # left as it found them
