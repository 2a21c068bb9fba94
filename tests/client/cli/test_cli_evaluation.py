"""`mortalctl test eval`: a model scored on rows of its run's dataset by the run's rewards, without training
(held-out rows, a checkpoint against its base); bad flags name the flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rollout_helpers import assets_available, make_tiny_model

pytestmark = [
    pytest.mark.skipif(not assets_available(), reason="SmolLM2 assets missing"),
    pytest.mark.parametrize("store_url", ["sqlite"], indirect=True),
]


def _tiny_spec(spec_file, tiny_model):
    model = {"name": str(tiny_model), "dtype": "float32"}
    return spec_file("tiny", **{"spec.model": model, "spec.generation.maxTokens": 4})


def test_each_reward_is_averaged_over_every_completion_of_the_rows_and_each_row_has_its_mean(
    cli, spec_file, tiny_model
) -> None:
    path = _tiny_spec(spec_file, tiny_model)
    result = cli("test", "eval", "-f", str(path), "--rows", "1:3", "-n", "2", "-o", "json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert (doc["rows"], doc["completionsPerRow"], doc["model"]) == ("1:3", 2, str(tiny_model))
    assert set(doc["rewards"]) == {"correct_answer", "short_answer"}
    assert [r["row"] for r in doc["perRow"]] == [1, 2]
    means = [r["weightedMean"] for r in doc["perRow"]]
    assert doc["weightedMean"] == pytest.approx(sum(means) / 2)
    again = json.loads(cli("test", "eval", "-f", str(path), "--rows", "1:3", "-n", "2", "-o", "json").stdout)
    assert again == doc  # a seed per row: the same rows score the same
    text = cli("test", "eval", "-f", str(path), "--rows", "0:1", "-n", "1")
    assert text.exit_code == 0 and "weighted sum, mean:" in text.output and "correct_answer" in text.output


def test_another_model_is_scored_on_the_same_rows_and_one_that_cannot_load_names_the_flag(
    cli, spec_file, tiny_model, tmp_path: Path
) -> None:
    other = make_tiny_model(tmp_path / "other", seed=3)
    path = _tiny_spec(spec_file, tiny_model)
    args = ["test", "eval", "-f", str(path), "--rows", "0:2", "-n", "1", "-o", "json"]
    doc = json.loads(cli(*args, "--model", str(other)).stdout)
    assert doc["model"] == str(other) and len(doc["perRow"]) == 2
    missing = cli(*args, "--model", str(tmp_path / "no-such-checkpoint"))
    assert missing.exit_code == 1 and f"--model {tmp_path / 'no-such-checkpoint'}: " in missing.output
    assert "no such file or folder" in missing.output


def test_a_tool_calling_run_is_scored_through_the_workers_tool_loop(cli, scripted_calculator) -> None:
    """The scripted model answers every row right, through the loop, the tool and the reward of a worker."""
    args = ["test", "eval", "-f", str(scripted_calculator), "--rows", "0:3", "-n", "2", "-o", "json"]
    doc = json.loads(cli(*args).stdout)
    assert doc["rewards"] == {"correct_answer": 1.0}
    assert [r["weightedMean"] for r in doc["perRow"]] == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rows", "3"], "--rows 3: write A:B (rows A to B-1), e.g. 0:16"),
        (["--rows", "2:2"], "--rows 2:2: "),
        (["--rows", "0:100000"], "--rows 0:100000: "),
        (["--rows", "0:1", "-n", "0"], "-n 0: must be at least 1"),
        (["--rows", "0:1", "--device", "tpu"], "--device tpu: choose auto, cpu or cuda"),
        (["--rows", "0:1", "-o", "xml"], "-o xml: choose json or yaml"),
        (["--rows", "0:1", "--model", ""], "--model : "),
    ],
)
def test_bad_flags_name_the_flag(cli, spec_file, args, message) -> None:
    result = cli("test", "eval", "-f", str(spec_file()), *args)
    assert result.exit_code == 1 and message in result.output, result.output
