"""`mortalctl get metrics RUN`: a row per step, a column per metric, or --plot their curves.

CliRunner tests on every store (SQLite, PostgreSQL, HTTP), and the verb in a real process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from clihelpers import QUICKSTART, actor
from ruamel.yaml import YAML

from mortal.client.cli.metrics import step_ticks
from mortal.state import open_store

VALUES = {
    step: {"reward": 0.1 * step, "loss": 1.0 / step, "kl": 0.0, "tokens_per_second": 100.0 + step}
    for step in (1, 2, 3)
}


@pytest.fixture
def recorded(cli, store_url):
    """quickstart applied, three steps of metrics recorded as the actor records them (step 2 lacks kl)."""
    assert cli("apply", "-f", str(QUICKSTART)).exit_code == 0
    store = open_store(store_url)
    ref = actor(store, "quickstart")
    for step, values in VALUES.items():
        store.add_metrics(ref, step, {k: v for k, v in values.items() if (step, k) != (2, "kl")})
    store.close()
    return "quickstart"


def test_the_usual_metrics_recorded_one_row_per_step(cli, recorded) -> None:
    out = cli("get", "metrics", recorded)
    assert out.exit_code == 0, out.output
    assert [line.split() for line in out.stdout.splitlines()] == [
        ["STEP", "reward", "loss", "kl"],  # of the usual ones, those recorded, in the usual order
        ["1", "0.1", "1", "0"],
        ["2", "0.2", "0.5", "-"],
        ["3", "0.3", "0.3333", "0"],
    ]


def test_names_pick_the_columns_and_all_shows_every_one(cli, recorded) -> None:
    picked = cli("get", "metrics", recorded, "--name", "tokens_per_second,reward")
    assert picked.stdout.splitlines()[0].split() == ["STEP", "tokens_per_second", "reward"]
    every = cli("get", "metrics", recorded, "--name", "all")
    assert every.stdout.splitlines()[0].split() == ["STEP", "kl", "loss", "reward", "tokens_per_second"]


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_json_and_yaml_hold_every_value(cli, recorded, fmt: str) -> None:
    out = cli("get", "metrics", recorded, "--name", "all", "-o", fmt)
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout) if fmt == "json" else YAML(typ="safe").load(out.stdout)
    assert (doc["kind"], doc["run"]) == ("MetricList", "quickstart")
    assert doc["items"][1] == {"step": 2, "values": {"loss": 0.5, "reward": 0.2, "tokens_per_second": 102.0}}


def test_plot_draws_one_chart_per_metric_over_the_steps(cli, recorded) -> None:
    out = cli("get", "metrics", recorded, "--name", "reward,loss", "--plot")
    assert out.exit_code == 0, out.output
    lines = out.stdout.splitlines()
    assert [line.strip() for line in lines if line.strip() in ("reward", "loss", "step")] == [
        "reward",
        "loss",
        "step",
    ]
    assert any(line.split() == ["1", "2", "3"] for line in lines), "whole steps on the x axis"
    assert "\x1b[" not in out.stdout, "no colors when stdout is not a terminal"
    assert step_ticks(list(range(1, 101))) == [1, 13, 25, 37, 49, 61, 73, 85, 97, 100]


def test_bad_input_names_the_flag(cli, recorded) -> None:
    typo = cli("get", "metrics", recorded, "--name", "reward,rewrd")
    assert (typo.exit_code, typo.stderr) == (
        1,
        "error: --name rewrd: trainingrun/quickstart has no metric 'rewrd'; did you mean 'reward'?\n",
    )
    unknown = cli("get", "metrics", recorded, "--name", "zzz")
    assert unknown.exit_code == 1 and "(recorded: kl, loss, reward, tokens_per_second)" in unknown.stderr
    plot_json = cli("get", "metrics", recorded, "--plot", "-o", "json")
    assert plot_json.exit_code == 2 and "'-o'" in plot_json.stderr
    missing = cli("get", "metrics", "nope")
    assert (missing.exit_code, missing.stderr) == (1, "error: trainingrun 'nope' not found\n")


def test_a_run_with_none_yet_says_so(cli) -> None:
    assert cli("apply", "-f", str(QUICKSTART)).exit_code == 0
    out = cli("get", "metrics", "quickstart", "--plot")
    assert (out.exit_code, out.stdout) == (0, "") and "No metrics of trainingrun/quickstart" in out.stderr


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_as_a_process(recorded, mortal_home, store_url) -> None:
    env = {**os.environ, "MORTAL_HOME": str(mortal_home), "MORTAL_STATE_URL": store_url, "COLUMNS": "100"}

    def mortalctl(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "mortal.client.cli.main", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )

    table = mortalctl("get", "metrics", recorded, "--name", "loss")
    assert (table.returncode, table.stdout.split()) == (
        0,
        ["STEP", "loss", "1", "1", "2", "0.5", "3", "0.3333"],
    )
    chart = mortalctl("get", "metrics", recorded, "--name", "reward", "--plot")
    assert chart.returncode == 0, chart.stderr
    assert max(len(line) for line in chart.stdout.splitlines()) <= 100
    bad = mortalctl("get", "metrics", recorded, "--name", "nope")
    assert bad.returncode == 1 and bad.stderr.startswith("error: --name nope:")
