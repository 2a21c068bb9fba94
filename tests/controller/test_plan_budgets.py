"""Table tests of spec.limits in the pure planner: the active-time clock (Suspended time left out), GPU time
from the worker rows, and a limit reached: every worker stopped (the actor checkpoints on TERM), then Failed
with DeadlineExceeded or BudgetExceeded."""

from __future__ import annotations

from datetime import timedelta

import pytest
from planhelpers import CFG, NOW, ago, proc, row, run_plan, running, status

from mortal.controller import budgets
from mortal.controller.actions import EndWorker, Launch, Stop
from mortal.controller.observed import PlanConfig
from mortal.controller.outcome import Done, RequeueAfter
from mortal.specs import RunStatus


def cond(p, type_):
    return next((c for c in p.status["conditions"] if c["type"] == type_), None)


def clock(phase: str, seconds: float, since_ago: float | None, **extra):
    return status(
        phase,
        activeSeconds=seconds,
        activeSince=None if since_ago is None else ago(since_ago).isoformat(),
        **extra,
    )


def with_gpus(w, gpus: int):
    w.gpus = gpus
    return w


# -- the active-time clock ---------------------------------------------------------------------------
def test_a_new_run_starts_its_clock_and_writes_it_in_the_status():
    p = run_plan([])
    assert (p.status["activeSeconds"], p.status["activeSince"], p.status["gpuHours"]) == (
        0.0,
        NOW.isoformat(),
        0.0,
    )
    assert RunStatus.model_validate(p.status).active_time(NOW + timedelta(seconds=30)) == 30.0


def test_an_unchanged_clock_writes_the_same_status_again():
    rows, procs = running()
    first = run_plan(rows, procs, prev=clock("Running", 12.0, 40))
    again = run_plan(rows, procs, prev=first.status, now=NOW + timedelta(seconds=5))
    assert (again.status["activeSeconds"], again.status["activeSince"]) == (12.0, ago(40).isoformat())


def test_suspending_folds_the_period_into_active_seconds_and_stops_the_clock():
    rows, procs = running()
    p = run_plan(rows, procs, prev=clock("Running", 10.0, 30), suspend=True, max_duration=3600)
    assert p.status["phase"] == "Suspended"
    assert (p.status["activeSeconds"], p.status["activeSince"]) == (40.0, None)
    later = run_plan([], prev=p.status, suspend=True, now=NOW + timedelta(hours=5), max_duration=3600)
    assert (later.status["activeSeconds"], later.status["activeSince"]) == (40.0, None)


def test_time_while_suspended_does_not_count_toward_max_duration():
    # 100 s active before a suspend of hours: resuming with maxDuration 150 s launches, and the clock
    # restarts.
    p = run_plan([], prev=clock("Suspended", 100.0, None), max_duration=150)
    assert [type(a) for a in p.actions] == [Launch, Launch]
    assert (p.status["phase"], p.status["activeSeconds"], p.status["activeSince"]) == (
        "Starting",
        100.0,
        NOW.isoformat(),
    )


def test_the_pass_asks_to_be_woken_when_the_deadline_falls():
    rows, procs = running()
    slow = PlanConfig(active_resync_seconds=60.0)
    p = run_plan(rows, procs, prev=clock("Running", 50.0, 60), cfg=slow, max_duration=140)
    assert p.actions == ()
    assert p.outcome == RequeueAfter(30.0)


# -- maxDuration reached -----------------------------------------------------------------------------
def test_deadline_reached_stops_every_worker_like_a_suspend_and_waits_for_them():
    rows, procs = running(rollouts=2)
    p = run_plan(rows, procs, prev=clock("Running", 100.0, 30), max_duration=120, rollout_replicas=2)
    assert sorted(a.handle for a in p.actions if isinstance(a, Stop)) == ["h1", "h2", "h3"]
    assert {a.grace_seconds for a in p.actions if isinstance(a, Stop)} == {CFG.stop_grace_seconds}
    assert not any(isinstance(a, Launch) for a in p.actions)
    assert p.status["phase"] == "Running"  # not Failed before the final checkpoint is written
    ready = cond(p, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "DeadlineExceeded")
    assert p.status["message"].startswith("limits.maxDuration (2m) reached: active for 2m10s; stopping 3")


def test_deadline_reached_fails_the_run_once_every_worker_is_gone():
    rows = [row("actor", 0, 1, "Stopped", step=7), row("rollout", 0, 2, "Stopped")]
    p = run_plan(rows, [], prev=clock("Running", 100.0, 30), max_duration=120)
    assert p.status["phase"] == "Failed"
    failed = cond(p, "Failed")
    assert (failed["status"], failed["reason"]) == ("True", "DeadlineExceeded")
    assert "limits.maxDuration (2m) reached" in failed["message"]
    assert p.status["completionTime"] == NOW.isoformat()
    assert (p.status["activeSeconds"], p.status["activeSince"]) == (130.0, None)  # frozen
    assert [e.reason for e in p.events] == ["Failed"]
    assert p.outcome == Done()
    # a later pass keeps the reason, and the clock stays stopped
    later = run_plan(rows, [], prev=p.status, now=NOW + timedelta(hours=1), max_duration=120)
    assert cond(later, "Failed")["reason"] == "DeadlineExceeded" and later.status["activeSeconds"] == 130.0


def test_a_worker_already_gone_is_ended_as_stopped_not_relaunched_and_the_rest_stopped():
    actor = row("actor", 0, 1, step=3)
    rollout = row("rollout", 0, 2)
    p = run_plan(
        [actor, rollout],
        [proc(actor), proc(rollout, alive=False, code=-9)],
        prev=clock("Running", 200.0, 1),
        max_duration=100,
    )
    assert [a.handle for a in p.actions if isinstance(a, Stop)] == ["h1"]
    ends = [(a.worker_id, a.state, a.exit_code) for a in p.actions if isinstance(a, EndWorker)]
    assert ends == [(rollout.id, "Stopped", -9)]  # stopping on purpose, as a suspend: not a loss to recover
    assert not any(isinstance(a, Launch) for a in p.actions)
    assert p.status["phase"] == "Running"


def test_reaching_max_steps_before_the_deadline_is_noticed_succeeds():
    rows = [row("actor", 0, 1, "Succeeded", step=100, code=0), row("rollout", 0, 2, "Stopped")]
    p = run_plan(rows, [], prev=clock("Running", 500.0, 10), max_duration=60)
    assert p.status["phase"] == "Succeeded"


def test_no_limits_no_budget_stop_however_long():
    rows, procs = running()
    p = run_plan(rows, procs, prev=clock("Running", 10 * 86400.0, 86400))
    assert p.actions == () and p.status["phase"] == "Running"


# -- maxGPUHours -------------------------------------------------------------------------------------
def test_gpu_hours_are_wall_time_times_gpus_of_each_worker_relaunches_included():
    lost = with_gpus(row("actor", 0, 1, "Lost", started=9000, ended=5000, beat=7200, lease=10), 2)
    actor = with_gpus(row("actor", 0, 3, started=3600, beat=0.5), 2)
    colocated = with_gpus(row("rollout", 0, 2, started=3600), 0)
    rows = [lost, colocated, actor]
    # the lost one is charged up to its last heartbeat + lease (9000 - 7200 + 10 s), not until it was noticed
    assert budgets.worker_gpu_seconds(lost, NOW) == pytest.approx(2 * 1810)
    assert budgets.gpu_seconds(rows, NOW) == pytest.approx(2 * 1810 + 2 * 3600)
    p = run_plan(rows, [proc(actor), proc(colocated)], prev=clock("Running", 0.0, 3600))
    assert p.status["gpuHours"] == round((2 * 1810 + 2 * 3600) / 3600, 2)
    RunStatus.model_validate(p.status)


def test_gpu_budget_reached_stops_the_workers_then_fails_with_budget_exceeded():
    actor = with_gpus(row("actor", 0, 1, started=1800, step=4), 1)
    rollout = with_gpus(row("rollout", 0, 2, started=1800), 1)
    p = run_plan(
        [actor, rollout], [proc(actor), proc(rollout)], prev=clock("Running", 0.0, 1800), max_gpu_hours=1
    )
    assert sorted(a.handle for a in p.actions if isinstance(a, Stop)) == ["h1", "h2"]
    assert cond(p, "Ready")["reason"] == "BudgetExceeded"
    stopped = [
        row("actor", 0, 1, "Stopped", started=1800, step=4),
        row("rollout", 0, 2, "Stopped", started=1800),
    ]
    done = run_plan([with_gpus(w, 1) for w in stopped], [], prev=p.status, max_gpu_hours=1)
    failed = cond(done, "Failed")
    assert (done.status["phase"], failed["reason"]) == ("Failed", "BudgetExceeded")
    assert "limits.maxGPUHours (1) reached: the workers used 1.00 GPU-hours" in failed["message"]


def test_gpu_budget_wakes_the_pass_when_the_live_gpus_will_use_it_up():
    actor = with_gpus(row("actor", 0, 1, started=1800), 2)
    slow = PlanConfig(active_resync_seconds=3600.0)
    p = run_plan(
        [actor],
        [proc(actor)],
        prev=clock("Running", 0.0, 1800),
        cfg=slow,
        max_gpu_hours=2,
        rollout_replicas=0,
    )
    assert p.actions == ()
    assert p.outcome == RequeueAfter(pytest.approx(1800.0))  # 3600 GPU-s left at 2 GPUs


def test_a_cpu_run_uses_no_gpu_hours_and_never_reaches_a_gpu_budget():
    rows, procs = running()
    p = run_plan(rows, procs, prev=clock("Running", 0.0, 10 * 3600), max_gpu_hours=0.001)
    assert p.status["gpuHours"] == 0.0
    assert p.actions == () and p.status["phase"] == "Running"


def test_a_limit_found_reached_holds_for_that_spec_and_a_raised_limit_relaunches():
    stopping = run_plan(*running(), prev=clock("Running", 100.0, 30), max_duration=120)
    assert cond(stopping, "Ready")["reason"] == "DeadlineExceeded"
    gone = [row("actor", 0, 1, "Stopped", step=7), row("rollout", 0, 2, "Stopped")]
    # the same spec: stays reached even when a recount comes out under the limit (it is never re-derived
    # lower)
    same = run_plan(gone, [], prev={**stopping.status, "activeSeconds": 0.0}, max_duration=120)
    assert same.status["phase"] == "Failed" and cond(same, "Failed")["reason"] == "DeadlineExceeded"
    # the user raised maxDuration while the workers stopped (a new generation): judged again, relaunched
    raised = run_plan(gone, [], prev=stopping.status, max_duration=3600, generation=2)
    assert len([a for a in raised.actions if isinstance(a, Launch)]) == 2
    assert raised.status["phase"] == "Recovering"  # the legal hop from Running towards Starting
