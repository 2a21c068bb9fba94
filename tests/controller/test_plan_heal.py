"""Table tests of the planner healing an out-of-memory with a setting that keeps the training step
(controller.heal): the actor relaunched with half its micro batch, down to 1, then the old rule (one relaunch,
then Failed); a rollout with half its GPU share; the choice in status.effective, passed to the launch, an
event, carried across passes."""

from __future__ import annotations

import pytest
from planhelpers import proc, row, run_plan, status

from mortal.controller import heal
from mortal.controller.actions import Launch
from mortal.controller.observed import Desired
from mortal.specs import RunStatus
from mortal.specs.memory import MICRO_BATCH_ENV, ROLLOUT_SHARE_ENV

OOM = 4
ACTOR_OOM = "OutOfMemory: tried to allocate 9.00 GiB on GPU 0 (total 79.19 GiB, 2.10 GiB free)"
ROLLOUT_OOM = "OutOfMemory: tried to allocate 2.00 GiB on GPU 0 (total 79.19 GiB, 1.23 GiB free)"
SPEC = {"batch_size": 64, "micro_batch_size": 64}  # the bench's default: one pass of the whole batch


def cond(p, type_):
    return next(c for c in p.status["conditions"] if c["type"] == type_)


def launched(p):
    return [(a.role, a.replica, a.restart, dict(a.env)) for a in p.actions if isinstance(a, Launch)]


def heal_events(p):
    return [(e.type, e.reason, e.message) for e in p.events if e.reason.endswith("Reduced")]


def actor_oom(inc: int, ended: float = 30.0):
    return row("actor", 0, inc, "Failed", code=OOM, message=ACTOR_OOM, ended=ended)


def test_an_actor_out_of_memory_relaunches_it_with_half_the_micro_batch():
    rollout = row("rollout", 0, 2)
    p = run_plan([actor_oom(1), rollout], [proc(rollout)], prev=status("Running"), **SPEC)
    assert launched(p) == [("actor", 0, True, {MICRO_BATCH_ENV: "32"})]
    assert heal_events(p) == [
        (
            "Warning",
            "MicroBatchReduced",
            "actor micro batch 64 -> 32 after CUDA out of memory (algorithm.microBatchSize; "
            "2 passes a step, gradients accumulated: the same step)",
        )
    ]
    effective = RunStatus.model_validate(p.status).effective
    assert (effective.micro_batch_size, effective.spec_micro_batch_size, effective.reduced_after) == (
        32,
        64,
        {"actor-0": 1},
    )
    memory = cond(p, "MemoryFits")
    assert memory["status"] == "False"
    assert "relaunched with a smaller setting: actor micro batch 64 -> 32" in memory["message"]
    assert (
        "lower algorithm.microBatchSize (now 32)" in memory["message"]
    )  # the advice speaks of what runs now
    assert p.status["phase"] == "Recovering"


def test_the_choice_is_carried_and_a_later_relaunch_gets_it_without_a_second_event():
    rollout = row("rollout", 0, 2)
    first = run_plan([actor_oom(1), rollout], [proc(rollout)], prev=status("Running"), **SPEC)
    again = run_plan(
        [actor_oom(1), rollout], [proc(rollout)], prev=first.status, **SPEC
    )  # same inputs: same answer
    assert heal_events(again) == [] and again.status["effective"] == first.status["effective"]
    lost = row("actor", 0, 3, "Lost", ended=30)  # the healed actor was preempted later: not a memory failure
    later = run_plan(
        [actor_oom(1), rollout, row("actor", 0, 2, "Succeeded", ended=200), lost],
        [proc(rollout)],
        prev=first.status,
        **SPEC,
    )
    assert launched(later) == [("actor", 0, True, {MICRO_BATCH_ENV: "32"})]
    assert heal_events(later) == []


def test_a_pass_that_lost_its_status_write_decides_the_same_micro_batch():
    """The reconciler launched with the pass's choice and then lost the status write (a conflict, a crash):
    the next pass, from the old status, chooses the same value for the worker now running, and records it."""
    rollout, relaunched = row("rollout", 0, 2), row("actor", 0, 3)
    p = run_plan(
        [actor_oom(1), rollout, relaunched], [proc(rollout), proc(relaunched)], prev=status("Running"), **SPEC
    )
    assert p.status["effective"]["microBatchSize"] == 32 and launched(p) == []


@pytest.mark.parametrize(
    ("batch", "micro", "ranks", "lower"),
    [
        (64, 64, 1, 32),
        (64, 2, 1, 1),
        (24, 24, 1, 12),
        (24, 6, 1, 3),
        (48, 12, 1, 6),
        (36, 36, 1, 18),
        (36, 9, 1, 4),
        (64, 8, 4, 4),
        (64, 4, 4, None),
        (64, 1, 1, None),
        (12, 12, 2, 6),
        (12, 6, 2, 2),
    ],
)
def test_the_next_micro_batch_divides_the_batch_and_splits_over_the_ranks(batch, micro, ranks, lower):
    assert heal.smaller_micro_batch(micro, batch, ranks) == lower


def test_at_one_the_old_rule_applies_one_relaunch_then_failed_with_todays_message():
    rollout = row("rollout", 0, 2)
    rows = [actor_oom(1, ended=300)]
    prev = status("Running")
    for inc, micro in ((3, 32), (4, 16), (5, 8), (6, 4), (7, 2), (8, 1)):  # each relaunch ran out again
        p = run_plan(rows + [rollout], [proc(rollout)], prev=prev, backoff_seconds=0.0, **SPEC)
        assert launched(p) == [("actor", 0, True, {MICRO_BATCH_ENV: str(micro)})]
        assert heal_events(p)[0][2].startswith(f"actor micro batch {micro * 2} -> {micro} ")
        prev = p.status
        rows.append(actor_oom(inc, ended=300 - inc))
    p = run_plan(rows + [rollout], [proc(rollout)], prev=prev, backoff_seconds=0.0, **SPEC)
    assert launched(p) == [("actor", 0, True, {MICRO_BATCH_ENV: "1"})] and heal_events(p) == []
    assert "relaunched once, as a transient" in cond(p, "MemoryFits")["message"]
    rows.append(actor_oom(9, ended=1))
    failed = run_plan(rows + [rollout], [proc(rollout)], prev=p.status, backoff_seconds=0.0, **SPEC)
    assert failed.status["phase"] == "Failed" and launched(failed) == []
    message = cond(failed, "Failed")["message"]
    assert cond(failed, "Failed")["reason"] == "OutOfMemory"
    assert message.startswith("actor-0 #9 ran out of GPU memory: tried to allocate 9.00 GiB")
    assert "2 times with this spec, so it will not fit as it is" in message
    assert "microBatchSize" not in message  # none smaller is left: the advice names what changes the step
    assert "lower algorithm.batchSize" in message and "model.gradientCheckpointing: true" in message
    assert failed.status["effective"]["microBatchSize"] == 1


def test_no_restart_left_fails_as_before_without_choosing():
    rollout = row("rollout", 0, 2)
    p = run_plan([actor_oom(1), rollout], [proc(rollout)], prev=status("Running"), max_restarts=0, **SPEC)
    assert p.status["phase"] == "Failed" and "effective" not in p.status and heal_events(p) == []


def test_a_rollout_out_of_memory_halves_the_rollouts_share_of_the_gpu():
    actor = row("actor", 0, 1, step=5)
    oom = row("rollout", 0, 2, "Failed", code=OOM, message=ROLLOUT_OOM, ended=30)
    p = run_plan(
        [actor, oom], [proc(actor)], prev=status("Running"), colocate=True, rollout_share=0.3, **SPEC
    )
    assert launched(p) == [("rollout", 0, True, {ROLLOUT_SHARE_ENV: "0.15"})]
    assert heal_events(p) == [
        (
            "Warning",
            "RolloutShareReduced",
            "rollout-0 GPU share 0.3 -> 0.15 after CUDA out of memory (rollout.gpuMemoryUtilization: "
            "fewer rows decoded at once, the same step)",
        )
    ]
    assert p.status["effective"]["rolloutGpuMemoryUtilization"] == 0.15
    assert "raise rollout.gpuMemoryUtilization (now 0.15)" in cond(p, "MemoryFits")["message"]


def test_a_rollout_share_stops_halving_at_its_floor_and_then_fails_as_before():
    actor = row("actor", 0, 1, step=5)
    rows = [actor, row("rollout", 0, 2, "Failed", code=OOM, message=ROLLOUT_OOM, ended=100)]
    prev = status("Running")
    for inc in (3, 4, 5):  # 0.3 -> 0.15 -> 0.075; 0.0375 would be below the floor: one relaunch at 0.075
        p = run_plan(rows, [proc(actor)], prev=prev, rollout_share=0.3, backoff_seconds=0.0, **SPEC)
        assert [a.role for a in p.actions if isinstance(a, Launch)] == ["rollout"]
        prev = p.status
        rows.append(row("rollout", 0, inc, "Failed", code=OOM, message=ROLLOUT_OOM, ended=100 - inc))
    assert prev["effective"]["rolloutGpuMemoryUtilization"] == 0.075
    p = run_plan(rows, [proc(actor)], prev=prev, rollout_share=0.3, backoff_seconds=0.0, **SPEC)
    assert p.status["phase"] == "Failed" and cond(p, "Failed")["reason"] == "OutOfMemory"


def test_a_rollout_without_a_share_is_not_given_one():
    """Without rollout.gpuMemoryUtilization there is no share to lower: advice only, the old rule."""
    actor = row("actor", 0, 1, step=5)
    oom = row("rollout", 0, 2, "Failed", code=OOM, message=ROLLOUT_OOM, ended=30)
    p = run_plan([actor, oom], [proc(actor)], prev=status("Running"), **SPEC)
    assert launched(p) == [("rollout", 0, True, {})] and "effective" not in p.status


def test_a_spec_that_changed_the_micro_batch_drops_the_choice():
    """The user applied another microBatchSize: theirs runs, not what the controller chose from the old
    one."""
    prev = status(
        "Running", effective={"microBatchSize": 32, "specMicroBatchSize": 64, "reducedAfter": {"actor-0": 1}}
    )
    kept = heal.carried(prev["effective"], Desired(name="r", batch_size=64, micro_batch_size=64))
    assert kept.micro_batch_size == 32
    dropped = heal.carried(prev["effective"], Desired(name="r", batch_size=64, micro_batch_size=16))
    assert (
        dropped.micro_batch_size is None
        and heal.micro_batch(dropped, Desired(name="r", micro_batch_size=16)) == 16
    )


def test_a_micro_batch_fitted_before_launch_is_the_first_launchs_with_one_event():
    """mortalctl apply estimated that 64 a pass does not fit (desired.fitted_micro_batch, from its
    annotation): the actor's first launch trains with 16, status.effective says so, one Normal event says
    why."""
    p = run_plan([], prev={}, fitted_micro_batch=16, **SPEC)
    assert [(role, env) for role, _, _, env in launched(p)] == [
        ("actor", {MICRO_BATCH_ENV: "16"}),
        ("rollout", {}),
    ]
    assert [(kind, reason) for kind, reason, _ in heal_events(p)] == [("Normal", "MicroBatchReduced")]
    assert heal_events(p)[0][2].startswith(
        "actor micro batch 64 -> 16 before launch: mortalctl apply's estimate"
    )
    assert p.status["effective"]["microBatchSize"] == 16
    again = run_plan([row("actor", 0, 1), row("rollout", 0, 2)], prev=p.status, fitted_micro_batch=16, **SPEC)
    assert heal_events(again) == []
    live = [row("actor", 0, 1), row("rollout", 0, 2)]
    running_before = run_plan(
        live, [proc(w) for w in live], prev=status("Running"), fitted_micro_batch=16, **SPEC
    )  # an actor launched without it runs on: not yet
    assert "effective" not in running_before.status
    rows = [actor_oom(1), row("rollout", 0, 2)]  # the estimate was low: the heal goes on from 16
    healed = run_plan(rows, [proc(rows[1])], prev=p.status, fitted_micro_batch=16, **SPEC)
    assert launched(healed) == [("actor", 0, True, {MICRO_BATCH_ENV: "8"})]


@pytest.mark.parametrize("fitted", [64, 0, 24, 128])
def test_a_fitted_micro_batch_that_is_no_smaller_or_does_not_divide_the_batch_is_ignored(fitted):
    p = run_plan([], prev={}, fitted_micro_batch=fitted, **SPEC)
    assert "effective" not in p.status and heal_events(p) == []


def test_a_loss_normalised_per_pass_is_not_split_for_the_user():
    """bnpo divides each pass's loss by its own tokens: a smaller micro batch would change the step, so the
    operator leaves it to the user (the old rule and the advice), before launch and after an out-of-memory."""
    rollout = row("rollout", 0, 2)
    p = run_plan([actor_oom(1), rollout], [proc(rollout)], prev=status("Running"), loss_type="bnpo", **SPEC)
    assert launched(p) == [("actor", 0, True, {})] and "effective" not in p.status and heal_events(p) == []
    assert "a second out-of-memory fails the run" in cond(p, "MemoryFits")["message"]
    fitted = run_plan([], prev={}, fitted_micro_batch=16, loss_type="bnpo", **SPEC)
    assert "effective" not in fitted.status
