"""A fork's document: overrides merged over the parent's spec (merge patch, --set), their errors, and
what a checkpoint cannot carry over (specs/fork.py)."""

from __future__ import annotations

import pytest

from mortal.specs import SpecError, TrainingRun
from mortal.specs.fork import carry_over_problems, forked_document, load_fragment, merge_patch

PARENT = TrainingRun.model_validate(
    {
        "metadata": {"name": "parent", "labels": {"team": "rl"}},
        "spec": {
            "model": {"name": "tiny", "lora": {"r": 8}},
            "dataset": {"name": "builtin:arith"},
            "rewards": [{"function": "m:a"}, {"function": "m:b", "weight": 0.5}],
            "algorithm": {"maxSteps": 30, "learningRate": 1e-5},
        },
    }
).to_dict(include_status=False)


def fork(*sets: str, fragment=None, source="<overrides>", lines=None) -> TrainingRun:
    return forked_document(PARENT, "child", fragment, list(sets), source, lines)


def issue(err: pytest.ExceptionInfo[SpecError]) -> str:
    assert len(err.value.issues) == 1, err.value.issues
    return str(err.value.issues[0])


def test_merge_patch_merges_mappings_replaces_the_rest_and_null_removes() -> None:
    target = {"a": {"b": 1, "c": [1, 2]}, "d": 1}
    assert merge_patch(target, {"a": {"c": [3], "e": 2}, "d": None}) == {"a": {"b": 1, "c": [3], "e": 2}}
    assert target == {"a": {"b": 1, "c": [1, 2]}, "d": 1}  # untouched


def test_no_overrides_keep_the_parents_spec_and_labels_under_the_new_name() -> None:
    child = fork()
    assert child.name == "child" and child.metadata.labels == {"team": "rl"}
    assert child.spec_dict() == TrainingRun.model_validate(PARENT).spec_dict()


def test_set_takes_camel_case_paths_list_indexes_and_yaml_values() -> None:
    child = fork(
        "spec.algorithm.learningRate=1e-6",
        "spec.rewards[1].weight=2",
        "spec.rewards.0.weight=0.25",
        "spec.rollout.replicas=3",
        "metadata.labels.arm=b",
    )
    assert child.spec.algorithm.learning_rate == 1e-6
    assert [r.weight for r in child.spec.rewards] == [0.25, 2.0]
    assert child.spec.rollout.replicas == 3 and child.metadata.labels == {"team": "rl", "arm": "b"}
    assert fork("spec.generation.topK=null", "spec.generation.topK=5").spec.generation.top_k == 5
    assert fork("spec.dataset.maxSamples=null").spec.dataset.max_samples is None


def test_a_fragment_merges_over_the_parent_and_set_applies_after_it() -> None:
    text = (
        "spec:\n  algorithm:\n    learningRate: 2.0e-6\n    beta: 0.1\nmetadata:\n  annotations: {why: lr}\n"
    )
    fragment, lines = load_fragment(text, "over.yaml")
    child = fork("spec.algorithm.beta=0.2", fragment=fragment, source="over.yaml", lines=lines)
    assert (child.spec.algorithm.learning_rate, child.spec.algorithm.beta) == (2e-6, 0.2)
    assert child.spec.algorithm.max_steps == 30 and child.metadata.annotations == {"why": "lr"}


@pytest.mark.parametrize(
    "assignment, expected",
    [
        (
            "spec.algorithm.learningRate=abc",
            "--set: spec.algorithm.learningRate: must be a number (got 'abc')",
        ),
        (
            "spec.algorithm.learningRat=1e-6",
            "--set: spec.algorithm.learningRat: unknown field; did you mean 'learningRate'?",
        ),
        ("spec.rollout.replicas=-1", "--set: spec.rollout.replicas: must be >= "),
        ("spec.algorithm.learningRate", "--set spec.algorithm.learningRate: expected PATH=VALUE"),
        (
            "algorithm.learningRate=1",
            "--set algorithm.learningRate=1: algorithm.learningRate: must start with spec.",
        ),
        ("metadata.name=other=1", "only metadata.labels.KEY and metadata.annotations.KEY can be set"),
        ("spec.rewards[5].weight=1", "spec.rewards[5]: no item 5 in a list of 2"),
        ("spec.algorithm.seed.x=1", "spec.algorithm.seed: is not a mapping or a list"),
    ],
)
def test_set_errors_name_the_path_and_the_value(assignment: str, expected: str) -> None:
    with pytest.raises(SpecError) as err:
        fork(assignment)
    assert expected in issue(err)


def test_fragment_errors_name_the_file_line_and_path() -> None:
    fragment, lines = load_fragment("spec:\n  algorithm:\n    numGeneration: 4\n", "over.yaml")
    with pytest.raises(SpecError) as err:
        fork(fragment=fragment, source="over.yaml", lines=lines)
    assert (
        issue(err)
        == "over.yaml:3: spec.algorithm.numGeneration: unknown field; did you mean 'numGenerations'?"
    )
    fragment, lines = load_fragment("algorithm:\n  learningRate: 1\n", "bare.yaml")
    with pytest.raises(SpecError) as err:
        fork(fragment=fragment, source="bare.yaml", lines=lines)
    assert issue(err).startswith("bare.yaml:1: algorithm: an override is rooted at the document")


def test_what_a_checkpoint_cannot_carry_over() -> None:
    parent = TrainingRun.model_validate(PARENT).spec

    def problems(*sets: str) -> list[str]:
        return carry_over_problems(parent, fork(*sets).spec, step=20)

    assert (
        problems(
            "spec.algorithm.learningRate=1e-6",
            "spec.algorithm.seed=3",
            "spec.model.dtype=float32",
            "spec.model.lora.dropout=0.1",
            "spec.dataset.name=builtin:other",
        )
        == []
    )
    assert problems("spec.model.name=other")[0].startswith(
        "spec.model.name: the checkpoint holds weights of 'tiny'"
    )
    assert problems("spec.model.lora=null")[0].startswith(
        "spec.model.lora: the checkpoint holds LoRA adapters"
    )
    assert problems("spec.model.lora.r=16")[0].startswith("spec.model.lora.r: ")
    assert problems("spec.model.lora.alpha=8")[0].startswith("spec.model.lora.alpha: ")
    assert problems("spec.model.lora.targetModules=[q_proj]")[0].startswith("spec.model.lora.targetModules: ")
    assert problems("spec.backend=modal")[0].startswith("spec.backend: ")
    assert problems("spec.algorithm.maxSteps=20") == [
        "spec.algorithm.maxSteps: 20 leaves nothing to train after step 20; set it above 20"
    ]
    full = fork("spec.model.lora=null").spec
    assert carry_over_problems(full, fork().spec, step=20)[0].startswith(
        "spec.model.lora: the checkpoint holds full weights; LoRA cannot be turned on"
    )
