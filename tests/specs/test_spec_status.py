"""The run lifecycle: phases, their legal transitions, and the status block."""

from __future__ import annotations

import pytest

from mortal.specs import TRANSITIONS, Condition, Phase, RunStatus


def test_every_phase_has_a_transition_entry():
    assert set(TRANSITIONS) == set(Phase)
    assert all(nxt <= set(Phase) for nxt in TRANSITIONS.values())


@pytest.mark.parametrize("phase", list(Phase))
def test_only_succeeded_and_failed_are_terminal(phase):
    assert phase.is_terminal() == (phase in {Phase.SUCCEEDED, Phase.FAILED})


def test_terminal_phases_have_no_way_out():
    assert not Phase.SUCCEEDED.can_become("Running") and not Phase.FAILED.can_become(Phase.PENDING)


@pytest.mark.parametrize(
    ("start", "to"),
    [
        ("Pending", "Starting"),
        ("Starting", "Running"),
        ("Running", "Recovering"),
        ("Recovering", "Running"),
        ("Running", "Suspended"),
        ("Suspended", "Starting"),
        ("Running", "Succeeded"),
        ("Recovering", "Failed"),
    ],
)
def test_the_lifecycle_moves_are_legal(start, to):
    assert Phase(start).can_become(to)


@pytest.mark.parametrize(
    ("start", "to"), [("Pending", "Running"), ("Pending", "Succeeded"), ("Suspended", "Running")]
)
def test_skipping_a_phase_is_not(start, to):
    assert not Phase(start).can_become(to)


def test_staying_in_a_phase_is_always_allowed():
    assert all(p.can_become(p) for p in Phase)


def test_every_non_terminal_phase_can_fail_and_every_phase_is_reachable_from_pending():
    assert all(Phase.FAILED in TRANSITIONS[p] for p in Phase if not p.is_terminal())
    seen, todo = {Phase.PENDING}, [Phase.PENDING]
    while todo:
        for nxt in TRANSITIONS[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    assert seen == set(Phase)


def test_status_round_trips_through_its_camel_case_dict():
    status = RunStatus(
        phase="Recovering",
        step=4,
        restarts=1,
        last_checkpoint={"step": 4, "path": "/ckpt/4", "time": "2025-01-31T12:00:00Z"},
        conditions=[Condition(type="WorkersReady", status="False", reason="WorkerLost")],
    )
    dumped = status.model_dump(by_alias=True, mode="json")
    assert dumped["lastCheckpoint"]["path"] == "/ckpt/4" and dumped["phase"] == "Recovering"
    assert RunStatus.model_validate(dumped) == status


def test_condition_status_is_true_false_or_unknown():
    with pytest.raises(ValueError):
        Condition(type="Ready", status="yes")


def test_counters_not_seen_yet_may_be_written_as_null():
    status = RunStatus.model_validate({"phase": "Starting", "step": None, "weightVersion": None})
    assert (status.step, status.weight_version) == (0, 0)
