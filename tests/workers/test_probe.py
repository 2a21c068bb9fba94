"""Admission's dataset check (mortal.workers.probe.check_dataset): every line of a local JSON-lines file is
checked as the actor reads it, up to ADMISSION_READ_BYTES, and a bad one is named by its 1-based line."""

from __future__ import annotations

from pathlib import Path

import pytest

from mortal.specs.training import TrainingSpec
from mortal.workers import probe

GOOD = b'{"prompt": "What is 1 + 1?"}\n'


def dataset_check(path: Path, **dataset: object) -> probe.Check:
    return probe.check_dataset(
        TrainingSpec.model_validate(
            {
                "model": {"name": "HuggingFaceTB/SmolLM2-135M-Instruct"},
                "dataset": {"name": str(path), **dataset},
            }
        )
    )


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (GOOD * 5 + b"{not json\n", "line 6 is not JSON"),
        (GOOD + b'{"prompt": "\xff"}\n', "line 2 is not UTF-8 text (byte 0xff at column 13)"),
        (
            GOOD + b'{"question": "x"}\n',
            "line 2 has no 'prompt' column (spec.dataset.promptColumn): question",
        ),
        (GOOD + b"7\n", "line 2 is a number, not a JSON object"),
        (GOOD + b'{"prompt": 7}\n', "line 2 has a 'prompt' that is a number"),
        (b"\n\n", "the file has no rows"),
    ],
)
def test_every_line_is_checked_and_the_first_bad_one_named(tmp_path: Path, make: bytes, message: str) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(make)
    check = dataset_check(path)
    assert check.state == "failed" and check.message.startswith(f"{str(path)!r}: {message}")


def test_a_file_of_good_lines_passes_and_lines_past_max_samples_are_not_read(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(GOOD * 3 + b"{not json\n")
    assert dataset_check(path, maxSamples=3) == probe.ok("spec.dataset.name", f"{str(path)!r}: a local file")
    assert dataset_check(path).state == "failed"


def test_lines_past_the_read_bound_are_left_to_the_actor_and_the_check_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(probe, "ADMISSION_READ_BYTES", len(GOOD) * 2 + 5)
    path = tmp_path / "d.jsonl"
    path.write_bytes(GOOD * 3 + b"{not json\n")
    check = dataset_check(path)
    assert check.state == "ok"
    assert "lines 1-2 checked, the rest (past " in check.message
    path.write_bytes(GOOD + b"{not json\n" + GOOD * 3)
    assert dataset_check(path).message.endswith(
        "line 2 is not JSON: Expecting property name enclosed in double quotes (column 2)"
    )
