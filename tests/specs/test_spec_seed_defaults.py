"""The seeds' forms of a TrainingRun: a spec that names only its model trains with sandboxed code
execution on the built-in coding set, `numEpochs` becomes `maxSteps` when the spec is read, and the
seeds' weight-sync names are stored as the method they are here, with a note saying so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mortal.specs import SpecError, load_text

HEAD = """\
apiVersion: mortal/v1
kind: TrainingRun
metadata:
  name: seed
spec:
  model: {name: Qwen/Qwen2.5-0.5B-Instruct}
"""


def only_run(text: str):
    [run] = load_text(text, source="run.yaml")
    return run


def test_a_spec_with_only_a_model_trains_code_execution_on_the_builtin_coding_set() -> None:
    spec = only_run(HEAD).spec_dict()
    assert spec["dataset"]["name"] == "builtin:mbpp-mini" and spec["dataset"]["systemPrompt"]
    assert [(r["env"], r["weight"]) for r in spec["rewards"]] == [("code-execution", 1.0)]
    assert spec["algorithm"]["maxSteps"] == 100


def test_num_epochs_sets_max_steps_from_the_datasets_rows_and_says_so() -> None:
    run = only_run(HEAD + "  algorithm: {numEpochs: 2, batchSize: 8, numGenerations: 4}\n")
    assert run.spec.algorithm.max_steps == 51  # 2 x 51 rows of builtin:mbpp-mini / 2 prompts per step
    assert run.spec_dict()["algorithm"]["numEpochs"] == 2
    [note] = run.spec.notes()
    assert note.startswith("spec.algorithm.maxSteps: 51, from numEpochs 2 over 51 rows of builtin:mbpp-mini")


def test_num_epochs_counts_a_local_file_after_max_samples(tmp_path: Path) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(10)) + "\n")
    text = (
        HEAD + f"  dataset: {{name: {data}, maxSamples: 7}}\n  rewards: [{{function: m:f}}]\n"
        "  algorithm: {numEpochs: 1.5, batchSize: 8, numGenerations: 4}\n"
    )
    assert only_run(text).spec.algorithm.max_steps == 6  # ceil(1.5 x 7 / 2)


def test_max_steps_given_wins_over_num_epochs() -> None:
    run = only_run(HEAD + "  algorithm: {numEpochs: 2, maxSteps: 3}\n")
    assert run.spec.algorithm.max_steps == 3 and run.spec.notes() == []


@pytest.mark.parametrize(
    ("dataset", "fragment"),
    [
        ("openai/gsm8k", "hub dataset"),
        ("/nowhere/rows.jsonl", "is not here to count its rows"),
        ("builtin:nope", "no built-in dataset 'builtin:nope'"),
    ],
)
def test_num_epochs_over_a_dataset_it_cannot_count_names_the_line_and_asks_for_max_steps(
    dataset, fragment
) -> None:
    text = (
        HEAD + f"  dataset: {{name: '{dataset}'}}\n  rewards: [{{function: m:f}}]\n"
        "  algorithm:\n    numEpochs: 1\n"
    )
    with pytest.raises(SpecError) as caught:
        load_text(text, source="run.yaml")
    [issue] = caught.value.issues
    assert (issue.source, issue.line, issue.path) == ("run.yaml", 10, "spec.algorithm.numEpochs")
    assert fragment in issue.message


@pytest.mark.parametrize(("seed_name", "stored"), [("reload", "volume"), ("checkpoint", "volume")])
def test_the_seeds_sync_names_are_stored_as_the_method_they_are(seed_name, stored) -> None:
    run = only_run(HEAD + f"  sync: {{method: {seed_name}}}\n")
    assert run.spec_dict()["sync"]["method"] == stored
    [note] = run.spec.notes()
    assert note.startswith(f"spec.sync.method: {seed_name!r} is stored as {stored!r}: {seed_name}")


def test_direct_is_ipc_and_where_ipc_cannot_work_the_error_says_what_direct_means() -> None:
    gpu = "  actor: {gpu: H100}\n  rollout: {gpu: H100}\n  generation: {engine: transformers}\n"
    assert only_run(HEAD + gpu + "  sync: {method: direct}\n").spec_dict()["sync"]["method"] == "ipc"
    with pytest.raises(SpecError, match=r"spec\.sync\.method: 'direct' is ipc here, which shares"):
        load_text(HEAD + "  sync: {method: direct}\n", source="run.yaml")
