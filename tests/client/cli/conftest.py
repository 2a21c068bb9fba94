"""Fixtures of the mortalctl tests: invoke the CLI against a fresh store, write spec files.

    cli("get", "runs")            typer's CliRunner, with --state-url of the test's store (sqlite or
                                  postgres via tests/conftest.py's store_url); returns the Result
    spec_file(name=..., **edits)  a copy of specs/examples/quickstart.yaml with edits, as a Path
    tiny_model                    a tiny random-init model of SmolLM2's vocabulary (built once a module)
    calculator_spec(name, **edits)  the calculator's spec on a scripted model that calls the tool, with edits
    scripted_calculator           calculator_spec() unedited, as a Path

Every test runs with MORTAL_NO_CONTROLLER=1 (no background controller) and its env restored.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from clihelpers import DROP, QUICKSTART
from ruamel.yaml import YAML
from typer.testing import CliRunner

from mortal.client.cli.main import app

sys.path.insert(0, str(Path(__file__).parents[2] / "workers"))  # the tiny-model helpers of the worker tests


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
    if value is DROP:
        doc.pop(last, None)
    else:
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


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollout_helpers import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("cli") / "tiny")


@pytest.fixture
def calculator_spec(
    spec_file: Callable[..., Path], tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> Callable[..., Path]:
    """Writes the calculator run (builtin:arith, the calculator tool, correct_answer) with `changes` over it
    (spec_file's dotted paths), whose model is scripted (tool_helpers.ArithScript: it calls the calculator,
    then answers with its result), since a random tiny model never calls a tool; the loop, the tool, parsing
    and scoring stay the worker's own."""
    from tool_helpers import ArithScript

    import mortal.workers.rollout.engines as engines

    monkeypatch.setattr(engines, "select_engine", lambda *args, **kwargs: ArithScript)

    def write(name: str = "calc", **changes: object) -> Path:
        calculator = {
            "spec.model": {"name": str(tiny_model), "dtype": "float32"},
            "spec.dataset": {"name": "builtin:arith"},
            "spec.rewards": [{"function": "mortal.workers.rewards.builtin:correct_answer"}],
            "spec.generation.maxTokens": 96,
            "spec.rollout.tools": ["mortal.workers.rollout.builtin_tools:calculator"],
            "spec.rollout.chatTemplate": "qwen2_5",
        }
        return spec_file(name, **{**calculator, **changes})

    return write


@pytest.fixture
def scripted_calculator(calculator_spec: Callable[..., Path]) -> Path:
    """The calculator run on the scripted model, as calculator_spec writes it unchanged."""
    return calculator_spec()
