"""kill -9 of a rollout worker: it is replaced, training continues, and nothing it had claimed is lost;
the only rollout killed while it holds a task: training goes on well within the task lease (the
controller releases the dead worker's task when it marks it Lost); a frozen one is lost after its
lease, killed and replaced; what a killed rollout's reward had started outside its process group is
killed with it and not taken for the worker."""

from __future__ import annotations

import os
import signal
import time
from datetime import UTC, datetime
from pathlib import Path

import psutil
from realproc import harness, wait_for, worker_processes  # noqa: F401 - harness is a fixture
from store_kinds import sql_stores, sqlite_only

from mortal.workers.runtime import worker_ref_from_env
from mortal.workers.simulated import simulated_run

NAME = "kill-rollout"
STEPS = 24

# The user's reward: once per worker process it starts a "sandbox" in a session of its own (out of the
# worker's process group) that ignores SIGTERM, and writes its pid where the test finds it.
SANDBOXING_REWARD = """
import os, pathlib, subprocess, sys

def sandboxed(completions, **kwargs):
    marker = pathlib.Path(os.environ["MORTAL_HOME"], "sandbox-" + os.environ["MORTAL_INCARNATION"])
    if not marker.exists():
        code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
        child = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
        marker.write_text(str(child.pid))
    return [1.0 for _ in completions]
"""


def gone(pid: int) -> bool:
    """Not running: no such process, or a zombie that its new parent has yet to reap."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@sqlite_only  # replacing the worker is the controller's; re-leasing its tasks is in the store contract
def test_rollout_kill_is_replaced_and_its_tasks_are_done_by_others(harness):  # noqa: F811
    h = harness
    notes = {"mortal.dev/generate-seconds": "0.1", "mortal.dev/task-lease-seconds": "2"}
    h.apply(
        simulated_run(
            NAME,
            max_steps=STEPS,
            rollout_replicas=2,
            step_seconds=0.1,
            annotations=notes,
            spec={"restartPolicy": {"backoffSeconds": 0.5}},
        )
    )
    h.start()
    wait_for(lambda: (h.status(NAME).get("step") or 0) >= 4, 30, "a few steps")
    victim = next(p for p in worker_processes(h.home, role="rollout") if p.environ()["MORTAL_REPLICA"] == "0")
    victim_id = worker_ref_from_env(victim.environ()).id  # the holder its leases name
    os.killpg(victim.pid, signal.SIGKILL)
    step_at_kill = h.status(NAME).get("step") or 0
    claimed = [
        t
        for s in range(step_at_kill, step_at_kill + 3)
        for t in h.store.step_results(NAME, s)
        if t.state == "leased" and t.lease_holder == victim_id
    ]

    def replaced():
        rows = [w for w in h.live_rows(NAME, "rollout") if w.replica == 0]
        return rows and rows[0].state == "Running" and len(worker_processes(h.home, role="rollout")) == 2

    wait_for(replaced, 20, "rollout-0 to be replaced")
    final = h.wait_phase(NAME, "Succeeded", timeout=60)
    assert final["step"] == STEPS
    assert final["restarts"] == 1
    for step in range(1, STEPS + 1):
        tasks = h.store.step_results(NAME, step)
        assert tasks and all(t.state == "done" for t in tasks), f"step {step} lost a task"
    for task in claimed:
        done = next(t for t in h.store.step_results(NAME, task.step) if t.slot == task.slot)
        assert done.state == "done" and done.lease_holder != victim_id
    rollout0 = [w for w in h.store.list_workers(NAME) if w.role == "rollout" and w.replica == 0]
    assert rollout0[0].state == "Lost" and len(rollout0) == 2
    wait_for(lambda: not worker_processes(h.home), 20, "every worker to exit")


@sqlite_only  # the release itself is in the store contract (every store); here: the time it saves
def test_the_only_rollout_killed_holding_a_task_trains_again_well_within_its_lease(harness):  # noqa: F811
    """With the real rollout's default 60 s task lease, the next step ends in seconds, not after 60 s."""
    h = harness
    lease = 60.0  # mortal.workers.rollout.DEFAULT_LEASE_SECONDS
    notes = {"mortal.dev/generate-seconds": "1.0", "mortal.dev/task-lease-seconds": f"{lease:g}"}
    h.apply(
        simulated_run(
            "sole",
            max_steps=100_000,
            rollout_replicas=1,
            step_seconds=0.1,
            annotations=notes,
            spec={"restartPolicy": {"backoffSeconds": 0.5}},
        )
    )
    h.start()
    wait_for(lambda: (h.status("sole").get("step") or 0) >= 2, 30, "a few steps")
    [victim] = worker_processes(h.home, role="rollout")
    victim_id = worker_ref_from_env(victim.environ()).id  # the holder its leases name

    def just_leased():  # a task the victim leased less than 0.3 s ago: about 0.7 s of its 1 s generation left
        now = datetime.now(UTC).timestamp()
        step = h.status("sole").get("step") or 0
        return [
            t
            for s in (step, step + 1)
            for t in h.store.step_results("sole", s)
            if t.state == "leased"
            and t.lease_holder == victim_id
            and now - (t.lease_expires_at.timestamp() - lease) < 0.3
        ]

    [held] = wait_for(just_leased, 20, "the rollout to lease a task", interval=0.02)
    os.killpg(victim.pid, signal.SIGKILL)
    killed = time.time()

    def next_step_end():
        return [
            m.time.timestamp()
            for m in h.store.list_metrics("sole", name="step_seconds", since_step=held.step)
            if m.time.timestamp() > killed
        ]

    ended = min(wait_for(next_step_end, lease / 2, "a step to end after the kill"))
    assert ended - killed < lease / 2, f"the next step ended {ended - killed:.1f}s after the kill"
    redone = next(t for t in h.store.step_results("sole", held.step) if t.slot == held.slot)
    assert redone.state == "done" and redone.lease_holder not in (None, victim_id)
    assert redone.done_at.timestamp() - killed < lease / 2
    h.store.mark_deleted("sole")
    wait_for(lambda: not h.store.list_runs(), 30, "the run to be purged")


@sql_stores  # frozen inside a transaction, it holds SQLite's write lock or a PostgreSQL session
def test_a_frozen_rollout_is_lost_after_its_lease_killed_and_replaced(harness):  # noqa: F811
    """SIGSTOP: the process is alive but its heartbeat goes stale; past the lease it is lost and killed."""
    h = harness
    h.apply(
        simulated_run(
            "frozen",
            max_steps=100_000,
            rollout_replicas=1,
            step_seconds=0.1,
            annotations={"mortal.dev/task-lease-seconds": "2"},
            spec={"restartPolicy": {"backoffSeconds": 0.5}},
        )
    )
    h.start()
    wait_for(lambda: (h.status("frozen").get("step") or 0) >= 3, 30, "a few steps")
    [victim] = worker_processes(h.home, role="rollout")
    os.kill(victim.pid, signal.SIGSTOP)
    lost = wait_for(
        lambda: [w for w in h.store.list_workers("frozen") if w.state == "Lost"], 20, "the lease to run out"
    )
    # Stopped between two transactions, its heartbeat goes stale; stopped inside a SQLite write
    # transaction, it blocks every writer until the controller's lock watch kills it (lockwatch.py),
    # and the row ends by that SIGKILL's exit code, or as gone when the process was reaped first.
    judged_by = ("last heartbeat", "process is gone", "process exited with code -9")
    assert any(reason in lost[0].message for reason in judged_by), lost[0].message
    wait_for(
        lambda: not victim.is_running() or victim.status() == "zombie", 10, "the frozen process to be killed"
    )
    step = h.status("frozen")["step"]
    wait_for(
        lambda: h.status("frozen")["step"] > step + 3 and h.status("frozen")["phase"] == "Running",
        30,
        "training with the replacement",
    )
    assert len(worker_processes(h.home, role="rollout")) == 1
    h.store.mark_deleted("frozen")
    wait_for(lambda: not h.store.list_runs(), 30, "the run to be purged")


@sqlite_only  # stopping what a worker left is the controller's and its backend's
def test_a_killed_rollouts_escaped_sandbox_is_killed_and_not_taken_for_the_worker(
    harness,  # noqa: F811
    tmp_path: Path,
    monkeypatch,
):
    """kill -9 of the worker alone (as the OOM killer does): its reward's sandbox, in a session of its own and
    deaf to SIGTERM, outlives it still carrying the worker's identity. The controller kills it, launches a
    replacement (the sandbox is not mistaken for a live worker), and the run's deletion kills the
    replacement's sandbox too."""
    h = harness
    (tmp_path / "sandboxing.py").write_text(SANDBOXING_REWARD)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    )
    h.apply(
        simulated_run(
            "leftover",
            max_steps=100_000,
            rollout_replicas=1,
            step_seconds=0.1,
            annotations={"mortal.dev/rewards": "call", "mortal.dev/task-lease-seconds": "2"},
            spec={
                "rewards": [{"function": "sandboxing:sandboxed"}],
                "restartPolicy": {"backoffSeconds": 0.5},
            },
        )
    )
    h.start()
    wait_for(lambda: (h.status("leftover").get("step") or 0) >= 2, 60, "a few steps")
    [first] = h.live_rows("leftover", "rollout")
    sandbox = int(wait_for(lambda: _marker(h.home, first.incarnation), 20, "the first sandbox"))
    [victim] = [
        p for p in worker_processes(h.home, role="rollout") if p.environ().get("MORTAL_WORKER_LEADER") == "1"
    ]
    assert victim.pid != sandbox
    os.kill(victim.pid, signal.SIGKILL)
    wait_for(lambda: gone(sandbox), 30, "the killed rollout's sandbox to be killed")

    def replaced():
        rows = h.live_rows("leftover", "rollout")
        ready = rows and rows[0].incarnation > first.incarnation and rows[0].state == "Running"
        return rows[0] if ready else None

    second = wait_for(replaced, 30, "a replacement rollout")
    step = h.status("leftover")["step"]
    wait_for(lambda: h.status("leftover")["step"] > step + 2, 30, "training with the replacement")
    rollouts = {w.incarnation: w.state for w in h.store.list_workers("leftover") if w.role == "rollout"}
    assert rollouts[first.incarnation] == "Lost", rollouts
    replacement_sandbox = int(wait_for(lambda: _marker(h.home, second.incarnation), 20, "the second sandbox"))
    h.store.mark_deleted("leftover")
    wait_for(lambda: not h.store.list_runs(), 30, "the run to be purged")
    wait_for(lambda: gone(replacement_sandbox), 20, "the replacement's sandbox to be killed with its run")


def _marker(home: Path, incarnation: int) -> str | None:
    path = home / f"sandbox-{incarnation}"
    return path.read_text() or None if path.exists() else None
