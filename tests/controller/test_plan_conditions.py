"""Table tests of the training conditions: one row per situation, the condition's status and reason out.

The four functions of mortal.controller.conditions first, then what plan() does with them: where they
sit in status, when they are not evaluated, and the events their flips make.
"""

from __future__ import annotations

import pytest
from planhelpers import NOW, ago, proc, row, run_plan, running, status

from mortal.controller import conditions as rl
from mortal.controller.status import iso
from mortal.specs import RunStatus
from mortal.state.tables import CheckpointRow


def ro(name: str, version: int | None, beat: float = 0.5) -> rl.RolloutVersion:
    return rl.RolloutVersion(name, version, ago(beat))


# -- WeightsInSync ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "rollouts, newest, published, staleness, every, want, reason, says",
    [
        # situation: on-policy, rollouts current or one version behind (loading between tasks)
        ([ro("rollout-0", 7), ro("rollout-1", 6)], 7, 5.0, 0, 1, True, "WeightsCurrent", "actor at v7"),
        # on-policy, a rollout two versions behind: lagging
        (
            [ro("rollout-0", 7), ro("rollout-1", 5)],
            7,
            5.0,
            0,
            1,
            False,
            "RolloutLagging",
            "rollout-1 at v5; actor at v7",
        ),
        # the newest version came after the rollout's last heartbeat: it could not have said so yet
        ([ro("rollout-0", 5, beat=2.0)], 7, 1.0, 0, 1, True, "WeightsCurrent", "v5"),
        # maxStaleness 2: three versions behind is allowed (2 + 1 in flight), four is not
        ([ro("rollout-0", 4)], 7, 5.0, 2, 1, True, "WeightsCurrent", "v4"),
        ([ro("rollout-0", 3)], 7, 5.0, 2, 1, False, "RolloutLagging", "rollout-0 at v3"),
        # sync.every 4: maxStaleness 4 steps is one version
        ([ro("rollout-0", 5)], 7, 5.0, 4, 4, True, "WeightsCurrent", "v5"),
        ([ro("rollout-0", 4)], 7, 5.0, 4, 4, False, "RolloutLagging", "allowed lag 2"),
        # nothing to judge yet
        ([ro("rollout-0", 0)], None, None, 0, 1, None, "NoWeightsPublished", "not published"),
        ([ro("rollout-0", None)], 3, 5.0, 0, 1, None, "NoRolloutReporting", "newest v3"),
        ([], 3, 5.0, 0, 1, None, "NoRolloutReporting", "no live rollout"),
    ],
)
def test_weights_in_sync(rollouts, newest, published, staleness, every, want, reason, says):
    c = rl.weights_in_sync(
        rollouts, newest, ago(published) if published is not None else None, staleness, every
    )
    assert (c.type, c.status, c.reason) == ("WeightsInSync", want, reason)
    assert says in c.message


# -- RewardHealthy ---------------------------------------------------------------------------------
def steps(first: int, last: int, **values: float) -> dict[int, dict[str, float]]:
    """The same metrics at every step first..last; keys written `acc_std` mean rewards/acc/std."""
    names = {k: f"rewards/{k.rpartition('_')[0]}/{k.rpartition('_')[2]}" for k in values}
    return {s: {names[k]: v for k, v in values.items()} for s in range(first, last + 1)}


@pytest.mark.parametrize(
    "metrics, want, reason, says",
    [
        ({}, None, "NoRewardMetrics", "no step"),
        (
            {3: {"reward": 0.5, "step_seconds": 1.0}},
            None,
            "NoRewardMetrics",
            "no step",
        ),  # a workload without them
        (steps(1, 10, acc_std=0.4, acc_scored=1.0), True, "RewardsVary", "acc"),
        # every sample of the newest step unscored (all None)
        (
            {**steps(1, 9, acc_std=0.4, acc_scored=1.0), 10: {"rewards/acc/scored": 0.0}},
            False,
            "RewardAllNone",
            "'acc' returned None for every sample of step 10",
        ),
        # the same value for every sample, 10 steps in a row: stuck (at 0)
        (
            steps(1, 10, acc_std=0.0, acc_mean=0.0, acc_scored=1.0),
            False,
            "RewardConstant",
            "'acc' gave every sample the same value (0) for 10 steps in a row (steps 1-10)",
        ),
        # 9 steps in a row is not yet 10
        (steps(2, 10, acc_std=0.0, acc_scored=1.0), True, "RewardsVary", "acc"),
        # a step between with varied scores breaks the run of constant steps
        (
            {**steps(1, 10, acc_std=0.0, acc_scored=1.0), 5: {"rewards/acc/std": 0.3}},
            True,
            "RewardsVary",
            "acc",
        ),
        # a gap (a step without metrics) breaks it too
        ({k: v for k, v in steps(0, 10, acc_std=0.0).items() if k != 4}, True, "RewardsVary", "acc"),
        # one of two rewards stuck: named
        (
            {
                s: {**a, **b}
                for (s, a), b in zip(
                    steps(1, 10, fmt_std=0.0).items(), steps(1, 10, acc_std=0.2).values(), strict=True
                )
            },
            False,
            "RewardConstant",
            "'fmt'",
        ),
    ],
)
def test_reward_healthy(metrics, want, reason, says):
    c = rl.reward_healthy(metrics, stuck_steps=10)
    assert (c.type, c.status, c.reason) == ("RewardHealthy", want, reason)
    assert says in c.message


@pytest.mark.parametrize(
    "message, reason",
    [
        (
            "RewardFailed: reward 'acc' (spec.rewards[0].function 'm:acc') raised ZeroDivisionError: x",
            "RewardFailed",
        ),
        ("RewardBadOutput: reward 'acc' returned 3 scores for 4 completions", "RewardBadOutput"),
        (
            "RewardTimedOut: reward 'acc' (2 s) did not return within its timeoutSeconds on any of 5 calls "
            "for 3 steps in a row (steps 1-3)",
            "RewardTimedOut",
        ),
        ("ModelNotFound: no such model", None),
        (None, None),
    ],
)
def test_reward_failure_from_a_fatal_worker_message(message, reason):
    c = rl.reward_failure(message)
    assert (c.reason if c else None) == reason
    if c:
        assert c.status is False and "'acc'" in c.message


# -- CheckpointFresh -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "step, ckpt, every, want, reason",
    [
        (None, None, 10, True, "CheckpointRecent"),  # nothing trained yet
        (11, None, 10, True, "CheckpointRecent"),  # first checkpoint due at 10, one step of slack
        (12, None, 10, False, "CheckpointOverdue"),
        (25, 20, 10, True, "CheckpointRecent"),
        (31, 20, 10, True, "CheckpointRecent"),
        (32, 20, 10, False, "CheckpointOverdue"),
    ],
)
def test_checkpoint_fresh(step, ckpt, every, want, reason):
    c = rl.checkpoint_fresh(step, ckpt, every, slack=1)
    assert (c.type, c.status, c.reason) == ("CheckpointFresh", want, reason)


# -- Progressing -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "median, deadline",
    [
        (None, 600.0),  # no step time known: the default
        (1.0, 60.0),  # fast steps: the minimum
        (30.0, 300.0),  # 10 x the median
    ],
)
def test_progress_deadline(median, deadline):
    assert rl.progress_deadline(median, minimum=60.0, factor=10.0, default=600.0) == deadline


def test_step_seconds_is_the_median_of_the_recent_steps():
    metrics = {1: {"step_seconds": 1.0}, 2: {"step_seconds": 9.0}, 3: {"step_seconds": 2.0}, 4: {"loss": 1.0}}
    assert rl.step_seconds(metrics) == 2.0
    assert rl.step_seconds({}) is None


@pytest.mark.parametrize(
    "suspended, last, want, reason",
    [
        (True, 5.0, None, "Suspended"),
        (False, None, None, "AwaitingFirstStep"),
        (False, 30.0, True, "StepsAdvancing"),
        (False, 61.0, False, "ProgressDeadlineExceeded"),
    ],
)
def test_progressing(suspended, last, want, reason):
    c = rl.progressing(suspended, ago(last) if last is not None else None, deadline=60.0, now=NOW)
    assert (c.type, c.status, c.reason) == ("Progressing", want, reason)


# -- in plan(): status and events ------------------------------------------------------------------
def cond(p, type_):
    return next(c for c in p.status["conditions"] if c["type"] == type_)


def reasons(p):
    return [(e.type, e.reason) for e in p.events]


def test_a_running_run_carries_all_eight_conditions_and_its_status_validates():
    rows, procs = running(rollouts=1, step=5)
    p = run_plan(rows, procs, prev=status("Running", step=4), weights=5, metrics={5: {"step_seconds": 2.0}})
    types = [c["type"] for c in p.status["conditions"]]
    assert types == [
        "Ready",
        "Suspended",
        "WeightsInSync",
        "RewardHealthy",
        "CheckpointFresh",
        "Progressing",
        "DeadlinesMet",
        "MemoryFits",
    ]
    assert cond(p, "Progressing")["status"] == "True"
    assert (p.status["lastStepTime"], p.status["stepSeconds"]) == (iso(NOW), 2.0)
    RunStatus.model_validate(p.status)


def test_rollout_falling_behind_turns_weights_in_sync_false_with_a_warning_then_normal_when_caught_up():
    rows = [row("actor", 0, 1, step=9), row("rollout", 0, 2, version=9), row("rollout", 1, 3, version=6)]
    first = run_plan(
        rows,
        [proc(w) for w in rows],
        prev=status("Running", step=9),
        weights=9,
        weights_at=ago(5),
        rollout_replicas=2,
    )
    c = cond(first, "WeightsInSync")
    assert (c["status"], c["reason"]) == ("False", "RolloutLagging")
    assert "rollout-1 at v6" in c["message"]
    assert ("Warning", "RolloutLagging") in reasons(first)
    rows[2] = row("rollout", 1, 3, version=9)
    again = run_plan(
        rows, [proc(w) for w in rows], prev=first.status, weights=9, weights_at=ago(5), rollout_replicas=2
    )
    assert cond(again, "WeightsInSync")["status"] == "True"
    assert ("Normal", "WeightsCurrent") in reasons(again)


def test_first_seen_healthy_makes_no_event_and_an_unchanged_condition_keeps_its_transition_time():
    rows, procs = running(rollouts=1, step=3)
    rows[1] = row("rollout", 0, 2, version=3)
    first = run_plan(rows, [proc(w) for w in rows], prev=status("Running", step=3), weights=3)
    assert not [e for e in first.events if e.reason == "WeightsCurrent"]
    later = run_plan(rows, [proc(w) for w in rows], prev=first.status, weights=3, now=ago(-5))
    assert (
        cond(later, "WeightsInSync")["lastTransitionTime"]
        == cond(first, "WeightsInSync")["lastTransitionTime"]
    )


def test_no_step_past_the_deadline_is_progress_deadline_exceeded_then_a_step_makes_it_true():
    rows, procs = running(rollouts=1, step=5)
    prev = status(
        "Running",
        step=5,
        lastStepTime=iso(ago(100)),
        stepSeconds=2.0,
        conditions=[{"type": "Progressing", "status": "True", "reason": "StepsAdvancing", "message": ""}],
    )
    stuck = run_plan(rows, procs, prev=prev, weights=5)
    c = cond(stuck, "Progressing")
    assert (c["status"], c["reason"]) == ("False", "ProgressDeadlineExceeded")
    assert "no step has ended for 100s (deadline 60s)" in c["message"]
    assert ("Warning", "ProgressDeadlineExceeded") in reasons(stuck)
    rows[0] = row("actor", 0, 1, step=6)
    moved = run_plan(rows, procs, prev=stuck.status, weights=6)
    assert cond(moved, "Progressing")["status"] == "True"
    assert ("Normal", "StepsAdvancing") in reasons(moved)


def test_with_generation_paused_no_step_for_long_is_not_a_missed_deadline():
    """`scale RUN rollout=0` pauses generation (the actor waits): Progressing is Unknown, GenerationPaused,
    and no warning comes however long no step ends."""
    rows, procs = running(rollouts=0, step=5)
    prev = status("Running", step=5, lastStepTime=iso(ago(100)), stepSeconds=2.0)
    paused = run_plan(rows, procs, prev=prev, weights=5, rollout_replicas=0)
    c = cond(paused, "Progressing")
    assert (c["status"], c["reason"]) == ("Unknown", "GenerationPaused")
    assert ("Warning", "ProgressDeadlineExceeded") not in reasons(paused)


def test_before_the_first_step_progressing_is_unknown_and_a_resumed_actor_at_its_checkpoint_step_is_no_step():
    rows, procs = running(rollouts=1, step=0)
    assert (
        cond(run_plan(rows, procs, prev=status("Starting")), "Progressing")["reason"] == "AwaitingFirstStep"
    )
    rows, procs = running(rollouts=1, step=20)  # resumed after a suspend at step 20: the clock was cleared
    p = run_plan(rows, procs, prev=status("Starting", step=20, lastStepTime=None))
    assert cond(p, "Progressing")["reason"] == "AwaitingFirstStep"


def test_suspended_run_is_not_evaluated_for_sync_or_progress_and_forgets_its_last_step_time():
    p = run_plan([], prev=status("Running", step=7, lastStepTime=iso(ago(5))), suspend=True)
    assert (cond(p, "Progressing")["status"], cond(p, "Progressing")["reason"]) == ("Unknown", "Suspended")
    assert cond(p, "WeightsInSync")["reason"] == "Suspended"
    assert p.status["lastStepTime"] is None


def test_reward_metrics_read_this_pass_judge_reward_health_and_otherwise_the_last_verdict_stays():
    rows, procs = running(rollouts=1, step=10)
    stuck = steps(1, 10, acc_std=0.0, acc_mean=0.0, acc_scored=1.0)
    p = run_plan(rows, procs, prev=status("Running", step=9), metrics=stuck)
    assert (cond(p, "RewardHealthy")["status"], cond(p, "RewardHealthy")["reason"]) == (
        "False",
        "RewardConstant",
    )
    assert ("Warning", "RewardConstant") in reasons(p)
    kept = run_plan(rows, procs, prev=p.status, metrics=None)  # the step did not move: nothing read
    assert cond(kept, "RewardHealthy")["reason"] == "RewardConstant"
    assert not [e for e in kept.events if e.reason == "RewardConstant"]


def test_checkpoint_overdue_is_a_warning():
    rows, procs = running(rollouts=1, step=25)
    ckpt = CheckpointRow(run="r", step=10, path="/c/10", weight_version=10, complete=True, created_at=ago(60))
    p = run_plan(rows, procs, prev=status("Running", step=24), ckpt=ckpt, checkpoint_every=10)
    assert (cond(p, "CheckpointFresh")["status"], cond(p, "CheckpointFresh")["reason"]) == (
        "False",
        "CheckpointOverdue",
    )
    assert ("Warning", "CheckpointOverdue") in reasons(p)


def test_a_reward_that_raised_fails_the_run_with_reward_healthy_false_naming_it():
    message = "RewardFailed: reward 'acc' (spec.rewards[0].function 'm:acc') raised KeyError: 'x' at m.py:3"
    rows = [row("actor", 0, 1, step=4), row("rollout", 0, 2, "Failed", code=3, message=message)]
    prev = status(
        "Running",
        step=4,
        conditions=[{"type": "RewardHealthy", "status": "True", "reason": "RewardsVary", "message": "acc"}],
    )
    p = run_plan(rows, [proc(rows[0])], prev=prev)
    assert p.status["phase"] == "Failed"
    c = cond(p, "RewardHealthy")
    assert (c["status"], c["reason"]) == ("False", "RewardFailed")
    assert "reward 'acc'" in c["message"] and "KeyError" in c["message"]
    assert ("Warning", "RewardFailed") in reasons(p)
    again = run_plan(rows, [], prev=p.status)  # finished: it stays, no second event
    assert cond(again, "RewardHealthy")["reason"] == "RewardFailed"
    assert not [e for e in again.events if e.reason == "RewardFailed"]


def test_a_run_that_ends_between_passes_says_what_it_left_not_what_the_last_pass_before_saw():
    """A fast run's last pass before its end saw step 1: the finished run's conditions judge its final step
    and checkpoint, and those about workers (sync, progress) are not evaluated once none runs."""
    seen_at_step_1 = status(
        "Running",
        step=1,
        conditions=[
            {"type": "WeightsInSync", "status": "Unknown", "reason": "NoRolloutReporting", "message": "v1"},
            {"type": "CheckpointFresh", "status": "True", "reason": "CheckpointRecent", "message": "step 1"},
            {"type": "Progressing", "status": "True", "reason": "StepsAdvancing", "message": "0s ago"},
        ],
    )
    rows = [row("actor", 0, 1, "Succeeded", code=0, step=3), row("rollout", 0, 2, version=2)]
    ckpt = CheckpointRow(run="r", step=3, path="/c/3", weight_version=3, complete=True, created_at=ago(1))
    p = run_plan(
        rows, [proc(rows[1])], prev=seen_at_step_1, weights=3, ckpt=ckpt, checkpoint_every=1, max_steps=3
    )
    assert p.status["phase"] == "Succeeded"
    fresh = cond(p, "CheckpointFresh")
    assert (fresh["status"], fresh["message"]) == (
        "True",
        "newest checkpoint step 3, step 3, every 1 step(s)",
    )
    for type_ in ("WeightsInSync", "Progressing"):
        c = cond(p, type_)
        assert (c["status"], c["reason"]) == ("Unknown", "RunEnded"), c
        assert "the run succeeded at step 3" in c["message"]
    assert "newest v3" in cond(p, "WeightsInSync")["message"]
    assert not [e for e in p.events if e.reason in ("CheckpointRecent", "RunEnded")]
    RunStatus.model_validate(p.status)
