"""spec.logging.completionsPerStep: how many of a step's completions the actor records (0: none)."""

from __future__ import annotations

import pytest

from mortal.specs import SpecError, json_schema, load_text

DOC = """\
apiVersion: mortal/v1
kind: TrainingRun
metadata:
  name: demo
spec:
  model: {name: tiny}
  dataset: {name: builtin:arith}
  rewards:
    - function: my_rewards:score
"""


def test_sixty_four_by_default_any_count_from_zero_when_written() -> None:
    [run] = load_text(DOC)
    assert run.spec.logging.completions_per_step == 64
    [none] = load_text(DOC + "  logging: {completionsPerStep: 0}\n")
    assert none.spec.logging.completions_per_step == 0
    assert none.spec_dict()["logging"]["completionsPerStep"] == 0


def test_a_negative_count_is_refused_at_its_line() -> None:
    with pytest.raises(SpecError) as caught:
        load_text(DOC + "  logging:\n    completionsPerStep: -1\n", source="run.yaml")
    assert (
        str(caught.value.issues[0]) == "run.yaml:11: spec.logging.completionsPerStep: must be >= 0 (got -1)"
    )


def test_the_schema_says_what_it_does() -> None:
    logging = json_schema()["$defs"]["LoggingSpec"]["properties"]["completionsPerStep"]
    assert logging["default"] == 64 and "get completions" in logging["description"]
