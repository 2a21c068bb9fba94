"""mortal.specs.memory: the controller's memory choices reach a worker's spec through MORTAL_* variables,
checked as the spec's own fields are; without them the spec is the user's, untouched."""

from __future__ import annotations

import pytest

from mortal.specs import RunStatus, TrainingRun
from mortal.specs.memory import (
    MICRO_BATCH_ENV,
    ROLLOUT_SHARE_ENV,
    BadMemorySetting,
    applied,
    environ,
)
from mortal.specs.status import EffectiveMemory


def run(**algorithm) -> TrainingRun:
    return TrainingRun.model_validate(
        {
            "metadata": {"name": "m"},
            "spec": {
                "model": {"name": "x"},
                "algorithm": {"numGenerations": 4, "batchSize": 64, **algorithm},
                "rollout": {"gpu": "H100", "colocate": True, "gpuMemoryUtilization": 0.3},
                "actor": {"gpu": "H100"},
            },
        }
    )


def test_without_variables_the_spec_is_the_users():
    original = run()
    assert applied(original, {}) is original


def test_the_variables_replace_the_micro_batch_and_the_share():
    chosen = applied(run(), {MICRO_BATCH_ENV: "16", ROLLOUT_SHARE_ENV: "0.15"}).spec
    assert (chosen.algorithm.micro_batch_size, chosen.algorithm.accumulation_steps) == (16, 4)
    assert chosen.rollout.gpu_memory_utilization == 0.15


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({MICRO_BATCH_ENV: "sixteen"}, "is not an integer"),
        ({MICRO_BATCH_ENV: "24"}, "must divide algorithm.batchSize (64)"),
        ({MICRO_BATCH_ENV: "0"}, "must divide"),
        ({ROLLOUT_SHARE_ENV: "1.5"}, "must be in (0, 1)"),
        ({ROLLOUT_SHARE_ENV: "half"}, "is not a number"),
    ],
)
def test_a_value_that_does_not_fit_the_spec_is_refused_naming_the_variable(env, words):
    with pytest.raises(BadMemorySetting) as refused:
        applied(run(), env)
    assert next(iter(env)) in str(refused.value) and words in str(refused.value)


def test_each_role_gets_only_its_own_choice_and_the_status_block_round_trips():
    chosen = EffectiveMemory(micro_batch_size=32, rollout_gpu_memory_utilization=0.15)
    assert environ(chosen, "actor") == {MICRO_BATCH_ENV: "32"}
    assert environ(chosen, "rollout") == {ROLLOUT_SHARE_ENV: "0.15"}
    assert environ(None, "actor") == {}
    block = {
        "phase": "Running",
        "effective": chosen.model_dump(by_alias=True, mode="json", exclude_none=True),
    }
    assert RunStatus.model_validate(block).effective == chosen
