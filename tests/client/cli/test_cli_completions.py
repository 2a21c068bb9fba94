"""`mortalctl get completions RUN`: a step's sampled completions, newest step first, worst or best K.

CliRunner tests on every store (tests/conftest.py's store_url: SQLite, PostgreSQL, HTTP), and the
same verb as a user runs it, in a real process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from clihelpers import QUICKSTART, actor
from ruamel.yaml import YAML

from mortal.client.cli.completions import one_line, step_ranges
from mortal.state import NewCompletion, open_store

PROMPT = "system: Reply with only the number.\n\nuser: What is 13 + 14?"
LONG = "Let me think.\n\n" + "13 + 14 is 27. " * 40  # far wider than a table cell


def _sample(i: int, reward: float | None, completion: str = "27") -> NewCompletion:
    return NewCompletion(
        sample=i,
        prompt=PROMPT,
        completion=completion,
        rewards={"correct_answer": reward},
        reward=reward,
        advantage=None if reward is None else reward - 0.5,
        weight_version=4,
        extra={"parsed": completion[:2]},
    )


@pytest.fixture
def recorded(cli, store_url):
    """quickstart applied; steps 1, 2 and 5 recorded, step 5: rewards 0.5, 1.0, 0.0, unscored, with one long
    text."""
    assert cli("apply", "-f", str(QUICKSTART)).exit_code == 0
    store = open_store(store_url)
    ref = actor(store, "quickstart")
    for step in (1, 2):
        store.add_completions(ref, step, [_sample(0, 0.0, "26")])
    store.add_completions(
        ref, 5, [_sample(0, 0.5, LONG), _sample(1, 1.0), _sample(2, 0.0, "26"), _sample(3, None)]
    )
    store.close()
    return "quickstart"


def _table(out) -> list[list[str]]:
    """The table's lines as cells (columns are at least three spaces apart; cells hold single spaces)."""
    assert out.exit_code == 0, out.output
    return [re.split(r" {3,}", line) for line in out.stdout.splitlines()]


def test_text_is_folded_onto_one_line_and_cut_where_it_matters() -> None:
    assert one_line("a\n\n  b\tc", 10) == "a b c"
    assert one_line("abcdefghij", 5) == "abcd…"
    assert one_line("abcdefghij", 5, keep_end=True) == "…ghij"
    assert step_ranges([1, 2, 3, 7, 9, 10]) == "1-3, 7, 9-10"


def test_the_newest_step_by_default_one_line_per_completion(cli, recorded) -> None:
    header, *rows = _table(cli("get", "completions", recorded))
    assert header == [
        "STEP",
        "SAMPLE",
        "REWARD",
        "ADVANTAGE",
        "WEIGHTS",
        "correct_answer",
        "parsed",
        "PROMPT",
        "COMPLETION",
    ]
    assert [r[:7] for r in rows] == [
        ["5", "0", "0.500", "+0.000", "4", "0.500", "Le"],
        ["5", "1", "1.000", "+0.500", "4", "1.000", "27"],
        ["5", "2", "0.000", "-0.500", "4", "0.000", "26"],
        ["5", "3", "-", "-", "4", "-", "27"],
    ]
    prompt, completion = rows[0][-2:]
    assert prompt.startswith("…") and prompt.endswith("number. user: What is 13 + 14?") and len(prompt) == 40
    assert completion.startswith("Let me think. 13 + 14 is 27. 13") and completion.endswith("…")
    assert len(completion) == 60 and rows[1][-1] == "27"


def test_worst_and_best_sort_by_total_reward(cli, recorded) -> None:
    worst = cli("get", "completions", recorded, "--worst", "2")
    assert [r[1].strip() for r in _table(worst)[1:]] == ["2", "0"]
    best = cli("get", "completions", recorded, "--step", "5", "--best", "1")
    assert [r[1].strip() for r in _table(best)[1:]] == ["1"]
    assert [r[0].strip() for r in _table(cli("get", "completions", recorded, "--step", "2"))[1:]] == ["2"]


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_json_and_yaml_hold_every_field_in_full(cli, recorded, fmt: str) -> None:
    out = cli("get", "completions", recorded, "-o", fmt, "--best", "4")
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout) if fmt == "json" else YAML(typ="safe").load(out.stdout)
    assert (doc["kind"], doc["run"], doc["step"]) == ("CompletionList", "quickstart", 5)
    assert [i["sample"] for i in doc["items"]] == [1, 0, 2, 3]
    long = doc["items"][1]
    assert (long["prompt"], long["completion"]) == (PROMPT, LONG)
    assert (long["reward"], long["rewards"], long["advantage"], long["weightVersion"], long["extra"]) == (
        0.5,
        {"correct_answer": 0.5},
        0.0,
        4,
        {"parsed": "Le"},
    )


def test_bad_input_names_the_flag(cli, recorded) -> None:
    missing = cli("get", "completions", recorded, "--step", "3")
    assert missing.exit_code == 1
    assert (
        missing.stderr == "error: --step 3: trainingrun/quickstart has no completions at that step "
        "(recorded: steps 1-2, 5)\n"
    )
    for flag in ("--worst", "--best", "--step"):
        bad = cli("get", "completions", recorded, flag, "0")
        assert bad.exit_code == 2 and f"'{flag}'" in bad.stderr
    both = cli("get", "completions", recorded, "--worst", "1", "--best", "1")
    assert both.exit_code == 2 and "'--best'" in both.stderr and "--worst" in both.stderr
    assert cli("get", "completions", recorded, "-o", "xml").exit_code == 2
    unknown = cli("get", "completions", "nope")
    assert (unknown.exit_code, unknown.stderr) == (1, "error: trainingrun 'nope' not found\n")


def test_a_run_with_none_yet_says_so(cli) -> None:
    assert cli("apply", "-f", str(QUICKSTART)).exit_code == 0
    out = cli("get", "completions", "quickstart")
    assert (out.exit_code, out.stdout) == (0, "")
    assert "No completions of trainingrun/quickstart recorded yet" in out.stderr
    doc = json.loads(cli("get", "completions", "quickstart", "-o", "json").stdout)
    assert (doc["step"], doc["items"]) == (None, [])


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_as_a_process(recorded, mortal_home, store_url) -> None:
    env = {**os.environ, "MORTAL_HOME": str(mortal_home), "MORTAL_STATE_URL": store_url, "COLUMNS": "250"}

    def mortalctl(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "mortal.client.cli.main", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )

    worst = mortalctl("get", "completions", recorded, "--worst", "1")
    assert worst.returncode == 0, worst.stderr
    assert worst.stdout.splitlines()[1].split()[:3] == ["5", "2", "0.000"]
    doc = json.loads(mortalctl("get", "completion", recorded, "--step", "5", "-o", "json").stdout)
    assert doc["items"][0]["completion"] == LONG
    bad = mortalctl("get", "completions", recorded, "--worst", "-1")
    assert bad.returncode == 2 and "'--worst'" in bad.stderr
