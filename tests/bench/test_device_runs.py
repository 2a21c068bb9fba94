"""bench/device_runs.py's table of GPU runs: every group names scripts that exist, with flags those
scripts accept, fits one device call, and says what it measures without dates or issue numbers; the
runner prints its commands in a dry run and stops a step at its limit."""

from __future__ import annotations

import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import device_runs  # noqa: E402

CALL_SECONDS = 600
BENCHES = sorted(
    {
        (name, step)
        for name, group in device_runs.GROUPS.items()
        for step in group.steps
        if isinstance(step, device_runs.Bench)
    },
    key=lambda pair: (pair[0], pair[1].name),
)
OPTION = re.compile(r"(--[a-z0-9][a-z0-9-]*)(?: \[?\{([^}]*)\})?")


@cache
def accepted_options(script: str) -> dict[str, set[str] | None]:
    """The script's options from its own --help, each with its choices (None: any value)."""
    shown = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), "--help"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    ).stdout
    options: dict[str, set[str] | None] = {}
    for flag, choices in OPTION.findall(shown):
        if choices or flag not in options:
            options[flag] = set(choices.split(",")) if choices else None
    return options


def given_options(args: tuple[str, ...]) -> list[tuple[str, list[str]]]:
    """Each --flag of a step's arguments with the values that follow it."""
    given: list[tuple[str, list[str]]] = []
    for arg in args:
        if arg.startswith("--"):
            given.append((arg, []))
        else:
            assert given, f"a value before any flag: {args}"
            given[-1][1].append(arg)
    return given


@pytest.mark.parametrize(("group", "step"), BENCHES, ids=lambda x: x if isinstance(x, str) else x.name)
def test_every_bench_step_passes_only_flags_and_choices_its_script_accepts(group, step):
    assert (REPO / "bench" / step.script).is_file(), f"{group}: no bench/{step.script}"
    options = accepted_options(step.script)
    for flag, values in given_options(step.args):
        assert flag in options, f"{group}/{step.name}: bench/{step.script} has no {flag}"
        choices = options[flag]
        assert choices is None or set(values) <= choices, (
            f"{group}/{step.name}: {flag} {values} not in {choices}"
        )


@pytest.mark.parametrize(("group", "step"), BENCHES, ids=lambda x: x if isinstance(x, str) else x.name)
def test_the_runner_adds_the_json_and_logs_flags_the_script_has(group, step):
    options = accepted_options(step.script)
    assert "--json" in options and "--json" not in step.args
    assert not step.logs or "--logs" in options


def test_every_tests_step_names_files_that_hold_gpu_marked_tests():
    for group in device_runs.GROUPS.values():
        for step in group.steps:
            if isinstance(step, device_runs.GpuTests):
                for path in step.paths:
                    assert "mark.gpu" in (REPO / path).read_text(), (
                        f"{step.name}: {path} has no gpu-marked test"
                    )


@pytest.mark.parametrize("name", sorted(device_runs.GROUPS))
def test_a_group_fits_one_call_and_its_step_names_are_its_own(name):
    group = device_runs.GROUPS[name]
    assert sum(step.limit_s for step in group.steps) <= CALL_SECONDS
    names = [step.name for step in group.steps]
    assert len(names) == len(set(names)), f"{name}: two steps would write one JSON"


def test_the_table_carries_no_dates_or_issue_numbers():
    text = (REPO / "bench" / "device_runs.py").read_text()
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b|\bissue \d+|\bstop \d+", text, re.IGNORECASE)


def test_a_dry_run_prints_each_steps_command_and_runs_nothing(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert device_runs.main(["two-gpus-ddp", "--dry-run"]) == 0
    commands = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    assert len(commands) == 3 and all("bench/gpu_step.py" in line for line in commands)
    assert f"--json {tmp_path}/two_gpus_ddp_st0.json" in commands[1] and "--strategy ddp" in commands[1]
    assert list(tmp_path.iterdir()) == []


def test_only_runs_the_named_steps_and_refuses_a_step_the_group_lacks(capsys):
    assert device_runs.main(["two-gpus-ddp", "--dry-run", "--only", "two_gpus_ddp_st1"]) == 0
    assert "two_gpus_ddp_st1" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no step nope"):
        device_runs.main(["two-gpus-ddp", "--dry-run", "--only", "nope"])


def test_a_group_whose_needs_are_missing_runs_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(device_runs, "gpus_here", lambda: 1)
    monkeypatch.setenv("MORTAL_TEST_ASSETS", str(tmp_path))
    with pytest.raises(device_runs.MissingNeed, match="GGUF"):
        device_runs.check_needs(device_runs.GROUPS["multiturn"], tmp_path / "absent.gguf")
    with pytest.raises(device_runs.MissingNeed, match="2 GPU"):
        device_runs.check_needs(device_runs.GROUPS["two-gpus-ddp"], tmp_path / "absent.gguf")


def test_a_step_past_its_limit_is_stopped_and_its_output_kept(tmp_path):
    step = device_runs.Bench("sleeper", "gpu_step.py", (), limit_s=1)
    sleeper = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"]
    code = device_runs.run_step(step, sleeper, out=tmp_path, logs=tmp_path)
    assert code == -15  # SIGTERM, which the benches answer by saving what they measured
    assert "started" in (tmp_path / "all.log").read_text()
