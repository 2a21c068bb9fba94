"""What made a checkpoint: the dataset's fingerprint follows the rows, the reward hash
follows the code, and the data position is the schedule's own (the prompt a resumed step
draws first is the one at that position)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mortal.workers import schedule
from mortal.workers.actor.provenance import Provenance, data_position, dataset_fingerprint, reward_hashes

ROWS = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(10)]
SPEC = {"name": "data.jsonl", "split": "train", "promptColumn": "prompt"}


def test_the_dataset_fingerprint_changes_with_any_row_and_with_their_order_but_not_with_key_order() -> None:
    base = dataset_fingerprint(SPEC, ROWS)
    assert base.rows == 10 and base.name == "data.jsonl" and base.spec == SPEC
    assert dataset_fingerprint(SPEC, [dict(reversed(list(r.items()))) for r in ROWS]).sha256 == base.sha256
    edited = [*ROWS[:3], {**ROWS[3], "answer": "5"}, *ROWS[4:]]
    assert dataset_fingerprint(SPEC, edited).sha256 != base.sha256
    assert dataset_fingerprint(SPEC, ROWS[::-1]).sha256 != base.sha256
    assert dataset_fingerprint(SPEC, ROWS[:9]).sha256 != base.sha256


@pytest.fixture
def reward_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(tmp_path))
    module = tmp_path / "prov_rewards_mod.py"
    module.write_text("def score(completions, **kw):\n    return [1.0 for _ in completions]\n")
    yield module
    sys.modules.pop("prov_rewards_mod", None)


def test_a_reward_hash_follows_its_module_source_and_its_spec_entry_without_importing_it(
    reward_module: Path,
) -> None:
    entry = {"function": "prov_rewards_mod:score", "weight": 1.0}
    first = reward_hashes([entry], ["score"])
    assert "prov_rewards_mod" not in sys.modules  # found by importlib's finder, read as a file
    assert reward_hashes([entry], ["score"]) == first
    assert reward_hashes([{**entry, "weight": 0.5}], ["score"]) != first
    reward_module.write_text("def score(completions, **kw):\n    return [0.0 for _ in completions]\n")
    assert reward_hashes([entry], ["score"]) != first


def test_a_builtin_env_hashes_with_mortals_module_of_it_and_a_missing_module_with_its_entry_alone() -> None:
    env = reward_hashes([{"env": "math-answer"}], ["m"])["m"]
    assert env != reward_hashes([{"env": "no-such-env"}], ["m"])["m"]
    missing = {"function": "no_such_package.sub:f"}
    assert reward_hashes([missing], ["f"]) == reward_hashes([missing], ["f"])


@pytest.mark.parametrize(
    ("step", "pps", "rows", "epoch", "index"),
    [
        (0, 4, 10, 0, 0),
        (2, 4, 10, 0, 8),
        (3, 4, 10, 1, 2),
        (5, 2, 10, 1, 0),
        (7, 3, 5, 4, 1),
    ],
)
def test_the_data_position_is_where_the_schedule_draws_the_next_steps_first_prompt(
    step, pps, rows, epoch, index
):
    position = data_position(step, pps, seed=7, rows=rows)
    assert (position.consumed, position.epoch, position.index) == (step * pps, epoch, index)
    first_of_next = schedule.prompt_slots(7, step, pps, rows)[0]
    assert first_of_next == schedule.epoch_order(7, epoch, rows)[index]


def test_a_record_round_trips_through_its_stored_camel_case_json() -> None:
    made = Provenance.of(3, {"a": "1" * 64}, dataset_fingerprint(SPEC, ROWS)).at(4, 2, 0)
    stored = made.dump()
    assert {"specGeneration", "rewardCode", "rewards", "dataset", "position"} <= set(stored)
    assert stored["position"] == {
        "step": 4,
        "promptsPerStep": 2,
        "seed": 0,
        "consumed": 8,
        "epoch": 0,
        "index": 8,
    }
    assert Provenance.read(stored) == made and Provenance.read(None) is None
