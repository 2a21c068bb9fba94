"""Each step the actor records a bounded sample of its completions, as a user reads them afterwards.

The real actor and rollout loop on a tiny model (tests/workers/actor_helpers.py), two steps; the
recorded rows are checked against what the rollout answered and what TRL trained on.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from actor_helpers import actor_spec, create_run, run_actor_with_rollout
from rollout_helpers import assets_available, make_tiny_model

from mortal.workers.actor.samples import as_text
from mortal.workers.messages import RolloutAnswer, RolloutTask
from mortal.workers.runtime import EXIT_SUCCEEDED

pytestmark = pytest.mark.skipif(not assets_available(), reason="SmolLM2 assets missing")

REWARDS = [
    {"function": "actor_helpers:parity_reward"},
    {"function": "reward_fixtures:logs_things", "weight": 0.5},  # scores 0.0, log_extra("my_column", "x")
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("completions") / "model")


def _answered(store, run: str, step: int) -> list[tuple[str, str]]:
    """(prompt, completion) of every completion the rollout answered for optimizer step `step`, in batch
    order (its tasks carry the step count before it: 0 for the first)."""
    out = []
    for task in store.step_results(run, step - 1):
        requests = RolloutTask.model_validate(task.payload).requests
        for request, result in zip(requests, RolloutAnswer.model_validate(task.result).results, strict=True):
            out += [(as_text(request.prompt), as_text(c)) for c in result.completions]
    return out


def test_each_step_records_its_first_completions_with_rewards_advantages_and_log_extra(
    sqlite_store, tiny_dir: Path
) -> None:
    store = sqlite_store
    spec = actor_spec(
        str(tiny_dir), algorithm={"maxSteps": 2}, logging={"completionsPerStep": 6}, rewards=REWARDS
    )
    run = create_run(store, "samples", spec)
    assert run_actor_with_rollout(store, run) == EXIT_SUCCEEDED

    assert store.completion_steps("samples") == [1, 2]
    for step in (1, 2):
        rows = store.list_completions("samples", step=step)
        assert [r.sample for r in rows] == list(range(6)), (
            "the first 6 of 8: one whole group and half of the next"
        )
        assert [(r.prompt, r.completion) for r in rows] == _answered(store, "samples", step)[:6]
        for r in rows:
            assert r.rewards.keys() == {"parity_reward", "logs_things"} and r.rewards["logs_things"] == 0.0
            assert r.reward == r.rewards["parity_reward"]  # + 0.5 x 0.0
            assert r.extra == {"my_column": "x"}
            assert r.weight_version == step - 1  # on-policy: trained on the weights of the step before
        group = rows[:4]  # the advantages TRL trained on: each reward against its group's mean
        mean = sum(r.reward for r in group) / 4
        assert sum(r.advantage for r in group) == pytest.approx(0.0, abs=1e-4)
        for r in group:
            assert (
                r.advantage == pytest.approx(0.0, abs=1e-6)
                if r.reward == mean
                else (r.advantage > 0) == (r.reward > mean)
            )
