"""What `apply` writes over a live run (mortal.specs.three_way_merge): kubectl apply's three-way merge.

The fields the document sets win; a field the previous document set and this one dropped goes back to
its default; every other field keeps the live value (a scale, a suspend). Lists are replaced whole.
"""

from __future__ import annotations

import pytest
from test_spec_loader import DOC

from mortal.specs import SpecError, TrainingRun, load_text
from mortal.specs.three_way_merge import merge_applied

# (live, last_applied, config, normalized) -> merged
CASES = {
    "the document's value wins over the live one": (
        {"replicas": 3},
        {"replicas": 2},
        {"replicas": 2},
        {"replicas": 2},
        {"replicas": 2},
    ),
    "a field no document set keeps its live value": (
        {"replicas": 3, "suspend": True},
        {"model": "m"},
        {"model": "m"},
        {"model": "m", "replicas": 1, "suspend": False},
        {"model": "m", "replicas": 3, "suspend": True},
    ),
    "a field the previous document set and this one dropped goes back to its default": (
        {"model": "m", "replicas": 4},
        {"model": "m", "replicas": 4},
        {"model": "m"},
        {"model": "m", "replicas": 1},
        {"model": "m", "replicas": 1},
    ),
    "a mapping the document sets part of merges below it": (
        {"rollout": {"gpu": "a100", "replicas": 3, "engine": "vllm"}},
        {"rollout": {"gpu": "a100"}},
        {"rollout": {"engine": "transformers"}},
        {"rollout": {"gpu": "none", "replicas": 1, "engine": "transformers"}},
        {"rollout": {"gpu": "none", "replicas": 3, "engine": "transformers"}},
    ),
    "a mapping dropped whole resets only the fields the previous document set in it": (
        {"rollout": {"gpu": "a100", "replicas": 3}},
        {"rollout": {"gpu": "a100"}},
        {},
        {"rollout": {"gpu": "none", "replicas": 1}},
        {"rollout": {"gpu": "none", "replicas": 3}},
    ),
    "a list is replaced whole": (
        {"rewards": [{"f": "a"}, {"f": "b"}]},
        {"rewards": [{"f": "a"}, {"f": "b"}]},
        {"rewards": [{"f": "c"}]},
        {"rewards": [{"f": "c"}]},
        {"rewards": [{"f": "c"}]},
    ),
    "without a last apply (a forked run) every field the document leaves out is kept": (
        {"model": "m", "replicas": 4},
        None,
        {},
        {"model": "default", "replicas": 1},
        {"model": "m", "replicas": 4},
    ),
    "a live key the normal form lacks is an earlier document's, and is dropped": (
        {"env": {"A": "1", "B": "2"}, "old": 1},
        {"env": {"A": "1", "B": "2"}},
        {"env": {"A": "1"}},
        {"env": {"A": "1"}},
        {"env": {"A": "1"}},
    ),
    "a field new to the schema takes its default": (
        {"model": "m"},
        {"model": "m"},
        {"model": "m"},
        {"model": "m", "logging": {"level": "info"}},
        {"model": "m", "logging": {"level": "info"}},
    ),
}


@pytest.mark.parametrize(("live", "last", "config", "normalized", "merged"), CASES.values(), ids=CASES.keys())
def test_merge(live, last, config, normalized, merged) -> None:
    assert merge_applied(live, last, config, normalized) == merged


def run_of(text: str) -> TrainingRun:
    [run] = load_text(text, "run.yaml")
    return run


def test_a_scaled_and_suspended_run_stays_so_when_the_file_that_made_it_is_applied_again() -> None:
    file = run_of(DOC.format(name="r"))
    live = file.spec_dict()
    live["rollout"]["replicas"] += 2
    live["suspend"] = True
    assert file.applied_spec(live, file.applied_config()) == live


def test_the_fields_a_file_sets_are_what_it_wrote_not_its_defaults() -> None:
    config = run_of(DOC.format(name="r")).applied_config()
    assert "suspend" not in config and "limits" not in config
    assert config["model"]["name"] == "tiny"


def test_a_kept_field_that_no_longer_fits_the_document_is_refused_naming_it() -> None:
    """A forked run (no last apply) keeps batchSize; a file that changes only numGenerations must name the
    rule the two break together, not write an invalid spec."""
    file = run_of(DOC.format(name="r") + "  algorithm: {numGenerations: 4, batchSize: 12}\n")
    live = file.spec_dict()
    other = run_of(DOC.format(name="r") + "  algorithm: {numGenerations: 8}\n")
    with pytest.raises(SpecError) as refused:
        other.applied_spec(live, None)
    [issue] = refused.value.issues
    assert "divisible by numGenerations" in issue.message and "fields kept from its live spec" in issue.source
