"""MORTAL_PROFILE_STEPS: which optimizer steps the actor profiles, and that only those are in the profile.
A sharded actor's two ranks writing theirs is in test_actor_sharded.py (the micro-batch test)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mortal.workers.actor.step_profile import STEPS_ENV, StepProfile, from_environment, parse_steps
from mortal.workers.errors import FatalWorkerError


@pytest.mark.parametrize("text, steps", [("4", (4, 4)), ("4-5", (4, 5)), (" 2-2 ", (2, 2))])
def test_steps_are_one_or_a_range_counted_from_one(text: str, steps: tuple[int, int]) -> None:
    assert parse_steps(text) == steps


@pytest.mark.parametrize("text", ["0", "5-4", "four", "3-", "-1"])
def test_a_bad_value_is_fatal_and_names_the_variable(text: str) -> None:
    with pytest.raises(FatalWorkerError, match=f"{STEPS_ENV}=.*counting from 1"):
        parse_steps(text)


def test_no_variable_no_profiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(STEPS_ENV, raising=False)
    assert from_environment(tmp_path, 0) == []
    monkeypatch.setenv(STEPS_ENV, "2-3")
    [profile] = from_environment(tmp_path, 1)
    assert (profile.rank, profile.first, profile.last) == (1, 2, 3)


def test_only_the_asked_steps_are_profiled(tmp_path: Path) -> None:
    """Steps 2-3 of 4, as the Trainer calls the callback: step 1 and 4 run an op steps 2-3 never run."""
    profile = StepProfile(tmp_path, 0, 2, 3)
    state = SimpleNamespace(global_step=0)
    a = torch.randn(16, 16)
    for step in range(1, 5):
        profile.on_step_begin(None, state, None)
        if step in (2, 3):
            torch.cumsum(a, 0)
        else:
            torch.flip(a, [0])
        state.global_step = step
        profile.on_step_end(None, state, None)
    table = (tmp_path / "profile-actor-rank0-steps2-3.txt").read_text()
    assert "aten::cumsum" in table and "aten::flip" not in table
    with gzip.open(tmp_path / "profile-actor-rank0-steps2-3.json.gz") as trace:
        names = {event.get("name") for event in json.load(trace)["traceEvents"]}
    assert "aten::cumsum" in names and "aten::flip" not in names
    assert not (tmp_path / "profile-actor-rank0-steps2-3.json").exists()  # only the packed timeline is kept
