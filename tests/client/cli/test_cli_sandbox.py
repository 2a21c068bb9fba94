"""`mortalctl sandbox run FILE.py`: the file runs confined and its result comes back as JSON; bad input is
refused naming the file or the flag, before anything runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mortal.client.cli.main import app
from mortal.specs import SandboxSpec
from mortal.workers.rewards import confinement


@pytest.fixture
def sandbox_works() -> str:
    """The mode auto picks here; the test is skipped on a machine where no confinement works."""
    for mode in ("bubblewrap", "unshare"):
        if confinement.probe(mode) is None:
            return mode
    pytest.skip(
        "no confinement works here: "
        + "; ".join(str(confinement.probe(m)) for m in ("bubblewrap", "unshare"))
    )


def invoke(*args: str):
    return CliRunner().invoke(app, ["sandbox", "run", *args])


def write(tmp_path: Path, code: str, name: str = "main.py") -> Path:
    path = tmp_path / name
    path.write_text(code)
    return path


def test_a_file_runs_confined_and_its_result_is_json(
    tmp_path: Path, sandbox_works: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MORTAL_TEST_SECRET", "hunter2")
    code = (
        "import os, socket\nprint(os.environ.get('MORTAL_TEST_SECRET'), socket.gethostname())\n"
        "print(sum(range(10)))"
    )
    result = invoke(str(write(tmp_path, code)), "--timeout", "5", "--memory-mb", "256")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["success"] and doc["exitCode"] == 0 and not doc["timedOut"] and doc["signal"] is None
    assert doc["stdout"] == "None sandbox\n45\n" and doc["stderr"] == ""
    assert doc["confinement"] == sandbox_works and "no network" in doc["confines"]
    assert (doc["bwrap"] is not None) == (sandbox_works == "bubblewrap")
    assert doc["limits"] == {"timeoutSeconds": 5.0, "memoryMB": 256}


def test_a_failing_or_endless_file_exits_1_with_the_result(tmp_path: Path, sandbox_works: str) -> None:
    failed = invoke(str(write(tmp_path, "raise SystemExit('no luck')")))
    assert failed.exit_code == 1
    doc = json.loads(failed.stdout)
    assert not doc["success"] and doc["exitCode"] == 1 and doc["stderr"] == "no luck\n"
    endless = invoke(str(write(tmp_path, "while True:\n    pass", "loop.py")), "--timeout", "1")
    assert endless.exit_code == 1
    doc = json.loads(endless.stdout)
    assert doc["timedOut"] and doc["signal"] == "SIGKILL" and 1.0 <= doc["durationSeconds"] < 5


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{tmp}/absent.py"], "error: {tmp}/absent.py: no such file"),
        (["{tmp}"], "error: {tmp}: not a file"),
        (
            ["{tmp}/latin1.py"],
            "error: {tmp}/latin1.py: not UTF-8 text (byte 7); a Python source file is needed",
        ),
        (["{tmp}/ok.py", "--timeout", "0"], "error: --timeout 0.0: input should be greater than 0"),
        (["{tmp}/ok.py", "--timeout", "inf"], "error: --timeout inf: must be a finite number of seconds"),
        (
            ["{tmp}/ok.py", "--memory-mb", "8"],
            "error: --memory-mb 8: input should be greater than or equal to 16",
        ),
        (
            ["{tmp}/ok.py", "--confinement", "none"],
            "error: --confinement none: choose auto, bubblewrap, unshare",
        ),
    ],
    ids=["missing", "folder", "not-utf8", "timeout-0", "timeout-inf", "memory-8", "unconfined"],
)
def test_bad_input_is_refused_naming_the_file_or_flag(tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "latin1.py").write_bytes(b"print('\xe9')")
    write(tmp_path, "print(1)", "ok.py")
    result = invoke(*[a.format(tmp=tmp_path) for a in args])
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.strip() == message.format(tmp=tmp_path)


def test_a_number_that_is_not_one_is_a_usage_error() -> None:
    result = invoke("x.py", "--memory-mb", "lots")
    assert result.exit_code == 2 and "'--memory-mb'" in result.stderr


def test_no_working_sandbox_is_an_error_not_an_unconfined_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(confinement, "_probed", {})  # as on a machine with neither tool
    monkeypatch.setattr(confinement, "bundled_bwrap", lambda: None)
    monkeypatch.setenv("PATH", str(tmp_path))
    result = invoke(str(write(tmp_path, "open('ran', 'w')")))
    assert result.exit_code == 1 and result.stdout == "" and not (tmp_path / "ran").exists()
    assert result.stderr.startswith(
        "error: no sandbox works on this machine (bubblewrap: bwrap is not on PATH"
    )


def test_mortalctl_sandbox_run_as_a_process(tmp_path: Path, sandbox_works: str) -> None:
    mortalctl = Path(sys.executable).with_name("mortalctl")
    command = [str(mortalctl)] if mortalctl.exists() else [sys.executable, "-m", "mortal.client.cli.main"]
    env = {k: v for k, v in os.environ.items() if k != "MORTAL_DEBUG"}
    path = write(tmp_path, "import sys\nprint(sys.stdin.read() == '', open('main.py').read().count('print'))")
    done = subprocess.run(
        [*command, "sandbox", "run", str(path), "--timeout", "5"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["stdout"] == "True 2\n" and doc["confinement"] == sandbox_works and doc["file"] == str(path)
    missing = subprocess.run(
        [*command, "sandbox", "run", str(tmp_path / "gone.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert (missing.returncode, missing.stdout) == (1, "")
    assert missing.stderr == f"error: {tmp_path / 'gone.py'}: no such file\n"


@pytest.mark.parametrize("verb", [["sandbox"], ["sandbox", "run"]], ids=" ".join)
def test_help_has_usage_and_examples(verb: list[str]) -> None:
    out = CliRunner().invoke(app, [*verb, "--help"])
    assert out.exit_code == 0 and out.stdout.startswith(f"Usage: mortalctl {' '.join(verb)}"), out.output
    assert ("mortalctl sandbox run solution.py" in out.stdout) == (verb == ["sandbox", "run"])
    if verb == ["sandbox", "run"]:  # the defaults it names are the spec's
        spec = SandboxSpec()
        assert (
            f"[default: {spec.timeout_seconds:g}]" in out.stdout
            and f"[default: {spec.memory_mb}]" in out.stdout
        )
