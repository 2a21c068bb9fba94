"""`backend: modal` end to end: a real controller, the Modal backend, the fake of the Modal calls it
makes (backends/modal_fake.py: each call's body and worker are real processes) and the HTTP store
(workers on Modal reach the store only over HTTP). A simulated run succeeds, its logs read from the
volume and its folder purged from it; recovery with the same guarantees as locally: a killed worker,
a call that ends with an error, one that vanishes, a preempted one (Modal restarts its input: soon,
or after the worker's lease), each noticed and relaunched (or resumed) from the checkpoint; a restarted
controller re-adopts the calls from the modal.Dict, and a standby controller takes over from one
that died holding the lease."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from realproc import (  # noqa: F401
    FAST,
    Harness,
    delete_and_wait,
    harness,
    wait_for,
    wait_no_workers,
    worker_processes,
)
from typer.testing import CliRunner

from mortal.client.cli.main import app
from mortal.controller.backends import Backend, select_backend
from mortal.controller.backends.modal import ModalBackend
from mortal.controller.manager import Controller
from mortal.controller.reconciler import ControllerConfig
from mortal.state import paths
from mortal.workers.simulated import simulated_run

sys.path.insert(0, str(Path(__file__).parent / "backends"))
from modal_fake import FakeModal  # noqa: E402

pytestmark = pytest.mark.parametrize("store_url", ["http"], indirect=True)


@pytest.fixture
def fake(mortal_home: Path) -> Iterator[FakeModal]:
    modal = FakeModal(volume=mortal_home)
    yield modal
    modal.shutdown()


def start(h: Harness, fake: FakeModal, config: ControllerConfig = FAST) -> Controller:
    """A controller whose modal backend is a new ModalBackend over the fake (a new controller process)."""

    def backends(name: str) -> Backend:
        return ModalBackend(modal=fake) if name == "modal" else select_backend(name)

    controller = Controller(h.store, h.url, config, backends=backends).start()
    h.controllers.append(controller)
    return controller


def call_of(h: Harness, run: str, role: str) -> str:
    """The Modal call id of the role's live worker (its row's handle)."""
    [row] = [w for w in h.live_rows(run, role) if w.handle]
    return row.handle.removeprefix("modal:")


def relaunched(h: Harness, run: str, role: str, incarnation: int = 2, live_only: bool = True) -> bool:
    rows = h.live_rows(run, role) if live_only else [w for w in h.store.list_workers(run) if w.role == role]
    return any(w.incarnation >= incarnation and w.handle for w in rows)


def modal_run(name: str, max_steps: int):
    return simulated_run(
        name,
        max_steps=max_steps,
        rollout_replicas=1,
        step_seconds=0.1,
        spec={
            "backend": "modal",
            "restartPolicy": {"backoffSeconds": 0.5, "maxRestarts": 3},
            "actor": {"gpu": "A100"},
            "rollout": {"gpu": "A10G"},
        },
    )


def test_a_modal_run_succeeds_through_the_controller(harness: Harness, fake: FakeModal) -> None:  # noqa: F811
    h = harness
    h.apply(modal_run("on-modal", max_steps=6))
    start(h, fake)
    final = h.wait_phase("on-modal", "Succeeded", timeout=40)
    assert final["step"] == 6 and final.get("restarts", 0) == 0
    assert sorted(gpu for _, gpu, _ in fake.spawned) == ["A100", "A10G"]
    rows = h.store.list_workers("on-modal")
    assert all(w.handle.startswith("modal:fc-") for w in rows) and len(rows) == 2
    wait_no_workers(h)
    [rollout] = [w for w in rows if w.role == "rollout"]
    box = fake.container(rollout.handle.removeprefix("modal:"))
    assert box.result.exists() and box.proc.returncode == 0, (
        "stopped by cancellation, not by ending its container"
    )
    ckpt = h.store.latest_checkpoint("on-modal")
    assert ckpt.step == 6 and Path(ckpt.path).is_relative_to(h.home / "runs" / "on-modal" / "checkpoints")
    # each worker reached the store with its own scoped token (mortal.state.auth), never the admin's
    assert all(
        launch["state_token"] and launch["state_token"] != os.environ["MORTAL_STATE_TOKEN"]
        for _, _, (launch,) in fake.spawned
    )
    calls = [json.loads(line) for line in (h.home / "access.log").read_text().splitlines()]
    by_workers = [c for c in calls if c["who"].startswith("worker:")]
    assert {c["who"] for c in by_workers} == {f"worker:on-modal/{w.role}-0#{w.incarnation}" for w in rows}
    assert {c["run"] for c in by_workers} == {"on-modal"}
    assert not [c for c in by_workers if c["status"] in (401, 403)], "a worker was refused a call it needs"


def test_logs_are_read_from_the_volume_and_a_purge_removes_the_runs_folder(
    harness: Harness,  # noqa: F811
    fake: FakeModal,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`mortalctl logs` and `delete --purge` of a Modal run reach the app's volume through the client
    library: the CLI here has another MORTAL_HOME, with no logs of its own."""
    h = harness
    h.apply(modal_run("seen", max_steps=4))
    start(h, fake)
    h.wait_phase("seen", "Succeeded", timeout=40)
    wait_no_workers(h)
    monkeypatch.setitem(sys.modules, "modal", fake)
    monkeypatch.setenv("MODAL_TOKEN_ID", "ak-test")
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-test")
    monkeypatch.setenv("MORTAL_HOME", str(tmp_path / "elsewhere"))
    out = CliRunner().invoke(app, ["--state-url", h.url, "logs", "seen", "--role", "actor", "--tail", "2"])
    assert out.exit_code == 0, out.output
    done, exited = out.stdout.splitlines()
    assert done.endswith("actor done at step 4 (weight version 4)") and exited.endswith("exiting with code 0")
    both = CliRunner().invoke(app, ["--state-url", h.url, "logs", "seen"]).stdout.splitlines()
    assert any(line.startswith("[actor-0] ") for line in both) and any(
        line.startswith("[rollout-0] ") for line in both
    )
    assert (h.home / "runs" / "seen" / "checkpoints").is_dir()
    delete_and_wait(h, "seen", purge=True)
    assert not (h.home / "runs" / "seen").exists(), "the run's folder is gone from the volume"


def test_a_killed_worker_is_detected_and_relaunched(harness: Harness, fake: FakeModal) -> None:  # noqa: F811
    h = harness
    h.apply(modal_run("kill", max_steps=24))
    start(h, fake)
    wait_for(lambda: (h.status("kill").get("step") or 0) >= 3, 30, "a few steps")
    [actor] = worker_processes(h.home, role="actor")
    os.kill(actor.pid, signal.SIGKILL)  # the worker process inside the call's container; the call returns -9
    final = h.wait_phase("kill", "Succeeded", timeout=45)
    actors = [w for w in h.store.list_workers("kill") if w.role == "actor"]
    assert [(w.state, w.exit_code) for w in actors] == [("Lost", -9), ("Succeeded", 0)]
    assert final["restarts"] == 1 and len(fake.spawned) == 3
    wait_no_workers(h)


def test_a_worker_stuck_in_a_task_writes_its_stacks_to_its_log_and_is_relaunched(
    harness: Harness,  # noqa: F811
    fake: FakeModal,
) -> None:
    """No one can signal a process in a Modal container: the controller asks for the stalled worker's stacks
    through the store, and the worker's heartbeat thread writes them to its log (on the volume) before it is
    relaunched."""
    h = harness
    run = modal_run("stuck", max_steps=4)
    run = simulated_run(
        "stuck",
        max_steps=4,
        rollout_replicas=1,
        step_seconds=0.1,
        annotations={"mortal.dev/stall": "task", "mortal.dev/stall-step": "2"},
        spec={**run.spec_dict(), "deadlines": {"taskSeconds": 2}},
    )
    h.apply(run)
    start(h, fake)
    final = h.wait_phase("stuck", "Succeeded", timeout=90)
    assert final["restarts"] == 1
    stalled = [w for w in h.store.list_workers("stuck") if w.role == "rollout"][0]
    assert stalled.state == "Failed" and stalled.message.startswith("TaskDeadlineExceeded: task 2.")
    assert stalled.stacks_written_at is not None, "the worker answered the request"
    [warned] = [
        e
        for e in h.store.list_events("stuck", limit=200)
        if e.reason == "TaskDeadlineExceeded" and e.message.startswith("rollout-0")
    ]
    assert "; its stacks are in its log; relaunching it" in warned.message
    log = paths.worker_log("stuck", "rollout", 0, stalled.incarnation)  # the volume is this home
    wait_for(lambda: "in stall_here" in log.read_text(), 15, "the stuck frame in the log on the volume")
    assert "--- stacks of every thread: the controller asked for them (this worker was doing task 2." in (
        log.read_text()
    )
    wait_no_workers(h)


def test_a_restarted_controller_readopts_the_calls(harness: Harness, fake: FakeModal) -> None:  # noqa: F811
    h = harness
    h.apply(modal_run("readopt", max_steps=24))
    first = start(h, fake)
    wait_for(lambda: (h.status("readopt").get("step") or 0) >= 3, 30, "a few steps")
    first.stop()  # workers keep running; nothing in memory survives, the Dict does
    start(h, fake)
    final = h.wait_phase("readopt", "Succeeded", timeout=45)
    assert len(fake.spawned) == 2, "no twin was launched"
    assert [w.state for w in h.store.list_workers("readopt") if w.role == "actor"] == ["Succeeded"]
    assert final.get("restarts", 0) == 0
    wait_no_workers(h)


def test_calls_that_end_with_an_error_or_vanish_are_relaunched(harness: Harness, fake: FakeModal) -> None:  # noqa: F811
    """A container that dies (the call raises RemoteError) and a call Modal no longer knows (NotFoundError):
    both read as a worker that exited without a report, i.e. lost, relaunched from the checkpoint."""
    h = harness
    h.apply(modal_run("errors", max_steps=24))
    start(h, fake)
    wait_for(lambda: (h.status("errors").get("step") or 0) >= 3, 30, "a few steps")
    fake.kill_container(call_of(h, "errors", "actor"))  # the container is gone: no exit code, no report
    wait_for(lambda: relaunched(h, "errors", "actor"), 20, "the actor relaunched")
    fake.vanish(call_of(h, "errors", "rollout"))  # FunctionCall.from_id(id).get(): NotFoundError
    wait_for(lambda: relaunched(h, "errors", "rollout"), 20, "the rollout relaunched")
    final = h.wait_phase("errors", "Succeeded", timeout=60)
    rows = h.store.list_workers("errors")
    actors = [w for w in rows if w.role == "actor"]
    assert [(w.state, w.exit_code) for w in actors] == [("Lost", None), ("Succeeded", 0)]
    assert [w.state for w in rows if w.role == "rollout"][0] == "Lost"
    assert final["restarts"] == 2 and final["step"] == 24
    assert h.resumed_from("errors", actors[1].incarnation), (
        "the new actor resumed (its log, on the volume, says so)"
    )
    wait_no_workers(h)


def test_a_preempted_call_that_restarts_within_the_lease_resumes_as_the_same_worker(
    harness: Harness,  # noqa: F811
    fake: FakeModal,
) -> None:
    """Modal interrupts a preempted container and starts the same input again: the same incarnation comes
    back, resumes from its checkpoint, and nothing is relaunched (the call never ended)."""
    h = harness
    h.apply(modal_run("preempted", max_steps=16))
    start(h, fake, dataclasses.replace(FAST, worker_lease_seconds=20.0))
    wait_for(lambda: (h.status("preempted").get("step") or 0) >= 3, 30, "a few steps")
    call = call_of(h, "preempted", "actor")
    [call_incarnation] = [w.incarnation for w in h.live_rows("preempted", "actor")]
    fake.preempt(call)
    final = h.wait_phase("preempted", "Succeeded", timeout=60)
    assert fake.calls[call].attempts == 2 and len(fake.spawned) == 2, "the same call, nothing relaunched"
    assert final.get("restarts", 0) == 0 and final["step"] == 16
    assert [w.state for w in h.store.list_workers("preempted") if w.role == "actor"] == ["Succeeded"]
    assert h.resumed_from("preempted", call_incarnation), "the restarted input resumed from the checkpoint"
    wait_no_workers(h)


def test_a_preempted_call_silent_past_the_lease_is_relaunched_and_its_input_dropped(
    harness: Harness,  # noqa: F811
    fake: FakeModal,
) -> None:
    """A restart slower than the worker lease (a GPU container can take that long): the heartbeat decides,
    as for a hung process. The slot gets a new incarnation; the old input is cancelled before it runs
    again."""
    h = harness
    h.apply(modal_run("slow-restart", max_steps=16))
    start(h, fake)
    wait_for(lambda: (h.status("slow-restart").get("step") or 0) >= 3, 30, "a few steps")
    call = call_of(h, "slow-restart", "actor")
    preempted = time.monotonic()
    fake.preempt(call, restart_after=FAST.worker_lease_seconds + 3)
    # live or not: the relaunched actor can finish the short run before the old input's restart is due
    assert relaunched(h, "slow-restart", "actor", live_only=False), (
        "relaunched while the old input waited for a container"
    )
    final = h.wait_phase("slow-restart", "Succeeded", timeout=60)
    assert fake.calls[call].attempts == 1, "the cancelled input never started again"
    actors = [w for w in h.store.list_workers("slow-restart") if w.role == "actor"]
    assert [w.state for w in actors] == ["Lost", "Succeeded"] and "last heartbeat" in actors[0].message
    assert final["restarts"] == 1 and time.monotonic() - preempted < 60
    wait_no_workers(h)


def test_a_standby_controller_takes_over_from_one_that_died_holding_the_lease(
    harness: Harness,  # noqa: F811
    fake: FakeModal,
) -> None:
    """The hosted controller's overlap: the next scheduled call stands by; when the leader dies without
    giving the lease up, the standby leads once it expires and notices a failure that came meanwhile."""
    h = harness
    h.apply(modal_run("handover", max_steps=16))
    leader = start(h, fake)
    wait_for(lambda: (h.status("handover").get("step") or 0) >= 3, 30, "a few steps")
    standby = start(h, fake)
    assert leader.leader.is_leader and not standby.leader.is_leader
    leader.leader.release = lambda: None  # dies: the lease is left to expire
    leader.stop()
    died = time.monotonic()
    fake.kill_container(call_of(h, "handover", "actor"))
    wait_for(lambda: relaunched(h, "handover", "actor"), 20, "the standby to relaunch the actor")
    noticed = time.monotonic() - died
    bound = FAST.leader_lease_seconds + FAST.leader_renew_seconds + FAST.plan.active_resync_seconds + 2
    assert standby.leader.is_leader and noticed < bound, f"noticed after {noticed:.1f}s (bound {bound}s)"
    final = h.wait_phase("handover", "Succeeded", timeout=60)
    assert final["restarts"] == 1 and len(fake.spawned) == 3, "one relaunch, no twin of the rollout"
    wait_no_workers(h)


def test_a_sharded_actor_trains_in_one_container_that_starts_its_own_ranks(
    harness: Harness,  # noqa: F811
    fake: FakeModal,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """actor {count: 2} on Modal: one call, one container with a GPU a rank (`gpu="H200:2"`, tests/controller/
    backends/test_modal.py; here CPU ranks over gloo, the fake's container a real process), whose rank 0
    starts rank 1 itself. A real tiny model trains to the end with a rollout in another call, each checkpoint
    holding both ranks' shards on the volume, and the weights reaching the rollout through it."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "workers"))  # the real-model helpers
    from actor_helpers import actor_spec
    from rollout_helpers import assets_available, make_tiny_model, task_results

    from mortal.specs import TrainingRun
    from mortal.workers.actor.checkpoint import read_marker

    if not assets_available():
        pytest.skip("SmolLM2 assets missing")
    h = harness
    spec = actor_spec(
        str(make_tiny_model(tmp_path / "model")),
        backend="modal",
        actor={"count": 2},
        algorithm={"maxSteps": 2, "batchSize": 8},
        checkpoint={"every": 1, "keep": 2},
        restartPolicy={"backoffSeconds": 0.5, "maxRestarts": 1},
        rewards=[{"function": "mortal.workers.rewards.builtin:correct_answer"}],
    )
    h.apply(TrainingRun.model_validate({"metadata": {"name": "fsdp"}, "spec": spec}))
    start(h, fake)
    final = h.wait_phase("fsdp", "Succeeded", timeout=240)
    assert final["step"] == 2 and final.get("restarts", 0) == 0
    assert sorted(function for function, _, _ in fake.spawned) == ["worker", "worker"]  # one call a role
    for step in (1, 2):
        [row] = [c for c in h.store.list_checkpoints("fsdp") if c.step == step]
        assert read_marker(row.path)["ranks"] == 2 and (Path(row.path) / "dcp" / ".metadata").is_file()
        assert Path(row.path).is_relative_to(h.home / "runs" / "fsdp" / "checkpoints")
    # step 1's tasks were answered with version 1, the shards' first update, read from the volume
    assert {res.weight_version for r in h.store.step_results("fsdp", 1) for res in task_results(r)} == {1}
    assert {row.method for row in h.store.list_weights("fsdp")} == {"volume"}
    wait_no_workers(h)
