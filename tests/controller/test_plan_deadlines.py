"""The watchdog's rules as tables: each activity's deadline, a worker found past it, what plan() does then
(ask for its stacks; once it wrote them or did not answer in time: end, stop, relaunch), and when it gives
up (the same stall restartPolicy.sameFailureLimit times)."""

from __future__ import annotations

import pytest
from planhelpers import CFG, NOW, ago, kinds, proc, row, run_plan, running, status

from mortal.controller import deadlines as dl
from mortal.controller.actions import EndWorker, Launch, Stop
from mortal.controller.status import iso
from mortal.state.tables import WorkerRow

DERIVED = dl.DerivedFrom(minimum=60.0, factor=10.0, before_first_step=1800.0)


def doing(w: WorkerRow, activity: str, since: float) -> WorkerRow:
    """`w` reporting `activity` for `since` seconds before NOW."""
    w.activity, w.activity_since = activity, ago(since)
    return w


# -- the deadline of each activity ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "kind, spec, step_seconds, want",
    [
        # derived from the run's step times, as the progress deadline: 10 x median, at least 60 s
        ("task", dl.Deadlines(), 2.0, 60.0),
        ("task", dl.Deadlines(), 30.0, 300.0),
        # no step time yet: the long default
        ("task", dl.Deadlines(), None, 1800.0),
        # never below the task's reward timeouts added up (plus the minimum): a reward timeout heals first
        ("task", dl.Deadlines(reward_seconds=300.0), 2.0, 360.0),
        # a step outlasts one of its tasks healed once
        ("step", dl.Deadlines(), 2.0, 120.0),
        ("step", dl.Deadlines(reward_seconds=300.0), 2.0, 720.0),
        # what the spec sets is used as it is
        ("task", dl.Deadlines(task_seconds=5.0, reward_seconds=300.0), 2.0, 5.0),
        ("step", dl.Deadlines(task_seconds=5.0), 2.0, 60.0),  # twice a 5 s task, but not under the minimum
        ("step", dl.Deadlines(task_seconds=50.0), 2.0, 100.0),
        ("step", dl.Deadlines(step_seconds=7.0), 2.0, 7.0),
        ("weight-load", dl.Deadlines(weight_load_seconds=42.0), 2.0, 42.0),
        # a kind with no deadline
        ("collective", dl.Deadlines(), 2.0, None),
    ],
)
def test_deadline_of_each_activity(kind, spec, step_seconds, want):
    assert dl.deadline(kind, spec, step_seconds, DERIVED) == want


@pytest.mark.parametrize(
    "activity, since, want",
    [
        (None, None, None),  # idle
        ("task 3.1", 59.0, None),  # within its 60 s
        ("task 3.1", 61.0, ("TaskDeadlineExceeded", "task 3.1 has run 61 s, past its deadline of 60 s")),
        ("step 4", 121.0, ("StepDeadlineExceeded", "step 4 has run 121 s, past its deadline of 120 s")),
        ("weight-load v7", 601.0, ("WeightLoadDeadlineExceeded", "weight-load v7 has run 601 s")),
    ],
)
def test_stalled(activity, since, want):
    found = dl.stalled(activity, ago(since) if since is not None else None, NOW, dl.Deadlines(), 2.0, DERIVED)
    assert (found.reason, found.message[: len(want[1])]) == want if want else found is None


# -- what plan() does with a stalled worker ------------------------------------------------------------
def asked(w: WorkerRow, seconds: float, written: float | None = None) -> WorkerRow:
    """`w` asked for its stacks `seconds` before NOW (and wrote them `written` seconds before NOW)."""
    w.stacks_asked_at = ago(seconds)
    w.stacks_written_at = None if written is None else ago(written)
    return w


def test_a_rollout_past_its_task_deadline_is_first_asked_for_its_stacks_and_left_running():
    rows, procs = running(rollouts=1)
    doing(rows[1], "task 5.0", since=61.0)
    p = run_plan(rows, procs, prev=status("Running", stepSeconds=2.0))
    assert kinds(p) == ["DumpStacks"]
    [dump] = p.actions
    assert (dump.handle, dump.worker_id) == (procs[1].handle, rows[1].id)
    assert p.outcome.seconds <= CFG.stacks_answer_seconds  # looks again once it may have answered


def test_a_stalled_rollout_that_wrote_its_stacks_is_ended_failed_and_stopped():
    rows, procs = running(rollouts=1)
    asked(doing(rows[1], "task 5.0", since=61.0), 1.0, written=0.5)
    p = run_plan(rows, procs, prev=status("Running", stepSeconds=2.0))
    assert kinds(p) == ["EndWorker", "Stop"]
    end, stop = p.actions
    assert isinstance(end, EndWorker) and isinstance(stop, Stop)
    assert stop.handle == procs[1].handle
    assert (end.worker_id, end.state) == (rows[1].id, "Failed")
    assert end.message.startswith("TaskDeadlineExceeded: task 5.0 has run 61 s, past its deadline of 60 s")
    assert (end.event.type, end.event.reason) == ("Warning", "TaskDeadlineExceeded")
    assert end.event.message.startswith("rollout-0 #2: task 5.0 has run 61 s")
    assert end.event.message.endswith("; its stacks are in its log; relaunching it")
    assert (
        stop.grace_seconds > 0
    )  # TERM first: a stalled worker holds no transaction, and its stacks come first


@pytest.mark.parametrize("waited", [0.0, CFG.stacks_answer_seconds - 1.0])
def test_a_stalled_rollout_is_given_time_to_answer_the_request(waited):
    rows, procs = running(rollouts=1)
    asked(doing(rows[1], "task 5.0", since=61.0), waited)
    p = run_plan(rows, procs, prev=status("Running", stepSeconds=2.0))
    assert kinds(p) == []
    assert 0 < p.outcome.seconds <= CFG.stacks_answer_seconds - waited


@pytest.mark.parametrize("asked_before", [False, True], ids=["asked now", "awaiting the answer"])
def test_deadlines_met_is_false_from_the_pass_that_asks_a_stalled_worker_for_its_stacks(asked_before):
    rows, procs = running(rollouts=1)
    doing(rows[1], "task 5.0", since=61.0)
    if asked_before:
        asked(rows[1], 1.0)
    p = run_plan(rows, procs, prev=status("Running", step=5, lastStepTime=iso(ago(70)), stepSeconds=2.0))
    met = next(c for c in p.status["conditions"] if c["type"] == "DeadlinesMet")
    assert (met["status"], met["reason"]) == ("False", "TaskDeadlineExceeded")
    assert met["message"].startswith("rollout-0 #2: task 5.0 has run 61 s")
    assert met["message"].endswith("; its stacks are asked for, then it is relaunched")


def test_a_stalled_rollout_that_does_not_answer_is_ended_and_the_event_says_so():
    rows, procs = running(rollouts=1)
    asked(doing(rows[1], "task 5.0", since=61.0), CFG.stacks_answer_seconds + 1.0)
    p = run_plan(rows, procs, prev=status("Running", stepSeconds=2.0))
    assert kinds(p) == ["EndWorker", "Stop"]
    message = p.actions[0].event.message
    assert "its stacks are in its log" not in message
    assert message.endswith(
        f"; it did not write its stacks within {CFG.stacks_answer_seconds:g} s of being asked; relaunching it"
    )


def test_a_request_from_an_earlier_stall_is_not_taken_for_an_answer_about_this_one():
    rows, procs = running(rollouts=1)
    asked(doing(rows[1], "task 6.0", since=61.0), 70.0, written=69.0)  # asked during task 5.0, which ended
    p = run_plan(rows, procs, prev=status("Running", stepSeconds=2.0))
    assert kinds(p) == ["DumpStacks"]


def test_a_stalled_worker_that_comes_back_within_its_answer_time_is_left_alone():
    rows, procs = running(rollouts=1)
    asked(doing(rows[1], "task 6.0", since=1.0), 2.0, written=1.5)  # the stuck task 5.0 ended after all
    p = run_plan(rows, procs, prev=status("Running", stepSeconds=2.0))
    assert kinds(p) == []


def test_a_worker_within_its_deadline_is_left_alone_and_the_pass_wakes_at_the_deadline():
    rows, procs = running(rollouts=1)
    doing(rows[0], "step 5", since=100.0)
    p = run_plan(rows, procs, prev=status("Running", stepSeconds=2.0))
    assert kinds(p) == []
    assert p.outcome.seconds <= 20.0


def test_the_actor_past_an_explicit_step_deadline_is_relaunched_after_the_backoff():
    rows, procs = running(rollouts=1)
    asked(doing(rows[0], "step 5", since=31.0), 1.0, written=1.0)
    first = run_plan(
        rows, procs, prev=status("Running"), deadlines=dl.Deadlines(step_seconds=30.0), backoff_seconds=0.0
    )
    assert kinds(first) == ["EndWorker", "Stop", "Launch"]
    launch = first.actions[-1]
    assert isinstance(launch, Launch) and (launch.role, launch.restart) == ("actor", True)
    assert "StepDeadlineExceeded" in launch.event.message


@pytest.mark.parametrize(
    "rollouts, rollout_started, step_began, stalled",
    [
        (1, 400.0, 31.0, True),  # a rollout ran through the step: the deadline (30 s) counts from the step
        (0, None, 1000.0, False),  # rollout.replicas 0 pauses generation: the actor waits, with no deadline
        (1, None, 1000.0, False),  # the one rollout is being relaunched (its row ended): nothing to wait for
        (1, 20.0, 1000.0, False),  # it came back 20 s ago: the step's 30 s count from then
        (1, 31.0, 1000.0, True),  # and end 30 s after it came back
    ],
)
def test_an_actors_step_has_a_deadline_only_while_a_rollout_runs_to_feed_it(
    rollouts, rollout_started, step_began, stalled
):
    """The actor's step waits for generation: `scale RUN rollout=0` (which pauses generation), or every
    rollout down, must not make it a stall, and it is timed from the rollouts' return."""
    actor = doing(row("actor", 0, 1, step=5), "step 5", since=step_began)
    rows = [actor]
    if rollouts and rollout_started is not None:
        rows.append(row("rollout", 0, 2, started=rollout_started))
    elif rollouts:
        rows.append(row("rollout", 0, 2, "Failed", ended=5.0, started=900.0))
    p = run_plan(
        rows,
        [proc(w) for w in rows if w.state == "Running"],
        prev=status("Running"),
        deadlines=dl.Deadlines(step_seconds=30.0),
        rollout_replicas=rollouts,
        backoff_seconds=1000.0,
    )
    assert ("DumpStacks" in kinds(p)) == stalled, kinds(p)


def _stalled_history(times: int, reason: str = "TaskDeadlineExceeded") -> list[WorkerRow]:
    """rollout-0's last `times` incarnations each ended for the same stall; the actor runs."""
    rows = [row("actor", 0, 1, step=5)]
    for k in range(times):
        rows.append(
            row(
                "rollout",
                0,
                2 + k,
                "Failed",
                ended=30.0 - k,
                started=400.0,
                message=f"{reason}: task 5.0 has run 61 s, past its deadline of 60 s",
            )
        )
    return rows


def test_the_same_stall_as_often_as_sameFailureLimit_fails_the_run_with_the_stall_as_its_reason():
    rows = _stalled_history(3)
    p = run_plan(
        rows, [proc(rows[0])], prev=status("Running", step=5), same_failure_limit=3, backoff_seconds=0.0
    )
    assert p.status["phase"] == "Failed"
    failed = next(c for c in p.status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "TaskDeadlineExceeded"
    assert "rollout-0 stalled 3 times in a row: task 5.0 has run 61 s" in failed["message"]
    assert "relaunching does not heal it" in failed["message"]
    met = next(c for c in p.status["conditions"] if c["type"] == "DeadlinesMet")
    assert (met["status"], met["reason"]) == ("False", "TaskDeadlineExceeded")


@pytest.mark.parametrize(
    "history, limit, relaunched",
    [
        (_stalled_history(2), 3, True),  # two stalls in a row: one more try
        (_stalled_history(3), 0, True),  # the give-up is off
        # a loss between breaks the run of stalls
        (
            _stalled_history(2)
            + [row("rollout", 0, 9, "Lost", ended=1.0, message="process is gone")]
            + _stalled_history(1)[1:],
            2,
            True,
        ),
    ],
)
def test_fewer_stalls_in_a_row_than_the_limit_relaunch(history, limit, relaunched):
    rows = sorted(history, key=lambda w: w.incarnation)
    p = run_plan(rows, [proc(rows[0])], prev=status("Running"), same_failure_limit=limit, backoff_seconds=0.0)
    assert p.status["phase"] != "Failed"
    assert any(isinstance(a, Launch) and a.role == "rollout" and a.restart for a in p.actions) == relaunched


# -- the DeadlinesMet condition ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "ended, last_step, want, reason",
    [
        (None, 5.0, True, "WithinDeadlines"),
        (10.0, 20.0, False, "TaskDeadlineExceeded"),  # relaunched, no step since
        (10.0, None, False, "TaskDeadlineExceeded"),
        (10.0, 2.0, True, "Healed"),  # a step ended after the relaunch
    ],
)
def test_deadlines_met(ended, last_step, want, reason):
    stalls = (
        []
        if ended is None
        else [dl.StalledWorker("rollout-0", 3, "TaskDeadlineExceeded: task 5.0 has run 61 s", ago(ended))]
    )
    c = dl.deadlines_met(stalls, ago(last_step) if last_step is not None else None)
    assert (c.type, c.status, c.reason) == ("DeadlinesMet", want, reason)


def test_a_stall_turns_deadlines_met_false_with_a_warning_and_a_later_step_heals_it():
    rows, procs = running(rollouts=1)
    asked(doing(rows[1], "task 5.0", since=61.0), 1.0, written=1.0)
    first = run_plan(rows, procs, prev=status("Running", step=5, lastStepTime=iso(ago(70)), stepSeconds=2.0))
    met = next(c for c in first.status["conditions"] if c["type"] == "DeadlinesMet")
    assert (met["status"], met["reason"]) == ("False", "TaskDeadlineExceeded")
    ended = [a for a in first.actions if isinstance(a, EndWorker)][0]
    rows[0].step = 6
    rows[1].state, rows[1].message, rows[1].ended_at = "Failed", ended.message, ago(1)
    healed_rows = [*rows, row("rollout", 0, 3)]
    later = run_plan(healed_rows, [proc(healed_rows[0]), proc(healed_rows[2])], prev=first.status, now=NOW)
    met = next(c for c in later.status["conditions"] if c["type"] == "DeadlinesMet")
    assert (met["status"], met["reason"]) == ("True", "Healed")


def test_only_rows_the_watchdog_ended_count_as_stalls_not_a_workers_own_report_that_reads_like_one():
    rows = [row("actor", 0, 1, step=5)] + [
        row(
            "rollout",
            0,
            2 + k,
            "Failed",
            ended=30.0 - k,
            started=400.0,
            code=75,
            message="TaskDeadlineExceeded: raised by user code",
        )
        for k in range(3)
    ]
    p = run_plan(rows, [proc(rows[0])], prev=status("Running"), same_failure_limit=3, backoff_seconds=0.0)
    assert (
        p.status["phase"] != "Failed"
    )  # relaunched: long-lived failures, neither a stall loop nor a crash loop
    met = next(c for c in p.status["conditions"] if c["type"] == "DeadlinesMet")
    assert met["reason"] == "WithinDeadlines"


def test_a_run_that_finishes_in_the_pass_after_a_stall_heals_deadlines_met():
    """Steps can end faster than passes: the pass that sees the actor done at maxSteps also sees that steps
    ended after the relaunch."""
    rows = [
        row("actor", 0, 1, "Succeeded", step=4, code=0),
        row("rollout", 0, 2, "Failed", ended=3.0, message="TaskDeadlineExceeded: task 2.0 has run 3 s"),
        row("rollout", 0, 3),
    ]
    p = run_plan(
        rows, [proc(rows[2])], prev=status("Running", step=2, lastStepTime=iso(ago(10))), max_steps=4
    )
    assert p.status["phase"] == "Succeeded"
    met = next(c for c in p.status["conditions"] if c["type"] == "DeadlinesMet")
    assert (met["status"], met["reason"]) == ("True", "Healed")
