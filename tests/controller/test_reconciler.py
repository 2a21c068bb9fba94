"""The reconciler against a real store and an in-memory backend: launch protocol, failures of a launch,
status written once and only when it changed, conflicts, purge, sweeping a vanished run's processes."""

from __future__ import annotations

import dataclasses
import re
import threading
import time

import pytest
from realproc import FAST

from mortal.controller.backends.base import (
    Backend,
    BackendWorker,
    InsufficientGPUs,
    LaunchFailed,
    WorkerLaunch,
)
from mortal.controller.leader import LeaderElector
from mortal.controller.outcome import Done, RequeueAfter, Retry
from mortal.controller.reconciler import Reconciler
from mortal.state import Fenced, NewTask, WorkerRef, paths
from mortal.workers.simulated import simulated_run


class MemoryBackend(Backend):
    name = "local"

    def __init__(self):
        self.workers: dict[str, BackendWorker] = {}
        self.fail: Exception | None = None
        self.on_list = None
        self.lock = threading.Lock()
        self.launched: list[WorkerLaunch] = []

    def launch(self, launch: WorkerLaunch) -> str:
        if self.fail is not None:
            raise self.fail
        self.launched.append(launch)
        handle = f"mem:{launch.worker_id}"
        self.workers[handle] = BackendWorker(
            launch.worker_id, handle, launch.run, launch.role, launch.replica, launch.incarnation, alive=True
        )
        return handle

    def list(self, run=None):
        if self.on_list is not None:
            self.on_list()
        return [w for w in self.workers.values() if run is None or w.run == run]

    def stop(self, handle, grace_seconds=5.0):
        self.workers.pop(handle, None)


@pytest.fixture
def world(store, store_url, mortal_home):
    backend = MemoryBackend()
    elector = LeaderElector(store, holder="me")
    assert elector.try_acquire()
    reconciler = Reconciler(store, store_url, elector, FAST, backends=lambda _: backend)
    return store, backend, reconciler


def apply(store, name="r", **kw):
    run = simulated_run(name, **kw)
    store.apply_run(name, run.spec_dict(), annotations=run.metadata.annotations)


def test_first_pass_records_intent_launches_and_records_handles(world):
    store, backend, rec = world
    apply(store, rollout_replicas=2)
    assert rec.reconcile("r") == RequeueAfter(FAST.plan.active_resync_seconds)
    rows = store.list_workers("r")
    assert [(w.role, w.replica, w.state) for w in rows] == [
        ("actor", 0, "Pending"),
        ("rollout", 0, "Pending"),
        ("rollout", 1, "Pending"),
    ]
    assert {w.handle for w in rows} == set(backend.workers)
    assert store.get_run("r").status["phase"] == "Starting"
    assert [e.reason for e in store.list_events("r")] == ["Launched"] * 3 + ["Starting"]


def test_a_sharded_actor_is_launched_with_a_gpu_per_rank_and_colocated_rollouts_to_see_its_weights(world):
    store, backend, rec = world
    apply(
        store,
        rollout_replicas=2,
        spec={
            "actor": {"gpu": "H100", "count": 2},
            "rollout": {"gpu": "H100", "colocate": True},
            "generation": {"engine": "transformers"},
        },
    )
    rec.reconcile("r")
    launched = {(w.role, w.replica): w for w in backend.launched}
    assert launched["actor", 0].gpu_count == 2
    assert [
        (w.gpu_count, w.colocate, w.sees_actor_gpus) for w in (launched["rollout", 0], launched["rollout", 1])
    ] == [(1, True, True)] * 2  # the ring of weights is on rank 0's GPU, which replica 1 does not share


def test_colocated_replicas_are_launched_beside_the_actor_and_the_others_on_gpus_of_their_own(world):
    store, backend, rec = world
    apply(
        store,
        rollout_replicas=3,
        spec={
            "actor": {"gpu": "H100"},
            "generation": {"engine": "transformers"},
            "rollout": {"gpu": "H100", "colocatedReplicas": 1},
        },
    )
    rec.reconcile("r")
    rollouts = sorted(
        (w.replica, w.colocate, w.sees_actor_gpus) for w in backend.launched if w.role == "rollout"
    )
    assert rollouts == [(0, True, False), (1, False, True), (2, False, True)]  # ipc: the others see its GPU


def test_an_unchanged_world_writes_no_status(world):
    store, backend, rec = world
    apply(store)
    rec.reconcile("r")
    version = store.get_run("r").resource_version
    rec._listings["local"].invalidate()
    rec.reconcile("r")
    assert store.get_run("r").resource_version == version
    assert len(store.list_workers("r")) == 2  # and launched nothing twice


def test_a_failed_launch_closes_its_row_and_retries_with_backoff(world):
    store, backend, rec = world
    apply(store, rollout_replicas=0, spec={"restartPolicy": {"backoffSeconds": 0.0, "maxRestarts": 1}})
    backend.fail = LaunchFailed("no python")
    assert isinstance(rec.reconcile("r"), Retry)
    assert [(w.state, w.message) for w in store.list_workers("r")] == [("Failed", "launch failed: no python")]
    rec.reconcile("r")  # the relaunch fails too: restart 1 of 1 used
    rec.reconcile("r")
    status = store.get_run("r").status
    assert (status["phase"], status["restarts"]) == ("Failed", 1)
    assert "no python" in status["message"]


def test_gpus_busy_is_no_worker_failure_but_a_missing_gpu_fails_the_run(world):
    store, backend, rec = world
    apply(store, rollout_replicas=0)
    backend.fail = InsufficientGPUs(requested=1, free=0, total=1, gpu="H100")
    assert isinstance(rec.reconcile("r"), Retry)
    assert [w.state for w in store.list_workers("r")] == ["Stopped"]
    backend.fail = InsufficientGPUs(requested=2, free=0, total=1, gpu="H100")
    rec.reconcile("r")
    rec.reconcile("r")
    status = store.get_run("r").status
    assert status["phase"] == "Failed" and status["restarts"] == 0
    assert "this machine has 1" in status["message"]


def test_a_spec_change_during_the_pass_is_a_conflict_and_an_immediate_requeue(world):
    store, backend, rec = world
    apply(store)

    def scale_behind_our_back():
        backend.on_list = None
        row = store.get_run("r")
        store.update_spec(
            "r", {**row.spec, "rollout": {**row.spec["rollout"], "replicas": 3}}, row.resource_version
        )

    backend.on_list = scale_behind_our_back
    assert rec.reconcile("r") == RequeueAfter(0.0)
    rec.reconcile("r")
    assert store.get_run("r").status["replicas"]["rollout"]["desired"] == 3
    assert len(store.list_workers("r", live_only=True)) == 4


def test_delete_with_purge_stops_workers_then_removes_rows_and_files(world):
    store, backend, rec = world
    apply(store)
    rec.reconcile("r")
    paths.checkpoints_dir("r").mkdir(parents=True)
    store.mark_deleted("r", purge=True)
    rec.reconcile("r")  # stops both
    assert backend.workers == {}
    rec._listings["local"].invalidate()
    assert rec.reconcile("r") == Done()  # rows ended, then purged
    assert store.list_runs() == [] and store.list_workers() == []
    assert not paths.run_dir("r").exists()


def test_a_purge_also_removes_the_runs_prefix_in_its_checkpoint_storage(world, tmp_path):
    """spec.checkpoint.uri: the run's checkpoints (and a Ray run's uploaded logs) live in storage, not under
    MORTAL_HOME; --purge removes <uri>/<run>/ and leaves other runs' prefixes there."""
    store, backend, rec = world
    bucket = tmp_path / "bucket"
    for run in ("r", "other"):
        (bucket / run / "step-2").mkdir(parents=True)
        (bucket / run / "step-2" / "model.safetensors").write_bytes(b"weights")
    (bucket / "r" / "logs").mkdir()
    apply(store, spec={"checkpoint": {"every": 2, "keep": 2, "uri": f"file://{bucket}"}})
    rec.reconcile("r")
    store.mark_deleted("r", purge=True)
    rec.reconcile("r")  # stops both
    rec._listings["local"].invalidate()
    assert rec.reconcile("r") == Done()
    assert store.list_runs() == []
    assert sorted(p.name for p in bucket.iterdir()) == ["other"]


def test_a_purge_whose_storage_cannot_be_reached_keeps_the_run_and_says_why(world, monkeypatch):
    import fsspec

    from mortal.controller.backends.base import BackendError

    class Denied:
        def invalidate_cache(self, path):
            pass

        def exists(self, path):
            raise PermissionError(f"{path}: access denied")

    store, backend, rec = world
    apply(store, spec={"checkpoint": {"every": 2, "keep": 2, "uri": "memory://bucket/prefix"}})
    rec.reconcile("r")
    store.mark_deleted("r", purge=True)
    rec.reconcile("r")  # stops both
    rec._listings["local"].invalidate()
    monkeypatch.setattr(fsspec.core, "url_to_fs", lambda uri: (Denied(), "bucket/prefix"))
    with pytest.raises(
        BackendError,
        match="cannot remove run 'r'.s checkpoints under spec.checkpoint.uri "
        "'memory://bucket/prefix': PermissionError",
    ):
        rec.reconcile("r")
    assert [r.name for r in store.list_runs()] == ["r"]  # kept: the next pass tries again


def test_a_purge_goes_where_the_backend_keeps_the_files_and_waits_for_a_backend_that_cannot_run_here(
    store, store_url, mortal_home
):
    """A Modal run's files are on its volume: only its backend can remove them. Without one here, the run
    stays (the pass fails and is retried) rather than disappear with its files left behind."""
    from mortal.controller.backends.base import BackendError, BackendUnavailable

    removed = []

    class Remote(MemoryBackend):
        name = "modal"

        def remove_run_files(self, run, storage_uri=None):
            removed.append(run)

    remote = [None]

    def backends(name):
        if remote[0] is None:
            raise BackendUnavailable("no Modal token here")
        return remote[0]

    elector = LeaderElector(store, holder="me")
    assert elector.try_acquire()
    rec = Reconciler(store, store_url, elector, FAST, backends=backends)
    apply(store, spec={"backend": "modal"})
    paths.checkpoints_dir("r").mkdir(parents=True)  # not where a Modal run's checkpoints are
    store.mark_deleted("r", purge=True)
    with pytest.raises(BackendError, match="cannot remove the files of run 'r': no Modal token here"):
        rec.reconcile("r")
    assert [r.name for r in store.list_runs()] == ["r"]
    remote[0] = Remote()
    assert Reconciler(store, store_url, elector, FAST, backends=backends).reconcile("r") == Done()
    assert removed == ["r"] and store.list_runs() == []
    assert paths.checkpoints_dir("r").is_dir(), (
        "the Modal backend removes the volume's folder, not this machine's"
    )


def test_a_run_gone_from_the_store_has_its_leftover_processes_stopped(world):
    store, backend, rec = world
    apply(store)
    rec.reconcile("r")
    store.mark_deleted("r")
    store.purge_run("r")  # as if a purge raced a launch
    assert rec.reconcile("r") == Done()
    assert backend.workers == {}


def test_not_the_leader_reconciles_nothing(store, store_url, mortal_home):
    apply(store)
    backend = MemoryBackend()
    other = LeaderElector(store, holder="other")
    assert other.try_acquire()
    me = LeaderElector(store, holder="me")
    assert not me.try_acquire()
    assert Reconciler(store, store_url, me, FAST, backends=lambda _: backend).reconcile("r") == Done()
    assert store.list_workers("r") == [] and backend.workers == {}


def test_one_listing_serves_many_passes(world):
    store, backend, rec = world
    for i in range(5):
        apply(store, f"r{i}")
        rec.reconcile(f"r{i}")  # launches invalidate the listing
    listing = rec._listings["local"]
    listing.invalidate()
    scans = listing.scans
    for i in range(5):
        rec.reconcile(f"r{i}")
    assert listing.scans == scans + 1


def test_a_hung_worker_is_killed_before_its_row_is_ended(store, store_url, mortal_home):
    """Frozen inside a transaction, a worker may hold the lock on its own row: only its death frees it."""
    backend = MemoryBackend()
    elector = LeaderElector(store, holder="me")
    assert elector.try_acquire()
    rec = Reconciler(
        store,
        store_url,
        elector,
        dataclasses.replace(FAST, worker_lease_seconds=0.2),
        backends=lambda _: backend,
    )
    apply(store)
    rec.reconcile("r")
    actor = next(w for w in store.list_workers("r") if w.role == "actor")
    store.heartbeat(WorkerRef("r", "actor", 0, actor.incarnation), step=1)
    states_at_stop = []
    backend.stop = lambda handle, grace_seconds=5.0: states_at_stop.append(
        (handle, grace_seconds, next(w.state for w in store.list_workers("r") if w.handle == handle))
    )
    time.sleep(0.5)
    rec.reconcile("r")
    assert states_at_stop == [(actor.handle, 0.0, "Running")]
    assert next(w for w in store.list_workers("r") if w.id == actor.id).state == "Lost"


def test_a_lost_rollouts_task_is_released_when_the_pass_ends_its_row(world):
    """kill -9 of a rollout holding a task: the pass that sees the process gone marks it Lost and, in the
    same store call, queues its task again, so another rollout leases it now, not when the lease runs out."""
    store, backend, rec = world
    apply(store, rollout_replicas=2)
    rec.reconcile("r")
    refs = {
        (w.role, w.replica): WorkerRef("r", w.role, w.replica, w.incarnation) for w in store.list_workers("r")
    }
    for ref in refs.values():
        store.heartbeat(ref)
    actor, victim, other = refs["actor", 0], refs["rollout", 0], refs["rollout", 1]
    store.enqueue_tasks(actor, [NewTask(step=1, slot=0, min_weight_version=0)])
    held = store.lease_task(victim, 60)
    store.heartbeat(victim, activity=f"task {held.id}")
    handle = f"mem:{dataclasses.replace(victim, run_uid=store.get_run('r').uid).process_id}"
    backend.workers[handle] = dataclasses.replace(backend.workers[handle], alive=False, exit_code=-9)
    rec._listings["local"].invalidate()
    rec.reconcile("r")
    lost = next(w for w in store.list_workers("r") if w.incarnation == victim.incarnation)
    assert lost.state == "Lost"
    assert lost.message == (
        "process exited with code -9 (killed by SIGKILL: the kernel's out-of-memory killer is a common "
        f"cause); last activity: task {held.id}"
    )
    [task] = store.step_results("r", 1)
    assert task.state == "queued"
    again = store.lease_task(other, 60)
    assert (again.id, again.lease_holder) == (held.id, other.id)
    with pytest.raises(Fenced):
        store.complete_task(victim, held.id, held.lease_token, {"late": True})


def _refs(store):
    return {
        (w.role, w.replica): WorkerRef("r", w.role, w.replica, w.incarnation) for w in store.list_workers("r")
    }


def _condition(store, type_):
    return next(c for c in store.get_run("r").status["conditions"] if c["type"] == type_)


def test_a_rollout_serving_stale_weights_makes_weights_in_sync_false_with_a_warning(world):
    store, backend, rec = world
    apply(store, rollout_replicas=2)
    rec.reconcile("r")
    refs = _refs(store)
    actor = refs[("actor", 0)]
    for version in range(6):
        store.publish_weights(actor, version, version, f"/w/{version}")
    store.heartbeat(actor, step=5, weight_version=5)
    store.heartbeat(refs[("rollout", 0)], weight_version=5)
    store.heartbeat(refs[("rollout", 1)], weight_version=2)  # loaded v2 and never again
    rec.reconcile("r")
    cond = _condition(store, "WeightsInSync")
    assert (cond["status"], cond["reason"]) == ("False", "RolloutLagging")
    assert "rollout-1 at v2; actor at v5" in cond["message"]
    assert ("Warning", "RolloutLagging") in [(e.type, e.reason) for e in store.list_events("r")]
    store.heartbeat(refs[("rollout", 1)], weight_version=5)
    rec.reconcile("r")
    assert _condition(store, "WeightsInSync")["status"] == "True"
    assert [(e.type, e.reason) for e in store.list_events("r")][-1] == ("Normal", "WeightsCurrent")


def test_the_newest_steps_metrics_are_read_once_per_step_and_judge_reward_health(world):
    store, backend, rec = world
    apply(store)
    rec.reconcile("r")
    actor = _refs(store)[("actor", 0)]
    for step in range(1, 13):
        store.add_metrics(
            actor,
            step,
            {
                "reward": 0.0,
                "step_seconds": 0.5,
                "rewards/acc/mean": 0.0,
                "rewards/acc/std": 0.0,
                "rewards/acc/scored": 1.0,
            },
        )
    store.heartbeat(actor, step=12)
    rec.reconcile("r")
    status = store.get_run("r").status
    cond = _condition(store, "RewardHealthy")
    assert (cond["status"], cond["reason"]) == ("False", "RewardConstant")
    assert "'acc'" in cond["message"] and "steps 3-12" in cond["message"]
    assert (status["reward"], status["stepSeconds"], _condition(store, "Progressing")["status"]) == (
        0.0,
        0.5,
        "True",
    )
    calls = []
    original = store.list_metrics
    store.list_metrics = lambda *a, **kw: calls.append(a) or original(*a, **kw)
    rec.reconcile("r")  # the step did not move: no metrics query, the verdict stays
    assert calls == [] and _condition(store, "RewardHealthy")["reason"] == "RewardConstant"


class StackDumpingBackend(MemoryBackend):
    """Records what happened to each process, and the row's state when its stacks were asked for; `signals`:
    whether it can signal a process (local, Ray) or not (Modal)."""

    def __init__(self, store, signals=True):
        super().__init__()
        self.store, self.calls, self.signals = store, [], signals

    def dump_stacks(self, handle):
        row = next(w for w in self.store.list_workers("r") if w.handle == handle)
        self.calls.append(("dump", row.role, row.state))
        return self.signals

    def stop(self, handle, grace_seconds=5.0):
        self.calls.append(("stop", handle, grace_seconds))
        super().stop(handle, grace_seconds)


def _stalled_rollout(store, store_url, backend, config=FAST):
    """A reconciler over `backend`, and the rollout of run r, reporting task 1.0 past its 1 s deadline."""
    elector = LeaderElector(store, holder="me")
    assert elector.try_acquire()
    rec = Reconciler(store, store_url, elector, config, backends=lambda _: backend)
    apply(store, rollout_replicas=1, spec={"deadlines": {"taskSeconds": 1}})
    rec.reconcile("r")
    rollout = next(w for w in store.list_workers("r") if w.role == "rollout")
    ref = WorkerRef("r", "rollout", 0, rollout.incarnation)
    store.heartbeat(ref, activity="task 1.0", activity_seconds=5.0)
    rec._listings["local"].invalidate()
    return rec, rollout, ref


def _stall_events(store):
    """The Warning the stall's end recorded (the DeadlinesMet condition's change has the same reason)."""
    return [
        e
        for e in store.list_events("r")
        if e.reason == "TaskDeadlineExceeded" and e.message.startswith("rollout-0 #")
    ]


def _row(store, worker_id):
    return next(w for w in store.list_workers("r") if w.id == worker_id)


def test_a_stalled_worker_has_its_stacks_asked_for_while_its_row_is_live_then_is_ended_and_stopped(
    store, store_url, mortal_home
):
    backend = StackDumpingBackend(store)
    rec, rollout, _ = _stalled_rollout(store, store_url, backend)
    assert rec.reconcile("r") == RequeueAfter(0.0)  # signalled: its stacks are written, end it at once
    assert backend.calls == [("dump", "rollout", "Running")]  # before the row is ended (its heartbeat fenced)
    asked = _row(store, rollout.id)
    assert asked.state == "Running" and asked.stacks_asked_at == asked.stacks_written_at is not None
    rec.reconcile("r")
    assert [c[0] for c in backend.calls] == ["dump", "stop"]
    ended = _row(store, rollout.id)
    # at least the 5 s the heartbeat reported; more when the pass comes later (a loaded machine)
    assert ended.state == "Failed" and re.match(
        r"TaskDeadlineExceeded: task 1\.0 has run \d+ s", ended.message
    )
    [warned] = _stall_events(store)
    assert warned.type == "Warning" and "; its stacks are in its log; relaunching it" in warned.message


def test_a_worker_its_backend_cannot_signal_is_asked_through_the_store_and_ended_once_it_answered(
    store, store_url, mortal_home
):
    backend = StackDumpingBackend(store, signals=False)
    rec, rollout, ref = _stalled_rollout(store, store_url, backend)
    rec.reconcile("r")
    asked = _row(store, rollout.id)
    assert (asked.state, asked.stacks_written_at) == ("Running", None) and asked.stacks_asked_at is not None
    rec.reconcile("r")  # no answer yet: the worker is left running
    assert [c[0] for c in backend.calls] == ["dump"] and _row(store, rollout.id).state == "Running"
    row = store.heartbeat(ref, activity="task 1.0", activity_seconds=6.0)  # what the worker's heartbeat reads
    assert row.stacks_asked_at == asked.stacks_asked_at and row.stacks_written_at is None
    store.report_stacks(ref)  # the worker wrote them (mortal.workers.runtime)
    rec.reconcile("r")
    assert _row(store, rollout.id).state == "Failed" and [c[0] for c in backend.calls] == ["dump", "stop"]
    [warned] = _stall_events(store)
    assert "; its stacks are in its log; relaunching it" in warned.message


def test_a_worker_that_does_not_answer_the_request_is_ended_after_a_while_and_the_event_says_so(
    store, store_url, mortal_home
):
    config = dataclasses.replace(FAST, plan=dataclasses.replace(FAST.plan, stacks_answer_seconds=0.5))
    rec, rollout, _ = _stalled_rollout(store, store_url, StackDumpingBackend(store, signals=False), config)
    rec.reconcile("r")
    assert _row(store, rollout.id).state == "Running"
    time.sleep(0.6)
    rec.reconcile("r")
    assert _row(store, rollout.id).state == "Failed"
    [warned] = _stall_events(store)
    assert "its stacks are in its log" not in warned.message
    assert "; it did not write its stacks within 0.5 s of being asked; relaunching it" in warned.message
