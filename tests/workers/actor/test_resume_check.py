"""Verified resume, table-tested on hand-made facts: what is refused (it would silently redo or skip work),
what goes on with a warning (a change made on purpose), and what passes quietly. The end-to-end cases, on a
real actor and real checkpoint files, are in test_resume_verified.py."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mortal.workers.actor.provenance import Provenance, dataset_fingerprint
from mortal.workers.actor.resume_check import REFUSED, CheckpointFacts, judge, refusal_message

ROWS = [{"prompt": f"q{i}"} for i in range(8)]
SPEC = {"name": "data.jsonl", "split": "train", "promptColumn": "prompt"}
STEP = 4


def made(rows=ROWS, spec=SPEC, rewards=None, generation=1, pps=2, seed=0, step=STEP) -> Provenance:
    return Provenance.of(generation, rewards or {"r": "a" * 64}, dataset_fingerprint(spec, rows)).at(
        step, pps, seed
    )


FACTS = CheckpointFacts(
    path="/ckpt/step-4",
    marker_step=STEP,
    trainer_step=STEP,
    scheduler_step=STEP,
    optimizer_steps=frozenset({STEP}),
)


def reasons(findings) -> list[tuple[str, bool]]:
    return [(f.reason, f.refuse) for f in findings]


CASES = {
    "the same run resumes quietly": (FACTS, made(), made(), None, 100, []),
    "a later spec generation alone is no change": (FACTS, made(), made(generation=5), None, 100, []),
    "trainer_state.json of another step": (
        replace(FACTS, trainer_step=6),
        made(),
        made(),
        None,
        100,
        [(REFUSED, True)],
    ),
    "mortal.json of another step": (
        replace(FACTS, marker_step=2),
        made(),
        made(),
        None,
        100,
        [(REFUSED, True)],
    ),
    "the scheduler of another step": (
        replace(FACTS, scheduler_step=3),
        made(),
        made(),
        None,
        100,
        [(REFUSED, True)],
    ),
    "the optimizer's counters of another step": (
        replace(FACTS, optimizer_steps=frozenset({2})),
        made(),
        made(),
        None,
        100,
        [(REFUSED, True)],
    ),
    "an optimizer that never stepped": (
        replace(FACTS, optimizer_steps=frozenset(), optimizer_has_state=False),
        made(),
        made(),
        None,
        100,
        [(REFUSED, True)],
    ),
    "rows rewritten under the same spec.dataset": (
        FACTS,
        made(),
        made(rows=[*ROWS[:7], {"prompt": "other"}]),
        None,
        100,
        [(REFUSED, True)],
    ),
    "rows changed by a changed spec.dataset": (
        FACTS,
        made(),
        made(rows=ROWS[:6], spec={**SPEC, "maxSamples": 6}),
        None,
        100,
        [("DatasetChanged", False)],
    ),
    "a new seed": (FACTS, made(), made(seed=9), None, 100, [("DataOrderChanged", False)]),
    "a new batch": (FACTS, made(), made(pps=4), None, 100, [("DataOrderChanged", False)]),
    "reward code edited": (
        FACTS,
        made(),
        made(rewards={"r": "b" * 64}),
        None,
        100,
        [("RewardCodeChanged", False)],
    ),
    "a reward added": (
        FACTS,
        made(),
        made(rewards={"r": "a" * 64, "s": "c" * 64}),
        None,
        100,
        [("RewardCodeChanged", False)],
    ),
    "no provenance recorded": (FACTS, None, made(), None, 100, [("ProvenanceUnknown", False)]),
    "numEpochs used up, maxSteps raised past them": (FACTS, made(), made(), 1.0, 100, [(REFUSED, True)]),
    "numEpochs not used up": (FACTS, made(), made(), 2.0, 100, []),
    "used up exactly at maxSteps": (FACTS, made(), made(), 1.0, STEP, []),
}


@pytest.mark.parametrize(
    ("facts", "recorded", "now", "num_epochs", "max_steps", "expected"), CASES.values(), ids=CASES
)
def test_judge(facts, recorded, now, num_epochs, max_steps, expected) -> None:
    assert reasons(judge(STEP, facts, recorded, now, num_epochs, max_steps)) == expected


def test_a_refusal_names_the_checkpoint_what_differs_and_the_way_out() -> None:
    findings = judge(STEP, FACTS, made(), made(rows=ROWS[::-1]), None, 100)
    message = refusal_message(findings)
    assert "spec.dataset did not" in message and "8 rows" in message and "fork the run" in message
    step_message = refusal_message(judge(STEP, replace(FACTS, trainer_step=6), made(), made(), None, 100))
    assert "/ckpt/step-4" in step_message and "trainer_state.json global_step says 6" in step_message
    used_up = refusal_message(judge(STEP, FACTS, made(), made(), 1.0, 100))
    assert "numEpochs 1 x 8 rows" in used_up and "lower maxSteps to 4" in used_up


def test_the_steps_a_file_does_not_state_are_not_held_against_it() -> None:
    silent = CheckpointFacts(path="/c", marker_step=None, trainer_step=None, scheduler_step=None)
    assert judge(STEP, silent, made(), made(), None, 100) == []


def test_a_checkpoint_of_another_actor_count_resumes_with_a_warning_that_it_is_not_bit_for_bit() -> None:
    sharded = replace(FACTS, ranks=2)
    assert judge(STEP, sharded, made(), made(), None, 100, actor_count=2) == []
    assert judge(STEP, FACTS, made(), made(), None, 100, actor_count=1) == []  # an unsharded actor's: 1 rank
    [fewer] = judge(STEP, sharded, made(), made(), None, 100, actor_count=1)
    [more] = judge(STEP, FACTS, made(), made(), None, 100, actor_count=2)
    assert not fewer.refuse and not more.refuse and fewer.reason == more.reason == "ActorCountChanged"
    assert "written by an actor of 2 rank(s) and this one has actor.count 1" in fewer.message
    assert "RNG states" in more.message and "not bit for bit" in more.message
