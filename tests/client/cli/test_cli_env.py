"""`mortalctl env serve module:Class`: refuses to start without a token or with a class it cannot serve, and
serves the class's description to whoever holds the token until interrupted."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import urllib3
from typer.testing import CliRunner

from mortal.client.cli.main import app

FIXTURES = Path(__file__).resolve().parents[2] / "workers" / "rollout"  # service_environments.py
LEDGER = "service_environments:Ledger"


def test_serve_refuses_without_a_token_or_a_servable_class(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MORTAL_ENV_TOKEN", raising=False)
    missing = CliRunner().invoke(app, ["env", "serve", LEDGER])
    assert missing.exit_code == 1 and "$MORTAL_ENV_TOKEN is not set" in missing.output
    monkeypatch.setenv("MORTAL_ENV_TOKEN", "t" * 32)
    malformed = CliRunner().invoke(app, ["env", "serve", "envs.py"])
    assert malformed.exit_code == 1 and "is named 'module:Class'" in malformed.output
    absent = CliRunner().invoke(app, ["env", "serve", "no_such_module_here:Env", "--port", "0"])
    assert absent.exit_code == 1 and "cannot be imported here: ModuleNotFoundError" in absent.output
    monkeypatch.syspath_prepend(str(FIXTURES))
    undescribed = CliRunner().invoke(app, ["env", "serve", "service_environments:Undescribed", "--port", "0"])
    assert undescribed.exit_code == 1, undescribed.output  # every worker would refuse it (ToolInvalid)
    assert "TRL cannot describe the tools of 'service_environments:Undescribed'" in undescribed.output
    assert "Undescribed.look:" in undescribed.output


def test_serve_answers_with_the_token_until_interrupted(tmp_path: Path) -> None:
    """Run from the folder that holds the class's module, as a user runs it: no PYTHONPATH needed."""
    env = {**os.environ, "MORTAL_ENV_TOKEN": "s" * 32, "MORTAL_HOME": str(tmp_path)}
    env.pop("PYTHONPATH", None)
    # the console script, as installed: `python -m` would put the folder on sys.path itself
    mortalctl = str(Path(sys.executable).with_name("mortalctl"))
    command = [mortalctl, "env", "serve", LEDGER, "--port", "0", "--processes", "1"]
    server = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True, cwd=FIXTURES)
    try:
        assert server.stderr is not None
        line = server.stderr.readline()
        match = re.search(r"serving service_environments:Ledger on (http://127\.0\.0\.1:\d+)", line)
        assert match, line
        http = urllib3.PoolManager(retries=False)
        assert http.request("GET", match[1] + "/v1/environments").status == 401
        answer = http.request(
            "GET", match[1] + "/v1/environments", headers={"Authorization": "Bearer " + "s" * 32}
        )
        assert answer.status == 200 and answer.json()["environments"][LEDGER]["name"] == "Ledger"
    finally:
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=30) == 0
