"""Fixtures of the mortalctl tests: invoke the CLI against a fresh store, write spec files.

    cli("get", "runs")            typer's CliRunner, with --state-url of the test's store (sqlite or
                                  postgres via tests/conftest.py's store_url); returns the Result
    spec_file(name=..., **edits)  a copy of specs/examples/quickstart.yaml with edits, as a Path

Every test runs with MORTAL_NO_CONTROLLER=1 (no background controller) and its env restored.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from clihelpers import QUICKSTART
from ruamel.yaml import YAML
from typer.testing import CliRunner

from mortal.client.cli.main import app


@pytest.fixture(autouse=True)
def _no_controller(monkeypatch: pytest.MonkeyPatch, mortal_home: Path) -> None:
    monkeypatch.setenv("MORTAL_NO_CONTROLLER", "1")
    monkeypatch.delenv("MORTAL_DEBUG", raising=False)
    monkeypatch.setenv("COLUMNS", "250")


@pytest.fixture
def cli(store_url: str) -> Callable[..., Any]:
    runner = CliRunner()

    def invoke(*args: str, input: str | None = None) -> Any:
        return runner.invoke(app, ["--state-url", store_url, *args], input=input)

    return invoke


def quickstart_doc() -> dict[str, Any]:
    return YAML(typ="safe").load(QUICKSTART.read_text())


def set_path(doc: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        doc = doc.setdefault(key, {})
    doc[last] = value


@pytest.fixture
def spec_file(tmp_path: Path) -> Callable[..., Path]:
    """spec_file("a", **{"spec.rollout.replicas": 3}) -> a YAML file of run "a" with that edit."""

    def write(name: str = "quickstart", **edits: Any) -> Path:
        doc = copy.deepcopy(quickstart_doc())
        doc["metadata"]["name"] = name
        for dotted, value in edits.items():
            set_path(doc, dotted, value)
        path = tmp_path / f"{name}-{len(list(tmp_path.glob('*.yaml')))}.yaml"
        yaml = YAML()
        with path.open("w") as fh:
            yaml.dump(doc, fh)
        return path

    return write
