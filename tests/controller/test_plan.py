"""Table tests of the pure planner: one world in, the actions, phase and outcome out."""

from __future__ import annotations

import pytest
from planhelpers import CFG, NOW, ago, kinds, proc, row, run_plan, running, status

from mortal.controller.actions import Adopt, EndWorker, Launch, Purge, Stop
from mortal.controller.observed import Desired, Observed, PlanConfig
from mortal.controller.outcome import Done, RequeueAfter
from mortal.controller.plan import plan
from mortal.specs import RunStatus
from mortal.state.tables import CheckpointRow


def launches(p):
    return [(a.role, a.replica, a.restart) for a in p.actions if isinstance(a, Launch)]


def ends(p):
    return [(a.worker_id, a.state) for a in p.actions if isinstance(a, EndWorker)]


def stops(p):
    return [(a.handle, a.grace_seconds) for a in p.actions if isinstance(a, Stop)]


def cond(p, type_):
    return next(c for c in p.status["conditions"] if c["type"] == type_)


# -- start -----------------------------------------------------------------------------------------
def test_new_run_launches_actor_and_every_rollout_and_is_starting():
    p = run_plan([], rollout_replicas=2)
    assert launches(p) == [("actor", 0, False), ("rollout", 0, False), ("rollout", 1, False)]
    assert p.status["phase"] == "Starting"
    assert p.status["replicas"] == {
        "actor": {"ready": 0, "desired": 1},
        "rollout": {"ready": 0, "desired": 2},
    }
    assert p.outcome == RequeueAfter(CFG.active_resync_seconds)
    assert [e.reason for e in p.events] == ["Starting"]
    assert [a.event.reason for a in p.actions] == ["Launched"] * 3


def test_launched_workers_without_heartbeat_stay_starting_without_relaunch():
    rows = [
        row("actor", 0, 1, "Pending", beat=None, started=2),
        row("rollout", 0, 2, "Pending", beat=None, started=2),
    ]
    p = run_plan(rows, [proc(w) for w in rows], prev=status("Starting"))
    assert p.actions == ()
    assert p.status["phase"] == "Starting"


def test_healthy_run_is_running_with_progress_from_the_world():
    rows, procs = running(rollouts=2, step=7)
    ckpt = CheckpointRow(
        run="r", step=5, path="/c/step-5", weight_version=5, complete=True, created_at=ago(3)
    )
    p = run_plan(rows, procs, prev=status("Starting"), ckpt=ckpt, weights=7, reward=0.25, rollout_replicas=2)
    assert p.actions == ()
    s = p.status
    assert (s["phase"], s["step"], s["weightVersion"], s["reward"], s["restarts"]) == (
        "Running",
        7,
        7,
        0.25,
        0,
    )
    assert s["lastCheckpoint"]["step"] == 5
    assert s["replicas"]["rollout"] == {"ready": 2, "desired": 2}
    assert cond(p, "Ready")["status"] == "True"
    assert {e.reason for e in p.events} == {"Running", "CheckpointSaved"}
    RunStatus.model_validate(s)  # the shape mortal.specs reads back


def test_unchanged_world_gives_identical_status_and_no_events():
    rows, procs = running()
    first = run_plan(rows, procs, prev=status("Starting"))
    again = run_plan(rows, procs, prev=first.status)
    assert again.status == first.status
    assert again.events == ()


def test_condition_transition_time_moves_only_on_flip():
    rows, procs = running()
    prev = run_plan(rows, procs, prev=status("Starting")).status
    prev["conditions"][0]["lastTransitionTime"] = "2020-01-01T00:00:00+00:00"
    p = run_plan(rows, procs, prev=prev)
    assert cond(p, "Ready")["lastTransitionTime"] == "2020-01-01T00:00:00+00:00"


# -- loss and restart --------------------------------------------------------------------------------
def test_actor_killed_is_lost_and_relaunch_waits_for_backoff():
    rows, procs = running()
    procs[0] = proc(rows[0], alive=False, code=-9)
    p = run_plan(rows, procs, prev=status("Running"), backoff_seconds=5)
    assert ends(p) == [(rows[0].id, "Lost")]
    assert launches(p) == []
    assert p.status["phase"] == "Recovering"
    assert "restarting actor-0 in 5s" in p.status["message"]
    assert p.outcome == RequeueAfter(CFG.active_resync_seconds)  # the rollout still lives: keep watching
    assert p.actions[0].event.reason == "WorkerLost"


@pytest.mark.parametrize(
    ("code", "activity", "said"),
    [
        (
            -9,
            "task 3.1",
            "process exited with code -9 (killed by SIGKILL: the kernel's out-of-memory killer is a common "
            "cause); last activity: task 3.1",
        ),
        (-11, None, "process exited with code -11 (killed by SIGSEGV)"),
        (1, "step 7", "process exited with code 1; last activity: step 7"),
        (None, None, "process exited with an unknown code"),
    ],
)
def test_a_lost_workers_reason_names_the_signal_that_killed_it_and_its_last_activity(code, activity, said):
    rows, procs = running()
    rows[1].activity = activity
    procs[1] = proc(rows[1], alive=False, code=code)
    p = run_plan(rows, procs, prev=status("Running"), backoff_seconds=5)
    end = next(a for a in p.actions if isinstance(a, EndWorker))
    assert (end.state, end.message) == ("Lost", said)
    assert end.event.message == f"rollout-0 #2: {said}"


def test_the_restart_limit_reason_of_a_worker_killed_by_sigkill_says_so():
    rows, procs = running()
    rows[1].activity = "task 3.1"
    procs[1] = proc(rows[1], alive=False, code=-9)
    p = run_plan(rows, procs, prev=status("Running"), max_restarts=0)
    assert p.status["phase"] == "Failed"
    assert (
        "restart limit reached: rollout-0: process exited with code -9 (killed by SIGKILL: the kernel's "
        "out-of-memory killer is a common cause); last activity: task 3.1"
    ) in p.status["message"]


@pytest.mark.parametrize("code", [-9, 0, 1])
def test_a_worker_whose_process_exited_is_stopped_too_so_what_it_left_running_is_killed(code):
    """A process killed with SIGKILL leaves its children (an environment's, a tool's programs) running: the
    backend's stop of its handle kills its process group and what carries its worker id."""
    rows, procs = running()
    procs[0] = proc(rows[0], alive=False, code=code)
    p = run_plan(rows, procs, prev=status("Running"), backoff_seconds=5)
    assert stops(p) == [(procs[0].handle, 0.0)]


def test_lost_actor_is_relaunched_after_backoff_and_counted():
    rows, procs = running()
    rows[0] = row("actor", 0, 1, "Lost", ended=6, message="process exited with code -9")
    p = run_plan(rows, procs[1:], prev=status("Recovering"), backoff_seconds=5)
    assert launches(p) == [("actor", 0, True)]
    assert p.status["restarts"] == 1
    assert p.status["phase"] == "Recovering"
    assert p.actions[0].event.reason == "Restarted"


def test_relaunched_actor_is_recovering_until_its_heartbeat_then_running():
    old = row("actor", 0, 1, "Lost", ended=10)
    roll = row("rollout", 0, 2)
    new = row("actor", 0, 3, "Pending", beat=None, started=2)
    p = run_plan([old, roll, new], [proc(roll), proc(new)], prev=status("Recovering"))
    assert (p.status["phase"], p.status["restarts"], p.actions) == ("Recovering", 1, ())
    new = row("actor", 0, 3, "Running", started=2)
    p = run_plan([old, roll, new], [proc(roll), proc(new)], prev=status("Recovering"))
    assert (p.status["phase"], p.status["restarts"]) == ("Running", 1)


@pytest.mark.parametrize(
    ("lives", "expected"),
    [
        ([1], 2.0),  # first failure: base
        ([1, 1], 4.0),  # second in a row: doubled
        ([1, 1, 1], 8.0),
        ([1, 1, 500], 2.0),  # the newest lived long: reset
        ([1, 1, 1, 1, 1, 1, 1, 1, 1], 300.0),  # capped
    ],
)
def test_backoff_doubles_per_consecutive_failure_and_resets(lives, expected):
    rows = [row("actor", 0, i + 1, "Lost", started=life + 0.5, ended=0.5) for i, life in enumerate(lives)]
    p = run_plan(rows, [], prev=status("Recovering"), backoff_seconds=2, rollout_replicas=0, max_restarts=100)
    assert p.outcome == RequeueAfter(pytest.approx(expected - 0.5))


def test_self_reported_retryable_failure_relaunches():
    rows = [row("actor", 0, 1, "Failed", code=75, message="boom", ended=30)]
    p = run_plan(rows, [], prev=status("Running"), rollout_replicas=0)
    assert launches(p) == [("actor", 0, True)]
    assert "boom" in p.actions[0].event.message


def test_a_rollout_that_exits_0_while_the_actor_trains_is_a_restart_with_backoff_and_limit():
    """A rollout ends on its own only after the actor's last step; user code calling os._exit(0) would
    otherwise relaunch it in a loop that looks healthy. After the actor's success it is no restart."""
    rows, procs = running()
    rows[1] = row("rollout", 0, 2, "Succeeded", code=0, ended=60)
    p = run_plan(rows, procs[:1], prev=status("Running"))
    assert launches(p) == [("rollout", 0, True)] and p.actions[-1].event.reason == "Restarted"
    again = [*rows, row("rollout", 0, 3, "Succeeded", code=0, ended=90)]
    p = run_plan(again, procs[:1], prev=status("Running"), max_restarts=1)
    assert cond(p, "Failed")["reason"] == "RestartLimitReached"
    done = [row("actor", 0, 1, "Succeeded", code=0, step=5), rows[1]]
    p = run_plan(done, [], prev=status("Running"), max_steps=5)
    assert p.status["phase"] == "Succeeded"


def test_restart_limit_fails_the_run_with_the_last_message_and_stops_the_rest():
    rows = [
        row("actor", 0, 1, "Lost", ended=60),
        row("actor", 0, 2, "Lost", ended=60),
        row("actor", 0, 3, "Failed", code=75, ended=60, message="CUDA error"),
        row("rollout", 0, 4),
    ]
    p = run_plan(rows, [proc(rows[3])], prev=status("Recovering"), max_restarts=2)
    assert p.status["phase"] == "Failed"
    assert p.status["restarts"] == 2
    failed = cond(p, "Failed")
    assert failed["reason"] == "RestartLimitReached"
    assert failed["message"] == "restart limit reached: actor-0: CUDA error"
    assert stops(p) == [(rows[3].handle, CFG.stop_grace_seconds)]
    assert launches(p) == []
    assert p.status["completionTime"] == NOW.isoformat()


def _failures(*failures: tuple[str, str | None, float]) -> list:
    """The actor slot's ended workers, oldest first: (state, reported message, seconds it ran), each ended
    long enough ago that its backoff is over."""
    return [
        row(
            "actor",
            0,
            i + 1,
            state,
            code=75 if state == "Failed" else None,
            message=message,
            started=600.0 + lived,
            ended=600.0,
        )
        for i, (state, message, lived) in enumerate(failures)
    ]


SAME = ("Failed", "AssertionError: FSDP parameters should be materialized on CPU", 20.0)


@pytest.mark.parametrize(
    ("failures", "limit", "fails"),
    [
        ([SAME, SAME, SAME], 3, True),  # the same error on three launches in a row
        ([SAME, SAME], 3, False),  # twice may still be chance
        ([SAME, SAME, SAME], 0, False),  # off
        (
            [SAME, ("Failed", "RuntimeError: NCCL timeout", 20.0), SAME, SAME],
            3,
            False,
        ),  # another error between
        ([SAME, ("Lost", None, 20.0), SAME, SAME], 3, False),  # a loss (preempted, killed) between
        ([SAME, (SAME[0], SAME[1], 500.0), SAME], 3, False),  # one of them trained for minutes first
        ([("Failed", None, 20.0)] * 3, 3, False),  # nothing reported: not known to be the same error
        ([SAME] * 5, 5, True),
    ],
    ids=[
        "three",
        "two",
        "off",
        "other-error-between",
        "loss-between",
        "long-lived-between",
        "no-message",
        "five",
    ],
)
def test_the_same_error_on_every_launch_fails_the_run_as_a_crash_loop_before_max_restarts(
    failures, limit, fails
):
    rows = _failures(*failures)
    p = run_plan(
        rows, [], prev=status("Recovering"), rollout_replicas=0, max_restarts=10, same_failure_limit=limit
    )
    if fails:
        assert p.status["phase"] == "Failed" and launches(p) == []
        failed = cond(p, "Failed")
        assert failed["reason"] == "CrashLoop"
        assert failed["message"] == (
            f"actor-0 failed {limit} times in a row with the same error, each within 120 s "
            f"of its launch: {SAME[1]} (relaunching does not fix it; "
            f"restartPolicy.sameFailureLimit)"
        )
    else:
        assert p.status["phase"] == "Recovering" and launches(p) == [("actor", 0, True)]


def test_the_restart_limit_is_named_when_it_is_spent_by_the_same_error():
    p = run_plan(
        _failures(SAME, SAME, SAME), [], prev=status("Recovering"), rollout_replicas=0, max_restarts=2
    )
    assert cond(p, "Failed")["reason"] == "RestartLimitReached"


def test_zero_max_restarts_fails_on_first_loss():
    rows, procs = running()
    procs[0] = proc(rows[0], alive=False, code=1)
    p = run_plan(rows, procs, prev=status("Running"), max_restarts=0)
    assert p.status["phase"] == "Failed"


def test_fatal_exit_fails_the_run_at_once():
    rows, procs = running()
    rows[0] = row("actor", 0, 1, "Failed", code=3, message="BadReward: reward raised KeyError")
    p = run_plan(rows, procs[1:], prev=status("Running"))
    assert p.status["phase"] == "Failed"
    assert cond(p, "Failed")["reason"] == "WorkerFailed"
    assert "BadReward: reward raised KeyError" in p.status["message"]
    assert launches(p) == []


@pytest.mark.parametrize(
    ("reason", "message"),
    [
        ("ResumeRefused", "the dataset's rows changed since the checkpoint of step 2"),
        (
            "CheckpointStorageUnavailable",
            "spec.checkpoint.uri 's3://b/p': this machine lacks the package of that storage",
        ),
    ],
)
def test_a_refused_resume_fails_the_run_with_its_own_reason_and_is_not_relaunched(reason, message):
    rows, procs = running()
    rows[0] = row("actor", 0, 1, "Failed", code=3, message=f"{reason}: {message}")
    p = run_plan(rows, procs[1:], prev=status("Running"))
    assert p.status["phase"] == "Failed"
    assert cond(p, "Failed")["reason"] == reason == cond(p, "Ready")["reason"]
    assert f"actor-0 failed: {reason}: {message}" in p.status["message"]
    assert launches(p) == []


def test_process_exit_code_3_is_fatal_only_with_the_workers_message():
    """A worker writes its reason, then exits 3; the same code from the run's own code (os._exit(3) on a
    thread of its own) is a crash like any other: relaunched, not the run failed at once without a word."""
    rows, procs = running()
    procs[0] = proc(rows[0], alive=False, code=3)
    p = run_plan(rows, procs, prev=status("Running"))
    assert ends(p)[0] == (rows[0].id, "Lost")
    assert p.status["phase"] != "Failed"
    rows[0] = row("actor", 0, 1, "Running", message="BadDataset: no rows")
    p = run_plan(rows, [proc(rows[0], alive=False, code=3), procs[1]], prev=status("Running"))
    assert ends(p)[0] == (rows[0].id, "Failed")
    assert p.status["phase"] == "Failed"


def test_stale_heartbeat_of_a_live_process_is_lost_and_killed():
    rows, procs = running()
    rows[1] = row("rollout", 0, 2, beat=12.0, lease=10.0)  # SIGSTOPped
    p = run_plan(rows, procs, prev=status("Running"))
    assert ends(p) == [(rows[1].id, "Lost")]
    assert stops(p) == [(procs[1].handle, 0.0)]
    assert p.status["phase"] == "Recovering"


def test_rollout_loss_relaunches_only_the_rollout():
    rows, procs = running(rollouts=2)
    rows[2] = row("rollout", 1, 3, "Lost", ended=20)
    p = run_plan(rows, procs[:2], prev=status("Recovering"), rollout_replicas=2)
    assert launches(p) == [("rollout", 1, True)]


def test_no_heartbeat_long_after_start_is_lost():
    w = row("actor", 0, 1, "Pending", beat=None, started=CFG.startup_timeout_seconds + 1)
    p = run_plan([w], [proc(w)], prev=status("Starting"), rollout_replicas=0)
    assert ends(p) == [(w.id, "Lost")]


# -- launch protocol: controller killed between intent row, launch and handle -------------------------
def test_intent_row_with_a_live_process_is_adopted_not_relaunched():
    w = row("actor", 0, 1, "Pending", handle=None, beat=None, started=30)
    p = run_plan([w], [proc(w, handle="pid-42")], prev=status("Starting"), rollout_replicas=0)
    assert kinds(p) == ["Adopt"]
    assert p.actions[0] == Adopt(w.id, "pid-42", p.actions[0].event)


def test_young_intent_row_without_process_waits_no_twin():
    w = row("actor", 0, 1, "Pending", handle=None, beat=None, started=3)
    p = run_plan([w], [], prev=status("Starting"), rollout_replicas=0)
    assert p.actions == ()
    assert p.outcome == RequeueAfter(pytest.approx(1.0))  # active resync comes first


def test_old_intent_row_without_process_is_closed_and_launched_again_without_a_restart():
    w = row("actor", 0, 1, "Pending", handle=None, beat=None, started=CFG.launch_grace_seconds + 1)
    p = run_plan([w], [], prev=status("Starting"), rollout_replicas=0)
    assert ends(p) == [(w.id, "Stopped")]
    assert launches(p) == [("actor", 0, False)]
    assert p.status["restarts"] == 0


def test_recorded_handle_whose_process_vanished_is_lost():
    w = row("actor", 0, 1)
    p = run_plan([w], [], prev=status("Running"), rollout_replicas=0)
    assert ends(p) == [(w.id, "Lost")]


def test_orphans_are_stopped_zombies_only_after_a_grace():
    rows, procs = running()
    ended_long_ago = row("rollout", 0, 9, "Lost", ended=CFG.orphan_grace_seconds + 5)
    ended_just_now = row("rollout", 0, 8, "Succeeded", code=0, ended=0.1)
    stray = proc(row("rollout", 5, 77), handle="stray")
    all_procs = [*procs, proc(ended_long_ago), proc(ended_just_now), stray]
    p = run_plan([*rows, ended_just_now, ended_long_ago], all_procs, prev=status("Running"))
    assert sorted(stops(p)) == sorted(
        [(ended_long_ago.handle, CFG.orphan_grace_seconds), ("stray", CFG.orphan_grace_seconds)]
    )
    assert {a.event.reason for a in p.actions} == {"OrphanStopped"}


def test_processes_of_an_earlier_run_of_the_name_are_never_the_new_runs_workers():
    """A run deleted and applied again counts incarnations from 1 again: the old run's rollout #2 that died
    with exit 3 and its actor #1 still shutting down carry the same ids as the new run's rows, but not its
    uid. Neither is adopted nor judged (no failure, no restart): the live one is stopped as an orphan."""
    actor, rollout = row("actor", 0, 1, "Pending", handle=None, beat=None, started=1), row("rollout", 0, 2)
    old_dead = proc(rollout, alive=False, code=3, handle="old-rollout", uid="old")
    old_live = proc(actor, handle="old-actor", uid="old")
    new_rollout = proc(rollout, uid="new")
    p = run_plan([actor, rollout], [old_dead, old_live, new_rollout], prev=status("Starting"), uid="new")
    assert ends(p) == [] and launches(p) == []
    assert stops(p) == [("old-actor", CFG.orphan_grace_seconds)]
    assert p.status["phase"] != "Failed" and p.status["restarts"] == 0


def test_twin_rows_keep_the_newest_incarnation():
    a, b = row("actor", 0, 1), row("actor", 0, 2)
    p = run_plan([a, b], [proc(a), proc(b)], prev=status("Running"), rollout_replicas=0)
    assert stops(p) == [(a.handle, CFG.stop_grace_seconds)]
    assert launches(p) == []


# -- scale, suspend, resume, delete ------------------------------------------------------------------
def test_scale_up_launches_new_slots_and_stays_running():
    rows, procs = running(rollouts=1)
    prev = run_plan(rows, procs, prev=status("Starting")).status
    p = run_plan(rows, procs, prev=prev, rollout_replicas=3)
    assert launches(p) == [("rollout", 1, False), ("rollout", 2, False)]
    assert p.status["phase"] == "Running"
    assert [e.message for e in p.events] == ["rollout replicas 1 -> 3"]


def test_scale_down_stops_the_highest_slots_then_closes_their_rows():
    rows, procs = running(rollouts=3)
    p = run_plan(rows, procs, prev=status("Running"), rollout_replicas=1)
    assert sorted(stops(p)) == sorted(
        [(procs[2].handle, CFG.stop_grace_seconds), (procs[3].handle, CFG.stop_grace_seconds)]
    )
    assert ends(p) == []
    assert p.outcome == RequeueAfter(CFG.stop_poll_seconds)
    p = run_plan(rows, procs[:2], prev=status("Running"), rollout_replicas=1)  # stop() returned: gone
    assert ends(p) == [(rows[2].id, "Stopped"), (rows[3].id, "Stopped")]
    assert p.status["replicas"]["rollout"] == {"ready": 1, "desired": 1}


def test_suspend_stops_everything_then_is_done():
    rows, procs = running()
    p = run_plan(rows, procs, prev=status("Running"), suspend=True)
    assert len(stops(p)) == 2
    assert p.status["phase"] == "Suspended"
    assert cond(p, "Suspended")["status"] == "True"
    p = run_plan(rows, [], prev=p.status, suspend=True)
    assert [s for _, s in ends(p)] == ["Stopped", "Stopped"]
    assert p.status["message"] == "suspended"
    stopped = [row("actor", 0, 1, "Stopped"), row("rollout", 0, 2, "Stopped")]
    p = run_plan(stopped, [], prev=p.status, suspend=True)
    assert (p.actions, p.outcome) == ((), Done())


def test_resume_relaunches_without_counting_restarts():
    stopped = [row("actor", 0, 1, "Stopped", step=12), row("rollout", 0, 2, "Stopped")]
    p = run_plan(stopped, [], prev=status("Suspended", step=12))
    assert launches(p) == [("actor", 0, False), ("rollout", 0, False)]
    assert (p.status["phase"], p.status["restarts"]) == ("Starting", 0)


def test_delete_stops_workers_then_purges():
    rows, procs = running()
    p = run_plan(rows, procs, prev=status("Running"), deleted=True, purge=True)
    assert len(stops(p)) == 2 and not any(isinstance(a, Purge) for a in p.actions)
    p = run_plan(rows, [], prev=status("Running"), deleted=True, purge=True)
    assert kinds(p) == ["EndWorker", "EndWorker", "Purge"]
    assert p.actions[-1] == Purge(remove_files=True)
    assert (p.status, p.outcome) == (None, Done())


def test_delete_of_a_run_that_never_started_purges_at_once():
    p = run_plan([], [], prev={}, deleted=True)
    assert p.actions == (Purge(remove_files=False),)


# -- success and terminal phases -----------------------------------------------------------------------
def test_actor_success_at_max_steps_succeeds_the_run_and_stops_rollouts():
    rows, procs = running()
    rows[0] = row("actor", 0, 1, "Succeeded", code=0, step=100)
    p = run_plan(rows, procs[1:], prev=status("Running"), max_steps=100)
    assert p.status["phase"] == "Succeeded"
    assert stops(p) == [(procs[1].handle, CFG.stop_grace_seconds)]
    assert cond(p, "Succeeded")["status"] == "True"


def test_actor_that_exited_0_early_is_relaunched_not_succeeded():
    rows = [row("actor", 0, 1, "Succeeded", code=0, step=40)]
    ckpt = CheckpointRow(run="r", step=40, path="p", weight_version=40, complete=True, created_at=ago(5))
    p = run_plan(rows, [], prev=status("Running"), ckpt=ckpt, max_steps=100, rollout_replicas=0)
    assert launches(p) == [("actor", 0, False)]
    [launch] = p.actions
    assert launch.event.message == "launched actor-0 to train on from step 40 to maxSteps 100", "says why"


def test_terminal_phase_is_sticky_and_only_stops_leftovers():
    rows, procs = running()
    prev = {
        "phase": "Failed",
        "conditions": [
            {"type": "Failed", "status": "True", "reason": "WorkerFailed", "message": "actor-0 failed: x"}
        ],
    }
    p = run_plan(rows, procs, prev=prev)
    assert launches(p) == [] and len(stops(p)) == 2
    assert p.status["phase"] == "Failed"
    assert cond(p, "Failed")["message"] == "actor-0 failed: x"


def test_a_phase_the_table_does_not_allow_is_reached_through_a_legal_hop():
    rows, procs = running()
    p = run_plan(rows, procs, prev={})  # Pending, yet the world says Running (a controller was down)
    assert p.status["phase"] == "Starting"
    assert p.outcome == RequeueAfter(0.0)


def test_plan_is_pure_same_inputs_same_plan():
    rows, procs = running()
    procs[0] = proc(rows[0], alive=False, code=-9)
    assert run_plan(rows, procs, prev=status("Running")) == run_plan(rows, procs, prev=status("Running"))


def test_config_timings_are_honoured():
    w = row("actor", 0, 1, "Pending", handle=None, beat=None, started=3)
    p = run_plan([w], [], prev=status("Starting"), rollout_replicas=0, cfg=PlanConfig(launch_grace_seconds=2))
    assert [s for _, s in ends(p)] == ["Stopped"]


def test_a_backend_that_cannot_run_here_fails_the_run_with_its_reason():
    p = plan(
        Desired(name="r", backend="modal"),
        Observed(workers=[], backend_error="modal backend not built yet"),
        NOW,
    )
    assert p.status["phase"] == "Failed"
    assert cond(p, "Failed")["reason"] == "BackendUnavailable"
