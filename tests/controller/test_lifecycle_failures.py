"""A worker that always fails ends the run Failed after maxRestarts, or sooner when it fails the same way
every time (CrashLoop), with the reason in describe; a fatal exit fails the run at once. On SQLite only: the
restart policy is the controller's (tests/store_kinds.py)."""

from __future__ import annotations

from realproc import harness, wait_for, worker_processes  # noqa: F401 - harness is a fixture
from store_kinds import sqlite_only

from mortal.workers.simulated import simulated_run

pytestmark = sqlite_only


def condition(status, type_):
    return next(c for c in status["conditions"] if c["type"] == type_)


def _actor_exiting_75_on_every_launch(h, name: str, max_restarts: int) -> dict:
    """Run `name` with an actor that exits 75 at once on every launch; its Failed condition, once the run has
    failed after two restarts and its rollout was stopped (describe shows the condition's reason)."""
    h.apply(
        simulated_run(
            name,
            max_steps=10,
            rollout_replicas=1,
            annotations={"mortal.dev/fail": "always"},
            spec={"restartPolicy": {"maxRestarts": max_restarts, "backoffSeconds": 0.2}},
        )
    )
    h.start()
    final = h.wait_phase(name, "Failed", timeout=60)
    assert final["restarts"] == 2
    failed = condition(final, "Failed")
    wait_for(lambda: not worker_processes(h.home), 20, "the rollout to be stopped")
    describe_shows(h, name, failed["reason"])
    return failed


def test_always_failing_actor_fails_after_max_restarts(harness):  # noqa: F811
    failed = _actor_exiting_75_on_every_launch(harness, "crashy", max_restarts=2)
    assert failed["reason"] == "RestartLimitReached"
    assert failed["message"].startswith("restart limit reached: actor-0:")
    actors = [w for w in harness.store.list_workers("crashy") if w.role == "actor"]
    assert [(w.state, w.exit_code) for w in actors] == [("Failed", 75)] * 3


def test_an_actor_failing_the_same_way_on_every_launch_fails_the_run_as_a_crash_loop(harness):  # noqa: F811
    """With restarts to spare (maxRestarts 10), the third failure in a row with the same reported error ends
    the run: CrashLoop, naming the worker and the error, not a relaunch loop over about 25 minutes of
    backoff."""
    failed = _actor_exiting_75_on_every_launch(harness, "looping", max_restarts=10)
    assert failed["reason"] == "CrashLoop"
    assert failed["message"].startswith("actor-0 failed 3 times in a row with the same error, each within ")
    assert failed["message"].endswith(
        "of its launch: exited with code 75 (relaunching does not fix it; restartPolicy.sameFailureLimit)"
    )


def test_fatal_exit_fails_at_once_without_restarts(harness):  # noqa: F811
    h = harness
    h.apply(
        simulated_run(
            "fatal", max_steps=10, rollout_replicas=1, annotations={"mortal.dev/workload": "no-such-workload"}
        )
    )
    h.start()
    final = h.wait_phase("fatal", "Failed", timeout=60)
    assert final["restarts"] == 0
    assert condition(final, "Failed")["reason"] == "WorkerFailed"
    assert "UnknownWorkload" in final["message"]
    wait_for(lambda: not worker_processes(h.home), 20, "every worker to exit")


def test_rollout_out_of_gpu_memory_is_diagnosed_relaunched_once_then_fails_the_run(harness):  # noqa: F811
    """A real rollout process raises torch.cuda.OutOfMemoryError (torch's own H100 message) on every launch:
    it reports exit 4 with the figures, MemoryFits turns False with one Warning event, the slot is
    relaunched once, and its second out-of-memory ends the run Failed (OutOfMemory) instead of a loop."""
    h = harness
    h.apply(
        simulated_run(
            "oom",
            max_steps=10,
            rollout_replicas=1,
            annotations={"mortal.dev/fail": "oom-rollout"},
            spec={"restartPolicy": {"maxRestarts": 10, "backoffSeconds": 0.2}},
        )
    )
    h.start()
    final = h.wait_phase("oom", "Failed", timeout=90)
    assert final["restarts"] == 1
    failed = condition(final, "Failed")
    assert failed["reason"] == "OutOfMemory"
    assert failed["message"].startswith(
        "rollout-0 #3 ran out of GPU memory: tried to allocate 2.00 GiB on GPU 0 "
        "(total 79.19 GiB, 77.96 GiB in use, 1.23 GiB free, 70.10 GiB allocated "
        "by PyTorch, 6.50 GiB reserved by PyTorch but unallocated)"
    )
    assert "generation.maxNumSeqs" in failed["message"] and "rollout.gpu" in failed["message"]
    memory = condition(final, "MemoryFits")
    assert (memory["status"], memory["reason"], memory["message"]) == (
        "False",
        "OutOfMemory",
        failed["message"],
    )
    rollouts = [w for w in h.store.list_workers("oom") if w.role == "rollout"]
    assert [(w.state, w.exit_code) for w in rollouts] == [("Failed", 4), ("Failed", 4)]
    assert rollouts[0].message.startswith("OutOfMemory: tried to allocate 2.00 GiB on GPU 0")
    events = h.store.list_events("oom", limit=200)
    assert [e.type for e in events if e.reason == "OutOfMemory"] == ["Warning"]
    assert sum(1 for e in events if e.reason == "Restarted") == 1
    wait_for(lambda: not worker_processes(h.home), 20, "the actor to be stopped")
    describe_shows(h, "oom", "MemoryFits")


def test_an_actor_out_of_gpu_memory_above_a_micro_batch_heals_and_completes(harness):  # noqa: F811
    """A real actor process raises torch.cuda.OutOfMemoryError while its micro batch is above 4 (batchSize 16,
    no microBatchSize: one pass of 16): the controller relaunches it with 8, then 4, which fits; the run
    Succeeds with the spec untouched, status.effective saying 4, two MicroBatchReduced events, describe
    showing the micro batch it runs."""
    h = harness
    h.apply(
        simulated_run(
            "healed",
            max_steps=4,
            rollout_replicas=1,
            annotations={"mortal.dev/fail": "oom-actor-above:4"},
            spec={
                "algorithm": {"numGenerations": 2, "batchSize": 16, "maxSteps": 4},
                "restartPolicy": {"maxRestarts": 10, "backoffSeconds": 0.2},
            },
        )
    )
    h.start()
    final = h.wait_phase("healed", "Succeeded", timeout=120)
    assert final["restarts"] == 2 and final["step"] == 4
    assert (final["effective"]["microBatchSize"], final["effective"]["specMicroBatchSize"]) == (4, 16)
    assert (
        h.store.get_run("healed").spec["algorithm"]["microBatchSize"] is None
    )  # the spec as the user applied it
    actors = [w for w in h.store.list_workers("healed") if w.role == "actor"]
    assert [(w.state, w.exit_code) for w in actors] == [("Failed", 4), ("Failed", 4), ("Succeeded", 0)]
    events = h.store.list_events("healed", limit=200)
    assert [e.message.split(" after ")[0] for e in events if e.reason == "MicroBatchReduced"] == [
        "actor micro batch 16 -> 8",
        "actor micro batch 8 -> 4",
    ]
    describe_shows(h, "healed", "4 (spec: 16; 4 passes a step, chosen by the controller)")


def test_a_micro_batch_fitted_at_apply_is_the_first_launchs_and_an_oom_still_heals_it(harness):  # noqa: F811
    """The run carries mortalctl apply's estimate (heal.FITTED_ANNOTATION: 8 of 16): the actor starts with 8,
    runs out of memory above 4 all the same (the estimate was low), and is relaunched with 4."""
    from mortal.controller.heal import FITTED_ANNOTATION

    h = harness
    h.apply(
        simulated_run(
            "fitted",
            max_steps=2,
            rollout_replicas=1,
            annotations={"mortal.dev/fail": "oom-actor-above:4", FITTED_ANNOTATION: "8"},
            spec={
                "algorithm": {"numGenerations": 2, "batchSize": 16, "maxSteps": 2},
                "restartPolicy": {"maxRestarts": 10, "backoffSeconds": 0.2},
            },
        )
    )
    h.start()
    final = h.wait_phase("fitted", "Succeeded", timeout=120)
    assert final["restarts"] == 1 and final["effective"]["microBatchSize"] == 4
    events = [
        (e.type, e.message.split(":")[0])
        for e in h.store.list_events("fitted", limit=200)
        if e.reason == "MicroBatchReduced"
    ]
    assert events == [
        ("Normal", "actor micro batch 16 -> 8 before launch"),
        (
            "Warning",
            "actor micro batch 8 -> 4 after CUDA out of memory (algorithm.microBatchSize; 4 "
            "passes a step, gradients accumulated",
        ),
    ]


def describe_shows(h, name: str, text: str) -> None:
    """`mortalctl describe run NAME` prints the failure reason (through the CLI, as a user sees it)."""
    from typer.testing import CliRunner

    from mortal.client.cli.main import app

    result = CliRunner().invoke(
        app, ["describe", "run", name], env={"MORTAL_STATE_URL": h.url, "MORTAL_HOME": str(h.home)}
    )
    assert result.exit_code == 0, result.output
    assert text in result.output
