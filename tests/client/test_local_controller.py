"""The controller on this machine as the client sees it: woken per run, started on the client's store.

What the verbs and MortalTrainer.train() both call (mortal.client.local_controller); the start itself is
mortal.controller.manager's, replaced here by a recorder so no process is started.
"""

from __future__ import annotations

import pytest

import mortal.controller.manager as manager
from mortal.client.local_controller import ensure_controller, wake_controller
from mortal.controller.errors import ControllerStartFailed


@pytest.fixture
def outcomes():
    """What the next starts come to, in order: True (ready), False (still starting) or an error raised."""
    return []


@pytest.fixture
def starts(monkeypatch, mortal_home, outcomes):
    started = []

    def start(state_url=None, **kwargs):
        started.append(state_url)
        outcome = outcomes.pop(0) if outcomes else True
        if isinstance(outcome, Exception):
            raise outcome
        return manager.StartedController(4242, mortal_home / "controller.log", ready=outcome)

    monkeypatch.setattr(manager, "ensure_background_controller", start)
    monkeypatch.delenv("MORTAL_NO_CONTROLLER", raising=False)
    return started


def test_a_controller_is_started_on_the_clients_store_and_announced(starts, mortal_home, capsys):
    ensure_controller("sqlite:///elsewhere.db", disabled=False)
    assert starts == ["sqlite:///elsewhere.db"]
    assert (
        capsys.readouterr().err == f"controller started (pid 4242, log: {mortal_home / 'controller.log'})\n"
    )
    ensure_controller(None, disabled=False, announce=False)
    assert starts[-1] is None and capsys.readouterr().err == ""


def test_a_controller_still_starting_is_announced_as_such(starts, outcomes, mortal_home, capsys):
    outcomes.append(False)
    ensure_controller(None, disabled=False)
    assert capsys.readouterr().err == (
        f"controller still starting after {manager.START_TIMEOUT_SECONDS:g}s (pid 4242, log: "
        f"{mortal_home / 'controller.log'}); `mortalctl controller status` says whether it runs\n"
    )


def test_a_controller_that_died_starting_is_raised_even_unannounced(starts, outcomes, mortal_home, capsys):
    died = ControllerStartFailed(4242, 1, mortal_home / "controller.log", ["Traceback", "ImportError: x"])
    outcomes.append(died)
    with pytest.raises(ControllerStartFailed) as raised:
        ensure_controller(None, disabled=False, announce=False)
    assert raised.value is died and capsys.readouterr().err == ""


@pytest.mark.parametrize("flag, env", [(True, None), (False, "1"), (False, "true")])
def test_no_controller_is_started_when_the_user_said_not_to(starts, monkeypatch, flag, env):
    if env is not None:
        monkeypatch.setenv("MORTAL_NO_CONTROLLER", env)
    ensure_controller(None, disabled=flag)
    assert starts == []


def test_waking_names_each_run_or_all_of_them(mortal_home):
    wake_controller("a", "b")
    wake_controller()
    assert sorted(p.name for p in (mortal_home / "wake").iterdir()) == ["a", "all", "b"]
